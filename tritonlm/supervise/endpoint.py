"""The probes' HTTP endpoint of `tritonlm serve` (--health-port).

Triton's own /v2/health/live and /v2/health/ready answer for the server process and keep
answering 200 while a model's process is dead (triton-inference-server/server#8604);
these answer for the models:

  GET /health/ready   200 while every model serves; 503 while one loads, recovers or drains
  GET /health/live    200 unless recovery has given up (then 503, and serve exits)
  GET /health         the state of every model (JSON, always 200)
  GET /metrics        tritonlm_model_healthy, tritonlm_model_restarts_total, ... (Prometheus)
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tritonlm.supervise.health import HealthBoard


class HealthEndpoint:
    def __init__(self, board: HealthBoard, host: str, port: int):
        self.board, self.host, self.port = board, host, port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "HealthEndpoint":
        board = self.board

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/health/ready":
                    ok = board.ready()
                    self._send(200 if ok else 503, {"ready": ok, **board.status()})
                elif path == "/health/live":
                    ok = board.live()
                    self._send(200 if ok else 503, {"live": ok, "gave_up": board.status()["gave_up"]})
                elif path == "/health":
                    self._send(200, board.status())
                elif path == "/metrics":
                    body = generate_latest(board.registry)
                    self._raw(200, body, CONTENT_TYPE_LATEST)
                else:
                    self._send(404, {"error": f"no such path {path!r}: /health, /health/ready, /health/live, /metrics"})

            def _send(self, status: int, obj: dict) -> None:
                self._raw(status, json.dumps(obj).encode(), "application/json")

            def _raw(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds: not worth a line each
                pass

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="tritonlm-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
