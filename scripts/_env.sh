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
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null
    .venv/bin/python -m pip install -q -e '.[dev]'
    touch "$stamp"
  fi
}

pg_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
  return 1
}

ensure_postgres_binaries() {
  pg_bindir >/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing PostgreSQL server binaries (Debian package postgresql)..." >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    echo "PostgreSQL server binaries (initdb, pg_ctl) are needed for the store tests:" >&2
    echo "  sudo apt-get install postgresql   # or your platform's package" >&2
    exit 1
  fi
  pg_bindir >/dev/null
}
