"""The deployment entrypoints of ``prefect.yaml``: one module per deployment.

The top layer: these modules may import every other layer, nothing imports them
(except one another: ``recover-turn`` and ``expire-approvals`` reuse
``agent-workflow``).
"""
