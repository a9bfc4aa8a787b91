"""prefect-coder: durable Coder Agents workflows on Prefect 3.

The installed layout:

* :mod:`prefect_coder.blocks` — ``CoderCredentials`` and ``ChatStateStore``
  (the repository's ``blocks/`` folder);
* :mod:`prefect_coder.flows` — tasks, flows and deployment entrypoints
  (the repository's ``flows/`` folder);
* :mod:`coder_chat` — the Prefect-free chatd client, its own top-level package.

This module is the ``prefect.collections`` entry point: Prefect imports it in
every process of the environment, so it imports only the blocks (which
registers their types) and nothing of the flows.
"""

from prefect_coder.blocks import ChatStateStore, CoderCredentials

__all__ = ["ChatStateStore", "CoderCredentials"]
