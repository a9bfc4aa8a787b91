"""The fleet-wide turn cap: at most ``max_concurrent_turns`` turns run at once across
every worker, each holding one slot row of the store, and a dead holder's slot is
taken over only on positive evidence.

Open first: ``slots.py`` (claim, renew, confirm before a send), ``takeover.py``.
"""
