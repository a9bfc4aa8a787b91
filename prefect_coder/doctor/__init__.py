"""``prefect-coder doctor``: will this product work against *this* Coder deployment?

Each check prints one line — ``OK`` / ``WARN`` / ``FAIL``, what it found, the fix — and
the command exits non-zero when any check fails (docs/doctor.md explains every line).

Read in this order:

* ``run.py`` — :func:`diagnose`, the checks in order of dependence;
* ``coder_verdicts.py``, ``local_verdicts.py``, ``build.py`` — the pure verdicts;
* ``observe_coder.py``, ``observe_local.py``, ``probe.py`` — the thin I/O that records
  what was observed (``observed.py``);
* ``target.py`` — which deployment, from a credentials block or flags;
* ``checks.py`` — the line, the report and its rendering.
"""

from .checks import Check, Report, Status
from .run import DoctorOptions, diagnose

__all__ = ["Check", "DoctorOptions", "Report", "Status", "diagnose"]
