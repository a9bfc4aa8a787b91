# Shared set-up for scripts/test and scripts/demo (sourced, not run).
PYTHON=${PYTHON:-python3}

ensure_venv() {
  if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
      echo "prefect-coder needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
    "$PYTHON" -m venv .venv
  fi
  # Reinstall only when the project metadata changed since the last install.
  local stamp=.venv/.prefect-coder-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    install_project
    touch "$stamp"
  fi
}

# The project with its dev extras, installed by uv (from PyPI, into the venv) when it can:
# it resolves the same packages as pip (the same 123 installed, compared on 2026-12-02)
# but downloads, unpacks and byte-compiles in parallel. A fresh install measured at load
# 6 on the 2-core machine: pip 208 s wall / 87 CPU-s, uv 48 s / 30 CPU-s — most of a
# fresh CI run's set-up. uv does not read pip's configuration (a private index, a proxy
# set only there): when uv cannot be installed or its install fails, pip does it as
# before. PREFECT_CODER_INSTALLER=pip always uses pip.
install_project() {
  if [ "${PREFECT_CODER_INSTALLER:-uv}" = uv ] \
      && .venv/bin/python -m pip install -q uv >/dev/null 2>&1 \
      && .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -e '.[dev]'; then
    return 0
  fi
  [ "${PREFECT_CODER_INSTALLER:-uv}" = uv ] && echo "uv install failed; installing with pip" >&2
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e '.[dev]'
}

pg_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
  return 1
}

# Install Debian package $1 ("what it is for" in $2) as root with apt-get, or say
# what to install and exit.
install_debian_package() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing $2 (Debian package $1)..." >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
  else
    echo "$2 is needed by the tests:" >&2
    echo "  sudo apt-get install $1   # or your platform's package" >&2
    exit 1
  fi
}

ensure_postgres_binaries() {
  pg_bindir >/dev/null && return 0
  install_debian_package postgresql "PostgreSQL's server binaries (initdb, pg_ctl) for the store tests"
  pg_bindir >/dev/null
}

# libfaketime: tests/reconcile/test_skewed_server_clock.py runs a real Prefect server
# whose clock is minutes off the host's.
ensure_faketime() {
  command -v faketime >/dev/null && return 0
  install_debian_package faketime "libfaketime for the reconciler's clock-skew test"
  command -v faketime >/dev/null
}
