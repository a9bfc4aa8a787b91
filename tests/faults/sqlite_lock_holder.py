"""A second process holding a SQLite file's write lock (issue 30, item 3): it takes
``BEGIN IMMEDIATE``, says ``locked`` on stdout, and rolls back and exits when a line
arrives on stdin. The test SIGSTOPs it while it holds the lock (a stopped or stuck
worker of the same machine) and SIGCONTs it to let go.

    python sqlite_lock_holder.py /path/to/state.db
"""

from __future__ import annotations

import sqlite3
import sys


def main(path: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("BEGIN IMMEDIATE")
    print("locked", flush=True)
    sys.stdin.readline()
    conn.execute("ROLLBACK")
    conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
