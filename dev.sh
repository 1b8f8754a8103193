#!/usr/bin/env bash
# The quick start: `bash dev.sh train` runs the embedded default, `bash dev.sh test` runs the tests.
# Both install tandem first (CPU torch here; users with GPUs install their own torch build).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
install() {
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "${TANDEM_TORCH:-torch==2.13.0}"   # a CPU build where the index serves one
  fi
  "$PY" -m pip install -q -e ".[dev]" 2>&1 | grep -v -e '^WARNING: Location' -e 'Running pip as' || true
  "$PY" -c "import tandemrl" || { echo "install failed" >&2; exit 1; }
}
cmd=${1:-}
shift || true
case "$cmd" in
  train) install; exec "$PY" -m tandemrl train "$@" ;;
  test)
    install
    set +e
    "$PY" -m pytest -m "not gpu" "$@"
    rc=$?
    [ $rc -eq 5 ] && echo "pytest collected no tests: failing" >&2
    exit $rc ;;
  *) echo "usage: bash dev.sh train [FLAGS] | bash dev.sh test [PYTEST ARGS]" >&2; exit 2 ;;
esac
