"""What every step, sweep and recovery shares: a step's parameters and result, the
errors and retry rule, registered tools and output models, chat labels, and the
resources a run holds (credentials, store, client, the workflow lease).

Open first: ``params.py`` (Step, WorkflowSettings), ``resources.py``, ``registry.py``.
Imports only :mod:`prefect_coder.flows.observe` among the rooms.
"""
