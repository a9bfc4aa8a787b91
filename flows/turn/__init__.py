"""The step tasks: the durable agent turn, the model-only step, the approval wait.

Imports only the rooms of layer 1 (``common``, ``observe``, ``fleet``, ``recovery``, ``sweeps``) (``tests/test_layers.py`` checks it).
"""
