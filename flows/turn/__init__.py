"""The step tasks: the durable agent turn, the model-only step, the approval wait.

Imports only :mod:`prefect_coder.flows.parts` (``tests/test_layers.py`` checks it).
"""
