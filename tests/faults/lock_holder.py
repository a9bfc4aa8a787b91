"""Drive :mod:`sqlite_lock_holder` from a test: start it, stop it, let it go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HOLDER = Path(__file__).resolve().parent / "sqlite_lock_holder.py"


class LockHolder:
    """A real second process holding ``path``'s write lock, SIGSTOPped while it holds it."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER), str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == "locked", line
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.locked_at = time.monotonic()
        #: When the release began (the lock goes right after): a write that returned
        #: without error while this is None never waited for the lock.
        self.releasing_at: float | None = None
        self.released_at: float | None = None

    def release(self) -> None:
        """SIGCONT, then tell it to roll back; waits until it has exited."""
        if self.releasing_at is not None:
            return
        self.releasing_at = time.monotonic()
        os.kill(self.proc.pid, signal.SIGCONT)
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)
        self.released_at = time.monotonic()

    def release_after(self, seconds: float) -> threading.Thread:
        """Release from a thread ``seconds`` after the lock was taken."""

        def run() -> None:
            time.sleep(max(0.0, self.locked_at + seconds - time.monotonic()))
            self.release()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=30)
