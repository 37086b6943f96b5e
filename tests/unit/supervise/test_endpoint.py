"""The probes' HTTP endpoint: statuses follow the board; metrics in Prometheus text."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from tritonlm.server import free_ports
from tritonlm.supervise.endpoint import HealthEndpoint
from tritonlm.supervise.health import HealthBoard


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_statuses_follow_the_board():
    board = HealthBoard(["m"])
    (port,) = free_ports(1)
    endpoint = HealthEndpoint(board, "127.0.0.1", port).start()
    try:
        assert get(port, "/health/ready")[0] == 503  # loading
        assert get(port, "/health/live")[0] == 200
        board.set_models(["m"])
        assert get(port, "/health/ready")[0] == 200
        board.recovering("m", "model m: its process (pid 3) died", "died")
        status, body = get(port, "/health/ready")
        assert status == 503 and json.loads(body)["models"]["m"]["cause"] == "model m: its process (pid 3) died"
        assert get(port, "/health/live")[0] == 200
        status, body = get(port, "/metrics")
        assert status == 200 and b'tritonlm_model_restarts_total{cause="died",model="m"} 1.0' in body
        board.give_up("gave up after 5 restarts")
        assert get(port, "/health/live")[0] == 503
        assert json.loads(get(port, "/health")[1])["gave_up"] == "gave up after 5 restarts"
        status, body = get(port, "/nope")
        assert status == 404 and b"/health/ready" in body
    finally:
        endpoint.stop()
