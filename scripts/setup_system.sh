#!/usr/bin/env bash
# System pieces pip cannot install: Debian's libb64 for perf_analyzer.
# Idempotent: does nothing when the library is already loadable.
set -euo pipefail
PY=${1:-.venv/bin/python}
if ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  exit 0
fi
echo "perf_analyzer needs libb64.so.0d: installing Debian's libb64-0d"
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "error: not root and no sudo: install libb64-0d by hand (apt-get install libb64-0d)" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q libb64-0d >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q libb64-0d >/dev/null
}
ldconfig -p | grep -q 'libb64\.so\.0d' || { echo "error: libb64.so.0d still missing after apt-get install libb64-0d" >&2; exit 1; }
