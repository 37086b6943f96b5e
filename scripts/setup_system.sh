#!/usr/bin/env bash
# System pieces pip cannot install, from Debian's packages:
#   libb64-0d  libb64.so.0d, which perf_analyzer links
#   nginx      the load balancer of the replica demo (perf/demo_scale.py, tests/integration/test_scale.py);
#              run as the current user with its own config, never as the system service
#   g++        compiles tritonlm's C++ kernels (paged attention, fused ops) once per x86-64 ISA level
#              (make setup: python -m tritonlm.engine.kernels --prebuild; without it decode falls back to
#              the slower torch path)
# Idempotent: does nothing (and asks apt nothing) when all are already there.
set -euo pipefail
PY=${1:-.venv/bin/python}

have_libb64() { ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; }
# /usr/sbin is not on every user's PATH: look there too
have_nginx() { command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; }
have_gxx() { command -v g++ >/dev/null 2>&1; }

missing=()
have_libb64 || missing+=(libb64-0d)
have_nginx || missing+=(nginx)
have_gxx || missing+=(g++)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing Debian's ${missing[*]} (perf_analyzer needs libb64.so.0d; the replica demo nginx; the attention kernel g++)"
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "error: not root and no sudo: install ${missing[*]} by hand (apt-get install ${missing[*]})" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
# Installing nginx would start the system service on port 80 where an init system runs;
# the demo starts its own nginx, so keep the packaged service from starting (exit 101 =
# "action forbidden" to invoke-rc.d). Only when no policy of the machine's own is there.
POLICY=/usr/sbin/policy-rc.d
OWN_POLICY=0
if [[ " ${missing[*]} " == *" nginx "* ]] && [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"
  OWN_POLICY=1
fi
cleanup() { if [ "$OWN_POLICY" = 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}
have_libb64 || { echo "error: libb64.so.0d still missing after apt-get install libb64-0d" >&2; exit 1; }
have_nginx || { echo "error: nginx still missing after apt-get install nginx" >&2; exit 1; }
have_gxx || { echo "error: g++ still missing after apt-get install g++" >&2; exit 1; }
