#!/usr/bin/env bash
# Container entry point.
#   tritonlm-entrypoint export   only export TRITONLM_MODEL into TRITONLM_REPO (an init container)
#   tritonlm-entrypoint serve    export if the repository is empty and TRITONLM_MODEL is set, then
#                                run tritonserver and the OpenAI API beside it until SIGTERM
# Environment: TRITONLM_REPO (default /models), TRITONLM_MODEL (e.g. smollm2-135m),
# TRITONLM_EXPORT_ARGS (extra `tritonlm export` options, e.g. "--device cuda"),
# TRITONLM_DRAIN_TIMEOUT (seconds in-flight requests get after SIGTERM, default 30),
# TRITONLM_OPENAI_PORT (default 9000; 0: off), TRITONLM_HOST (address every endpoint binds,
# default 0.0.0.0), TRITONLM_HTTP_PORT / _GRPC_PORT / _METRICS_PORT (default 8000 / 8001 / 8002).
set -euo pipefail
REPO=${TRITONLM_REPO:-/models}
MODEL=${TRITONLM_MODEL:-}
DRAIN=${TRITONLM_DRAIN_TIMEOUT:-30}
OPENAI_PORT=${TRITONLM_OPENAI_PORT:-9000}
HOST=${TRITONLM_HOST:-0.0.0.0}
HTTP_PORT=${TRITONLM_HTTP_PORT:-8000}
GRPC_PORT=${TRITONLM_GRPC_PORT:-8001}
METRICS_PORT=${TRITONLM_METRICS_PORT:-8002}
CONNECT=$HOST; [ "$HOST" = 0.0.0.0 ] && CONNECT=127.0.0.1  # where the frontend reaches tritonserver
MODE=${1:-serve}

has_models() { compgen -G "$REPO/*/config.pbtxt" >/dev/null; }

export_repo() {
  if has_models; then
    echo "model repository $REPO already holds models: not exporting"
    return 0
  fi
  if [ -z "$MODEL" ]; then
    echo "error: $REPO holds no model and TRITONLM_MODEL is not set (mount a repository or set TRITONLM_MODEL)" >&2
    exit 2
  fi
  mkdir -p "$REPO"
  # shellcheck disable=SC2086
  tritonlm export "$MODEL" --repo "$REPO" --formats onnx ${TRITONLM_EXPORT_ARGS:-}
}

case "$MODE" in
  export) export_repo; exit 0 ;;
  serve) export_repo ;;
  *) exec "$@" ;;  # anything else: run it (a shell, tritonlm ...)
esac

# The drain deadline reaches the backend through a file (tritonlm/glue/drain.py): at the
# deadline, what still runs ends with finish_reason "cancelled" and its final response.
# Triton's own exit timeout comes GRACE seconds later, the kill 3 s after that.
GRACE=5
export TRITONLM_DRAIN_FILE
TRITONLM_DRAIN_FILE=$(mktemp -d /tmp/tritonlm-drain-XXXXXX)/deadline

# Model control none: the repository loads at start and the load/unload API is off (the pod
# listens on every interface). --exit-timeout-secs: Triton's own drain on SIGTERM.
tritonserver --model-repository="$REPO" --model-control-mode=none \
  --http-address="$HOST" --grpc-address="$HOST" --metrics-address="$HOST" \
  --http-port="$HTTP_PORT" --grpc-port="$GRPC_PORT" --metrics-port="$METRICS_PORT" --allow-cpu-metrics=true \
  --exit-timeout-secs="$((DRAIN + GRACE))" &
TRITON=$!
FRONTEND=""
if [ "$OPENAI_PORT" != 0 ]; then
  tritonlm openai --triton-url "$CONNECT:$GRPC_PORT" --repo "$REPO" --host "$HOST" --port "$OPENAI_PORT" &
  FRONTEND=$!
fi

STOPPING=0
drain() {
  STOPPING=1
  echo "SIGTERM: draining (readiness off, new requests refused, in-flight requests get up to ${DRAIN} s)"
  # written beside, then renamed: the backend never reads half a number
  echo "$(( $(date +%s) + DRAIN ))" >"$TRITONLM_DRAIN_FILE.tmp" && mv "$TRITONLM_DRAIN_FILE.tmp" "$TRITONLM_DRAIN_FILE"
  kill -TERM "$TRITON" 2>/dev/null || true
  # Triton aborts on its own exit timeout and can hang there: kill it shortly after the deadline
  (
    trap 'kill "$SLEEP" 2>/dev/null; exit 0' TERM  # cancelled: tritonserver exited in time
    sleep $((DRAIN + GRACE + 3)) & SLEEP=$!
    wait "$SLEEP"
    kill -KILL "$TRITON" 2>/dev/null || true
  ) &
  TIMER=$!
}
TIMER=""
trap drain TERM INT

# wait returns early when a trapped signal arrives; loop until tritonserver itself has exited
CODE=0
while kill -0 "$TRITON" 2>/dev/null; do
  if wait "$TRITON"; then CODE=0; else CODE=$?; fi
done
if [ -n "$TIMER" ]; then kill "$TIMER" 2>/dev/null || true; fi
if [ -n "$FRONTEND" ]; then kill -TERM "$FRONTEND" 2>/dev/null || true; wait "$FRONTEND" 2>/dev/null || true; fi
rm -rf "$(dirname "$TRITONLM_DRAIN_FILE")"
if [ "$STOPPING" = 1 ]; then
  echo "tritonserver stopped (code $CODE)"
  exit 0
fi
echo "tritonserver exited unexpectedly (code $CODE)" >&2
exit 1
