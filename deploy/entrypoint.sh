#!/usr/bin/env bash
# Container entry point.
#   tritonlm-entrypoint export   only export TRITONLM_MODEL into TRITONLM_REPO (an init container)
#   tritonlm-entrypoint serve    export if the repository is empty and TRITONLM_MODEL is set, then
#                                `tritonlm serve` the image's tritonserver (with the OpenAI API and
#                                the probes' endpoint) until SIGTERM; a model process that dies or
#                                hangs restarts the server, and serve exits 3 if that keeps failing
# Environment: TRITONLM_REPO (default /models), TRITONLM_MODEL (e.g. smollm2-135m),
# TRITONLM_EXPORT_ARGS (extra `tritonlm export` options, e.g. "--device cuda"),
# TRITONLM_DRAIN_TIMEOUT (seconds in-flight requests get after SIGTERM, default 30),
# TRITONLM_OPENAI_PORT (default 9000; 0: off), TRITONLM_HOST (address every endpoint binds,
# default 0.0.0.0), TRITONLM_HTTP_PORT / _GRPC_PORT / _METRICS_PORT (default 8000 / 8001 / 8002),
# TRITONLM_HEALTH_PORT (the probes' /health/ready, /health/live and /metrics; default 8003),
# TRITONLM_MAX_RESTARTS (restarts allowed within TRITONLM_RESTART_WINDOW seconds; default 5 in 300).
set -euo pipefail
REPO=${TRITONLM_REPO:-/models}
MODEL=${TRITONLM_MODEL:-}
DRAIN=${TRITONLM_DRAIN_TIMEOUT:-30}
OPENAI_PORT=${TRITONLM_OPENAI_PORT:-9000}
HOST=${TRITONLM_HOST:-0.0.0.0}
HTTP_PORT=${TRITONLM_HTTP_PORT:-8000}
GRPC_PORT=${TRITONLM_GRPC_PORT:-8001}
METRICS_PORT=${TRITONLM_METRICS_PORT:-8002}
HEALTH_PORT=${TRITONLM_HEALTH_PORT:-8003}
MAX_RESTARTS=${TRITONLM_MAX_RESTARTS:-5}
RESTART_WINDOW=${TRITONLM_RESTART_WINDOW:-300}
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

# tritonlm serve runs the image's tritonserver (model control none: the repository loads at
# start, no load/unload API) and the OpenAI API in one process, and watches the models'
# processes. SIGTERM drains: readiness off, new requests refused, in-flight requests get
# TRITONLM_DRAIN_TIMEOUT seconds, then what still runs ends with finish_reason "cancelled"
# and it exits 0. exec: the signals reach it, not this shell.
exec tritonlm serve --repo "$REPO" --tritonserver "$(command -v tritonserver)" --model-control none \
  --host "$HOST" --http-port "$HTTP_PORT" --grpc-port "$GRPC_PORT" --metrics-port "$METRICS_PORT" \
  --openai-port "$OPENAI_PORT" --health-port "$HEALTH_PORT" --drain-timeout "$DRAIN" \
  --max-restarts "$MAX_RESTARTS" --restart-window "$RESTART_WINDOW"
