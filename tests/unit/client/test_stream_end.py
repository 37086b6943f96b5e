"""read_to_end: a stream the server closes is read to its end and never cancelled; one that
stays open, or breaks, is cancelled."""

from __future__ import annotations

import asyncio

from tritonlm.client.stream_end import read_to_end


class FakeStream:
    """A stand-in for tritonclient.grpc.aio's stream iterator: `left` responses, then the
    end (or, with hang, none ever; with broken, an error)."""

    def __init__(self, left: int, hang: bool = False, broken: bool = False):
        self.left, self.hang, self.broken = left, hang, broken
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.left:
            self.left -= 1
            return object(), None
        if self.broken:
            raise ConnectionError("the channel broke")
        if self.hang:
            await asyncio.Event().wait()  # never set: only a cancellation ends it
        raise StopAsyncIteration

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_stream_the_server_closes_is_read_to_its_end_and_not_cancelled():
    stream = FakeStream(left=2)
    assert asyncio.run(read_to_end(stream)) is True
    assert stream.left == 0 and not stream.cancelled


def test_a_stream_left_open_or_broken_is_cancelled():
    open_stream = FakeStream(left=1, hang=True)
    assert asyncio.run(read_to_end(open_stream, wait_s=0.01)) is False
    assert open_stream.cancelled
    broken = FakeStream(left=0, broken=True)
    assert asyncio.run(read_to_end(broken)) is False
    assert broken.cancelled
