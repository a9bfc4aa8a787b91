"""Liveness: every workflow the product starts ends — completed or reported given-up.

``track.py`` writes the durable record of each run where it starts and ends;
``decide.py`` is the reconciler's pure decision per unfinished workflow. The
reconciler itself is ``flows/deployments/reconcile_workflows.py`` (docs/reconciler.md).
Imports no other room of ``prefect_coder.flows``.
"""
