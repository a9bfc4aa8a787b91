"""The sweeps' work: find labelled chats nobody will finish or account for, and stop,
reconcile or archive them under the workflow lease. One run: list → plan → act → report.

Open first: ``run.py`` (one sweep run), ``plan.py`` (the pure decisions), ``acting.py``.
"""
