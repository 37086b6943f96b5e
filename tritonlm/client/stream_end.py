"""The end of a tritonclient gRPC stream (grpc.aio) after its request's last response.

tritonserver 2.51 can miss a stream's cancellation that comes just after the request's
final response; the model then stays UNLOADING for good (docs/serving.md#unloading-a-model).
A client that cancels after the final response, or drops the call (grpc.aio cancels a call
that is not done when it is freed), can hit that moment. So the stream is read until the
server closes it, and cancelled only if it stays open long past that moment."""

from __future__ import annotations

import asyncio

STREAM_END_WAIT_S = 30.0  # how long a stream may stay open after its last response


async def read_to_end(responses, wait_s: float = STREAM_END_WAIT_S) -> bool:
    """Read what is left of `responses` (tritonclient.grpc.aio's stream_infer iterator) until
    the server closes the stream: True. Where it stays open past wait_s, or breaks, it is
    cancelled: False."""
    try:
        await asyncio.wait_for(_drain(responses), wait_s)
        return True
    except Exception:
        responses.cancel()
        return False


async def _drain(responses) -> None:
    async for _ in responses:
        pass
