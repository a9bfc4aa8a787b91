"""Bringing a crashed or unfinished attempt of a step to an end before anything new is
sent, and retiring a workflow's chats at its end.

Open first: ``before_send.py`` (recover_before_send: follow, read or resubmit an earlier
attempt), then what it uses: ``from_history.py`` (a step found in history, an archived
chat), ``recovered.py`` (the rebuilt result, the findings, timings, the report),
``send_journal.py`` (journal writes around sends); ``orphans.py`` (adopt a first turn's
orphan), ``eager_checkpoint.py``, ``retire.py``.
"""
