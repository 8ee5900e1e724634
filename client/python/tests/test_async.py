"""AsyncClient against a real local cluster: the same contract over
grpc.aio, task cancellation reaching the decode worker."""

from __future__ import annotations

import asyncio
import time

import pytest

import pdserve
from test_client import LONG, free_blocks, wait_blocks_free, wait_blocks_held


def run(coroutine):
    return asyncio.run(coroutine)


def test_generate_and_stream_agree(cluster):
    async def main():
        async with pdserve.AsyncClient(cluster.address) as client:
            whole = await client.generate("abc", max_tokens=20, ignore_eos=True, temperature=0)
            chunks = [c async for c in client.stream("abc", max_tokens=20, ignore_eos=True,
                                                     temperature=0)]
            assert [t for c in chunks for t in c.token_ids] == whole.token_ids
            assert "".join(c.text for c in chunks) == whole.text
            assert chunks[-1].finish_reason == "length"
            assert await client.tokenize("ab", add_special_tokens=False) == [97, 98]
            assert (await client.list_models())[0].name == "builtin:tiny"
            assert (await client.health()).serving
    run(main())


def test_deadline_exceeded(cluster, worker_stubs):
    async def main():
        async with pdserve.AsyncClient(cluster.address, timeout=0.3) as client:
            start = time.monotonic()
            with pytest.raises(pdserve.DeadlineExceededError):
                await client.generate("x", **LONG)
            assert time.monotonic() - start < 3
    run(main())
    assert wait_blocks_free(cluster, worker_stubs)


def test_task_cancellation_cancels_the_call(cluster, worker_stubs):
    total = free_blocks(cluster, worker_stubs)[1]

    async def main():
        async with pdserve.AsyncClient(cluster.address) as client:
            first = asyncio.Event()
            received = []

            async def consume():
                async for chunk in client.stream("x", **LONG):
                    received.append(chunk)
                    first.set()

            task = asyncio.ensure_future(consume())
            await asyncio.wait_for(first.wait(), 10)
            assert wait_blocks_held(cluster, worker_stubs, total)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert 1 <= len(received) < 4000
    run(main())
    assert wait_blocks_free(cluster, worker_stubs, seconds=3)


def test_stream_cancel_and_aclose(cluster, worker_stubs):
    async def main():
        async with pdserve.AsyncClient(cluster.address) as client:
            stream = client.stream("x", **LONG)
            with pytest.raises(pdserve.CancelledError):
                async for _ in stream:
                    stream.cancel()
            assert wait_blocks_free(cluster, worker_stubs, seconds=3)
            async with client.stream("x", **LONG) as stream:
                async for _ in stream:
                    break
    run(main())
    assert wait_blocks_free(cluster, worker_stubs, seconds=3)
