"""The workflow: validate, run the steps in order on one chat, own the chat's end of life.

Imports only the rooms of layer 1 (``common``, ``observe``, ``fleet``, ``recovery``, ``sweeps``) and :mod:`prefect_coder.flows.turn`
(``tests/test_layers.py`` checks it).
"""
