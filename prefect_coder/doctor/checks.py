"""One doctor line: its verdict (OK / WARN / FAIL), what was found and the fix; the report.

Pure: no I/O. A check's text never holds a secret by construction (the observers keep
tokens and passwords out of everything they record); :meth:`Report.redacted` is the
last guard before printing, and replaces any secret that still reached a line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum

__all__ = ["Check", "Report", "Status"]


class Status(StrEnum):
    """A check's verdict. Only ``FAIL`` makes the doctor exit non-zero."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report: ``name`` (stable id), ``status``, what was ``found`` and,
    unless OK, the ``fix``."""

    name: str
    status: Status
    found: str
    fix: str = ""

    def line(self, width: int = 13) -> str:
        """``STATUS name  found  → fix``: one line, for a terminal or a log."""
        # Exception texts may span lines: one check stays one line.
        text = f"{self.status.value:<5} {self.name:<{width}}  {' '.join(self.found.split())}"
        if self.fix:
            text += f"  → {' '.join(self.fix.split())}"
        return text


@dataclass(frozen=True, slots=True)
class Report:
    """Every check of one doctor run, in the order they ran."""

    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def failed(self) -> bool:
        """True when any check failed."""
        return any(c.status is Status.FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        """1 when any check failed, else 0 (warnings do not fail the doctor)."""
        return 1 if self.failed else 0

    def counts(self) -> dict[str, int]:
        """How many checks ended in each status."""
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    def text(self) -> str:
        """The human report: one line per check, then a summary line."""
        width = max((len(c.name) for c in self.checks), default=0)
        lines = [c.line(width) for c in self.checks]
        n = self.counts()
        verdict = "FAIL" if self.failed else "OK"
        lines.append(f"{verdict}: {n['OK']} ok, {n['WARN']} warning(s), {n['FAIL']} failure(s)")
        return "\n".join(lines)

    def json(self) -> str:
        """The machine report: ``{"ok", "counts", "checks": [{name, status, found, fix}]}``."""
        return json.dumps(
            {
                "ok": not self.failed,
                "counts": self.counts(),
                "checks": [{**asdict(c), "status": c.status.value} for c in self.checks],
            },
            indent=2,
        )

    def redacted(self, secrets: Iterable[str]) -> Report:
        """This report with every occurrence of each secret replaced by ``***``."""
        words = [s for s in secrets if s]
        if not words:
            return self

        def clean(text: str) -> str:
            for w in words:
                text = text.replace(w, "***")
            return text

        return Report(
            tuple(replace(c, found=clean(c.found), fix=clean(c.fix)) for c in self.checks)
        )


def report(checks: Sequence[Check]) -> Report:
    """A report of ``checks`` in order."""
    return Report(tuple(checks))
