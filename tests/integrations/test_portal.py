"""kvpipe.integrations._portal's LoopThread: what a synchronous caller gets back from a call
hopped onto the loop thread."""

from __future__ import annotations

import logging

import anyio
import pytest

import kvpipe
from kvpipe.integrations._portal import LoopThread
from kvpipe.integrations.fastdeploy import KVPipeStorage


def test_a_timeout_raised_by_the_call_itself_comes_back_as_raised() -> None:
    """``call`` took any ``TimeoutError`` out of the future for its own wait running out:
    a coroutine that raised ``kvpipe.OperationTimeout`` at once (a lookup past its own
    deadline) came back as a plain ``TimeoutError`` saying "no result within <wait> s", so
    the adapters' WARNING blamed the loop thread, with the wrong type and number."""
    loop = LoopThread("test-own-timeout")
    try:

        async def lookup() -> int:
            raise kvpipe.OperationTimeout("lookup: no answer within 0.100 s")

        with pytest.raises(kvpipe.OperationTimeout, match=r"no answer within 0\.100 s"):
            loop.call(lookup, wait=30.0)
    finally:
        loop.close()


class NeverAnswers(kvpipe.MemoryStore):
    async def exists(self, batch: kvpipe.KeyBatch) -> list[bool]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def test_storage_deadline_still_named_in_its_warning(caplog: pytest.LogCaptureFixture) -> None:
    """KVPipeStorage's own deadline (here 0 s: it passes at the first wait, no sleeping)
    is reported as such, with its seconds."""
    with KVPipeStorage(store=NeverAnswers(), timeout=0.0) as fs, caplog.at_level(logging.WARNING):
        assert fs.exists(["k"]) == {"k": False}
    (record,) = [r for r in caplog.records if "KVPipeStorage exists" in r.getMessage()]
    assert "TimeoutError" in record.getMessage()
    assert "within 0.000 s" in record.getMessage()
