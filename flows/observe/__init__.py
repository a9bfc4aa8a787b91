"""What a person sees of a turn: log lines, Prefect events and artifacts, kept off
the turn's critical path. The lowest room of the flows: it imports no other room.

Open first: ``observer.py`` (transport events → logs and events), ``live_progress.py``
(a running turn's artifact), ``artifacts.py``; ``background.py`` runs their side work.
"""
