"""Client (blocking) against a real local cluster: generate, stream,
tokenize, list_models, health, request fields, deadlines, and cancellation
that frees the decode worker's KV blocks."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

import pdserve
from conftest import wait_serving

LONG = dict(max_tokens=4000, ignore_eos=True)


def free_blocks(cluster, worker_stubs):
    pb, pb_grpc = worker_stubs
    with grpc.insecure_channel(cluster.address_of("decode-0")) as channel:
        report = pb_grpc.DecodeWorkerStub(channel).GetLoad(pb.LoadRequest(), timeout=5)
    return report.free_blocks, report.total_blocks


def wait_blocks_held(cluster, worker_stubs, total, seconds=5.0):
    """True once the decode worker reports fewer free blocks than `total`
    (its load report trails the engine loop by up to a step)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if free_blocks(cluster, worker_stubs)[0] < total:
            return True
        time.sleep(0.02)
    return False


def wait_blocks_free(cluster, worker_stubs, seconds=10.0):
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        free, total = free_blocks(cluster, worker_stubs)
        if free == total:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def client(cluster):
    with pdserve.Client(cluster.address) as c:
        wait_serving(c)
        yield c


def test_generate_returns_the_completion(client):
    a = client.generate("Once upon a time", max_tokens=8, ignore_eos=True, temperature=0)
    assert a.finish_reason == "length"
    assert len(a.token_ids) == 8
    assert a.usage.completion_tokens == 8
    assert a.usage.prompt_tokens == len(client.tokenize("Once upon a time"))
    assert len(a.request_id) == 32  # Made by the SDK, one per call.
    assert all(r.request_id == a.request_id for r in a.responses)
    # Greedy: the same again; a token-id prompt equal to the text's tokens
    # gives the same completion.
    b = client.generate("Once upon a time", max_tokens=8, ignore_eos=True, temperature=0)
    assert b.token_ids == a.token_ids and b.text == a.text
    assert b.request_id != a.request_id
    ids = client.tokenize("Once upon a time")
    c = client.generate(ids, max_tokens=8, ignore_eos=True, temperature=0)
    assert c.token_ids == a.token_ids


def test_stream_chunks_add_up_to_generate(client):
    whole = client.generate("abc", max_tokens=30, ignore_eos=True, seed=7)
    chunks = list(client.stream("abc", max_tokens=30, ignore_eos=True, seed=7,
                                request_id="my-id-1"))
    assert len(chunks) >= 2
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert all(c.request_id == "my-id-1" for c in chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 30


def test_request_fields_reach_the_server(client):
    # stop_token_ids and logprobs, by their proto names.
    first = client.generate("x", max_tokens=5, ignore_eos=True, temperature=0).token_ids[0]
    stopped = client.generate("x", max_tokens=5, ignore_eos=True, temperature=0,
                              stop_token_ids=[first])
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    with_logprobs = client.generate("x", max_tokens=3, logprobs=2, temperature=0)
    assert len(with_logprobs.choices[0].logprobs) == len(with_logprobs.token_ids)
    assert len(with_logprobs.choices[0].logprobs[0].top) == 2
    with pytest.raises(TypeError, match="not a field"):
        client.generate("x", no_such_field=1)


def test_unary_calls(client):
    assert client.tokenize("ab", add_special_tokens=False) == [97, 98]
    (model,) = client.list_models()
    assert model.name == "builtin:tiny" and model.context_length > 0
    health = client.health()
    assert health.serving and health.decode_workers == 1 and health.prefill_workers == 1


def test_bad_requests_raise_typed_errors_without_retry(client):
    with pytest.raises(pdserve.InvalidArgumentError) as e:
        client.generate("x", max_tokens=0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.attempts == 1
    assert isinstance(e.value, pdserve.PdserveError)


def test_deadline_exceeded(client, cluster, worker_stubs):
    start = time.monotonic()
    with pytest.raises(pdserve.DeadlineExceededError) as e:
        client.generate("x", timeout=0.3, **LONG)
    assert time.monotonic() - start < 3
    assert e.value.attempts == 1
    assert wait_blocks_free(cluster, worker_stubs)


def test_cancel_from_another_thread_frees_the_kv_blocks(client, cluster, worker_stubs):
    free_before, total = free_blocks(cluster, worker_stubs)
    assert free_before == total
    stream = client.stream("x", **LONG)
    got = []
    with pytest.raises(pdserve.CancelledError):
        for chunk in stream:
            got.append(chunk)
            if len(got) == 1:
                # The request holds KV blocks while it runs.
                assert wait_blocks_held(cluster, worker_stubs, total)
                threading.Thread(target=stream.cancel).start()
    assert 1 <= len(got) < 4000
    assert wait_blocks_free(cluster, worker_stubs)


def test_breaking_out_of_the_stream_cancels_it(client, cluster, worker_stubs):
    total = free_blocks(cluster, worker_stubs)[1]
    with client.stream("x", **LONG) as stream:
        for chunk in stream:
            assert wait_blocks_held(cluster, worker_stubs, total)
            break
    # Left the block: the call is cancelled, the worker gives its blocks back
    # long before 4000 tokens could have been made.
    assert wait_blocks_free(cluster, worker_stubs, seconds=3)
    # And without a with block: dropping the stream cancels it.
    for chunk in client.stream("x", **LONG):
        break
    assert wait_blocks_free(cluster, worker_stubs, seconds=3)


def test_a_server_that_is_not_there_is_unavailable_after_the_retries():
    with pdserve.Client("127.0.0.1:1", retry=pdserve.RetryPolicy(
            max_attempts=2, initial_backoff=0.01)) as c:
        with pytest.raises(pdserve.UnavailableError) as e:
            c.generate("x")
        assert e.value.attempts == 2
        with pytest.raises(pdserve.UnavailableError) as e:
            c.health()
        assert e.value.attempts == 2


def test_options_are_checked():
    with pytest.raises(ValueError):
        pdserve.RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        pdserve.Client("127.0.0.1:1", api_key="has space")
    with pytest.raises(ValueError):
        pdserve.Client("")
