"""The fleet-wide turn cap: at most ``max_concurrent_turns`` turns run at once across
every worker, each holding one slot row of the store, and a dead holder's slot is
taken over only on positive evidence.

Open first: ``slots.py`` (``turn_slot``: claim, hold, confirm before a send), then
``claim.py`` (a free slot in one store call, else a gone holder's), ``takeover.py``
(may a gone holder's slot be taken?) and ``waiting.py`` (the process's claim queue,
what a waiting turn shows). A held slot is a store ``HeldLease``.
"""
