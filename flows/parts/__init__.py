"""Building blocks of the flows: parameters, results, store access, observability,
labels, retries, tools, the turn slot, crash-recovery pieces and the sweeps' work.

Nothing here imports :mod:`prefect_coder.flows.turn`, ``.workflow`` or
``.deployments`` (``tests/test_layers.py`` checks it).
"""
