"""Make a directory refuse new files for a while — a real filesystem fault, no patching.

As an ordinary user ``chmod 0555`` does it. Root ignores file modes (CI and this
machine run the tests as root), so there the directory is made immutable with
``chattr +i`` (ext4, xfs, btrfs, tmpfs ≥ 6.0): creating a file in it then fails with
EPERM for root too. Either way the fault is verified by a probe write; a filesystem
that supports neither fails the test loudly instead of letting it pass vacuously.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["make_unwritable", "make_writable"]


def _refuses_new_files(directory: Path) -> bool:
    probe = directory / ".unwritable-probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return True
    probe.unlink()
    return False


def make_unwritable(directory: Path) -> None:
    """Make ``directory`` refuse new files (existing files stay readable)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
    else:
        chattr = shutil.which("chattr")
        if chattr is None:
            raise RuntimeError("running as root without chattr: cannot make a directory unwritable")
        subprocess.run([chattr, "+i", str(directory)], check=True, capture_output=True)
    if not _refuses_new_files(directory):
        make_writable(directory)
        raise RuntimeError(f"{directory} still accepts new files: the fault did not take")


def make_writable(directory: Path) -> None:
    """Undo :func:`make_unwritable` (idempotent)."""
    if os.geteuid() != 0:
        directory.chmod(0o755)
    else:
        chattr = shutil.which("chattr")
        if chattr is not None:
            subprocess.run([chattr, "-i", str(directory)], check=True, capture_output=True)
