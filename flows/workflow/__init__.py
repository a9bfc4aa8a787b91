"""The workflow: validate, run the steps in order on one chat, own the chat's end of life.

Imports only :mod:`prefect_coder.flows.parts` and :mod:`prefect_coder.flows.turn`
(``tests/test_layers.py`` checks it).
"""
