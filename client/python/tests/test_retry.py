"""Retries against real routers: RESOURCE_EXHAUSTED before the first token
is retried (a router admitting one request, held by a long one); a failure
after the first token (the decode worker killed mid-stream) is not."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

import pdserve
from conftest import WORKER_ARGS, LocalCluster, wait_serving
from test_client import LONG

NO_RETRY = pdserve.RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def one_at_a_time():
    """A router whose decode worker has KV room for one LONG request (251
    blocks of 16 tokens: 4000 tokens and a prompt of up to 16) and that
    queues none."""
    c = LocalCluster("limited", router_args="--max_queued=0",
                     decode_args=WORKER_ARGS + " --kv_blocks=251")
    yield c.address
    c.down()


class Blocker:
    """A long request holding the decode worker's KV pool until release()."""

    def __init__(self, address):
        self.client = pdserve.Client(address, retry=NO_RETRY)
        wait_serving(self.client)
        self.stream = self.client.stream("x", **LONG)
        next(self.stream)  # Running: it holds the pool.

    def release(self):
        self.stream.close()
        self.client.close()


def test_resource_exhausted_is_retried_until_admitted(one_at_a_time):
    blocker = Blocker(one_at_a_time)
    try:
        with pdserve.Client(one_at_a_time, retry=NO_RETRY) as once:
            with pytest.raises(pdserve.ResourceExhaustedError) as e:
                once.generate("x", max_tokens=4)
            assert e.value.attempts == 1
        bounded = pdserve.RetryPolicy(max_attempts=3, initial_backoff=0.02, max_backoff=0.04)
        with pdserve.Client(one_at_a_time, retry=bounded) as client:
            with pytest.raises(pdserve.ResourceExhaustedError) as e:
                client.generate("x", max_tokens=4)
            assert e.value.attempts == 3
        timer = threading.Timer(0.5, blocker.release)
        timer.start()
        patient = pdserve.RetryPolicy(max_attempts=50, initial_backoff=0.05, max_backoff=0.2)
        with pdserve.Client(one_at_a_time, retry=patient) as client:
            start = time.monotonic()
            completion = client.generate("x", max_tokens=4, ignore_eos=True)
            assert time.monotonic() - start >= 0.4
            assert len(completion.token_ids) == 4
        timer.join()
    finally:
        blocker.release()


def test_async_resource_exhausted_is_retried(one_at_a_time):
    blocker = Blocker(one_at_a_time)

    async def main():
        patient = pdserve.RetryPolicy(max_attempts=50, initial_backoff=0.05, max_backoff=0.2)
        async with pdserve.AsyncClient(one_at_a_time, retry=patient) as client:
            asyncio.get_running_loop().call_later(0.5, blocker.release)
            start = time.monotonic()
            chunks = [c async for c in client.stream("x", max_tokens=4, ignore_eos=True)]
            assert time.monotonic() - start >= 0.4
            assert sum(len(c.token_ids) for c in chunks) == 4
        async with pdserve.AsyncClient(one_at_a_time, retry=NO_RETRY) as client:
            assert (await client.generate("x", max_tokens=2, ignore_eos=True)).token_ids

    try:
        asyncio.run(main())
    finally:
        blocker.release()


def test_a_failure_after_the_first_token_is_not_retried(own_cluster):
    with pdserve.Client(own_cluster.address,
                        retry=pdserve.RetryPolicy(max_attempts=5, initial_backoff=0.01)) as client:
        wait_serving(client)
        reference = client.generate("x", max_tokens=200, ignore_eos=True, temperature=0).token_ids
        received = []
        with pytest.raises(pdserve.UnavailableError) as e:
            for chunk in client.stream("x", max_tokens=4000, ignore_eos=True, temperature=0):
                if not received:
                    os.kill(own_cluster.pid_of("decode-0"), signal.SIGKILL)
                received.extend(chunk.token_ids)
        # One attempt: what it delivered stands, each token once, in order.
        assert e.value.attempts == 1
        assert 1 <= len(received) < 4000
        n = min(len(received), len(reference))
        assert received[:n] == reference[:n]
