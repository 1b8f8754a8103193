#!/usr/bin/env bash
# The quick start: `bash dev.sh train` runs the embedded default, `bash dev.sh test` runs the tests.
# Both install tandem first, into ./.venv (created on first use; it also sees packages installed
# system-wide, e.g. a torch you already have) unless a virtual environment is active or PYTHON names
# an interpreter. A venv also works where the system Python refuses pip installs (PEP 668).
# CPU torch here when none is installed (users with GPUs install their own build, or set TANDEM_TORCH).
# A second call installs nothing unless pyproject.toml or the environment changed (a stamp in the env).
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

# pip's progress lines, each as it comes: Debian's default awk (mawk) block-buffers a pipe, so this
# filter is the interpreter being installed into, unbuffered (it exists wherever dev.sh runs)
FILTER='import sys
for line in sys.stdin:
    if line.startswith(("Collecting", "Downloading", "Installing", "Successfully", "ERROR")):
        print("  " + line, end="", flush=True)'

pip_install() {  # pip's own progress, one line per package; the whole log is kept for errors
  "$PY" -m pip install "$@" 2>&1 | tee -a "$LOG" | "$PY" -u -c "$FILTER" || {
    echo "dev.sh: pip install $* failed; the end of its log ($LOG):" >&2
    tail -n 20 "$LOG" >&2
    exit 1
  }
}

torch_spec() {  # pyproject.toml's torch range (or TANDEM_TORCH), so dev.sh and pip agree
  echo "${TANDEM_TORCH:-$(grep -o '"torch[^"]*"' pyproject.toml | head -n 1 | tr -d '"')}"
}

install_torch() {
  local spec; spec=$(torch_spec)
  # PyPI's Linux x86-64/aarch64 torch is the CUDA build (GBs of CUDA libraries); the CPU build has its own index.
  # Elsewhere (macOS, other CPUs) PyPI's wheel is the CPU one. TANDEM_TORCH (a pip requirement) chooses for you.
  case "$(uname -s)/$(uname -m)" in
    Linux/x86_64|Linux/aarch64)
      # Only where that index answers within 5 s: a machine whose pip reaches a mirror alone (which serves the CPU
      # build itself) would otherwise spend pip's retries on it.
      if [ -z "${TANDEM_TORCH:-}" ] && "$PY" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" 2>/dev/null; then
        say "installing $spec, the CPU build (--index-url https://download.pytorch.org/whl/cpu; the longest step)"
        pip_install "$spec" --index-url https://download.pytorch.org/whl/cpu
        return
      fi
      # No CPU index: where pip's own configuration names a local wheel folder (find-links) holding a CPU build in the
      # range, take it; the range alone would take the newest build, on Linux the CUDA one (GBs of CUDA libraries).
      if [ -z "${TANDEM_TORCH:-}" ]; then
        local cpu; cpu=$(local_cpu_torch "$spec")
        if [ -n "$cpu" ]; then
          say "installing torch==$cpu, the CPU build found in pip's find-links (the longest step)"
          pip_install "$spec" "torch==$cpu"
          return
        fi
        say "no CPU build of $spec reachable: pip may take the CUDA build (GBs); set TANDEM_TORCH to choose one"
      fi ;;
  esac
  say "installing $spec (the longest step)"
  pip_install "$spec"
}

local_cpu_torch() {  # the newest torch X+cpu wheel for this Python in pip's find-links folders, if pip accepts it with the range
  local dirs; dirs=$("$PY" -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p" | tr ' ' '\n')
  [ -n "$dirs" ] || return 0
  local tag; tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  local v
  for v in $(for d in $dirs; do ls "${d#file://}" 2>/dev/null; done | sed -n "s/^torch-\([0-9.]*+cpu\)-$tag-.*\.whl$/\1/p" | sort -t. -k1,1nr -k2,2nr -k3,3nr | uniq); do
    if "$PY" -m pip install --dry-run --quiet "$1" "torch==$v" >/dev/null 2>&1; then echo "$v"; return 0; fi
  done
}

stamp() {  # what the install depends on: pyproject.toml, the interpreter and its environment, TANDEM_TORCH
  { cat pyproject.toml; "$PY" -c 'import sys; print(sys.prefix, sys.version)'; echo "${TANDEM_TORCH:-}"; } | "$PY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

install() {
  choose_python
  local stamp_file; stamp_file="$("$PY" -c 'import sys; print(sys.prefix)')/.tandem-dev-stamp"
  local want; want=$(stamp)
  if [ "$(cat "$stamp_file" 2>/dev/null)" = "$want" ] && "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec(\"torch\") and u.find_spec(\"tandemrl\")))" 2>/dev/null; then
    say "install up to date (pyproject.toml and the environment unchanged since the last install): skipping pip"
    return
  fi
  if ! "$PY" -c "import torch" 2>/dev/null; then
    install_torch
  fi
  say "installing tandem and its dependencies (pip install -e \".[dev]\")"
  pip_install -e ".[dev]"
  "$PY" -c "import tandemrl" || { echo "dev.sh: install failed: tandemrl does not import" >&2; exit 1; }
  rm -f "$LOG"
  echo "$want" > "$stamp_file" 2>/dev/null || true  # an unwritable environment just installs again next time
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
