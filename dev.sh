#!/usr/bin/env bash
# The quick start: `bash dev.sh train` runs the embedded default, `bash dev.sh test` runs the tests.
# Both install tandem first, into ./.venv (created on first use; it also sees packages installed
# system-wide, e.g. a torch you already have) unless a virtual environment is active or PYTHON names
# an interpreter. A venv also works where the system Python refuses pip installs (PEP 668).
# CPU torch here when none is installed (users with GPUs install their own build, or set TANDEM_TORCH).
set -euo pipefail
cd "$(dirname "$0")"
START=$SECONDS
LOG=${TMPDIR:-/tmp}/tandem-dev-install.$$.log
say() { echo "dev.sh [$((SECONDS - START)) s] $*" >&2; }

choose_python() {
  if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON; say "using PYTHON=$PY"
  elif [ -n "${VIRTUAL_ENV:-}" ]; then
    PY=python; say "using the active virtual environment $VIRTUAL_ENV"
  else
    if [ ! -x .venv/bin/python ]; then
      say "creating .venv (tandem's virtual environment; it also sees system-wide packages)"
      python3 -m venv --system-site-packages .venv || {
        rm -rf .venv
        echo "dev.sh: could not create .venv; install the venv module (Debian/Ubuntu: apt install python3-venv) or set PYTHON=/path/to/python" >&2
        exit 1
      }
    fi
    PY=.venv/bin/python
  fi
}

pip_install() {  # pip's own progress, one line per package; the whole log is kept for errors
  "$PY" -m pip install "$@" 2>&1 | tee -a "$LOG" |
    awk '/^(Collecting|Downloading|Installing|Successfully|ERROR)/ { print "  " $0; fflush() }' || {
    echo "dev.sh: pip install $* failed; the end of its log ($LOG):" >&2
    tail -n 20 "$LOG" >&2
    exit 1
  }
}

install() {
  choose_python
  if ! "$PY" -c "import torch" 2>/dev/null; then
    say "installing ${TANDEM_TORCH:-torch==2.13.0} (a CPU build where the index serves one; the longest step)"
    pip_install "${TANDEM_TORCH:-torch==2.13.0}"
  fi
  say "installing tandem and its dependencies (pip install -e \".[dev]\")"
  pip_install -e ".[dev]"
  "$PY" -c "import tandemrl" || { echo "dev.sh: install failed: tandemrl does not import" >&2; exit 1; }
  rm -f "$LOG"
  say "installed; $("$PY" -c 'import sys; print(sys.prefix)')/bin/tandem is the command"
}

cmd=${1:-}
shift || true
case "$cmd" in
  train) install; say "tandem train $*"; exec "$PY" -m tandemrl train "$@" ;;
  test)
    install
    say "pytest -m 'not gpu' $*"
    set +e
    "$PY" -m pytest -m "not gpu" "$@"
    rc=$?
    [ $rc -eq 5 ] && echo "pytest collected no tests: failing" >&2
    exit $rc ;;
  *) echo "usage: bash dev.sh train [FLAGS] | bash dev.sh test [PYTEST ARGS]" >&2; exit 2 ;;
esac
