"""pd-router with API keys (--api_key_file, --api_key) and the SDKs'
api_key: every call but Health needs `authorization: Bearer <key>`."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

import pdserve
from conftest import BUILD, wait_serving


@pytest.fixture(scope="module")
def keyed_router(cluster):
    key_file = cluster.dir / "api-keys"
    key_file.write_text("# keys of the test\n\nfirst-key\n  second-key  \n")
    return cluster.start_router("keyed-router", "--api_key_file=%s" % key_file)


def test_no_key_or_a_wrong_key_is_unauthenticated(keyed_router):
    for api_key in (None, "wrong-key"):
        with pdserve.Client(keyed_router, api_key=api_key,
                            retry=pdserve.RetryPolicy(max_attempts=5)) as client:
            wait_serving(client)  # Health needs no key.
            with pytest.raises(pdserve.UnauthenticatedError) as e:
                client.generate("x", max_tokens=4)
            assert "authorization: Bearer <key>" in e.value.details
            assert e.value.attempts == 1  # Never retried.
            with pytest.raises(pdserve.UnauthenticatedError):
                client.tokenize("x")
            with pytest.raises(pdserve.UnauthenticatedError):
                client.list_models()


def test_a_key_of_the_file_opens_every_call(keyed_router):
    for api_key in ("first-key", "second-key"):
        with pdserve.Client(keyed_router, api_key=api_key) as client:
            wait_serving(client)
            assert len(client.generate("x", max_tokens=4, ignore_eos=True).token_ids) == 4
            assert client.tokenize("ab", add_special_tokens=False) == [97, 98]
            assert client.list_models()[0].name == "builtin:tiny"


def test_async_client_sends_the_key(keyed_router):
    async def main():
        async with pdserve.AsyncClient(keyed_router, api_key="second-key") as client:
            chunks = [c async for c in client.stream("x", max_tokens=4, ignore_eos=True)]
            assert sum(len(c.token_ids) for c in chunks) == 4
        async with pdserve.AsyncClient(keyed_router) as client:
            with pytest.raises(pdserve.UnauthenticatedError):
                await client.generate("x", max_tokens=4)
    asyncio.run(main())


def test_keys_on_the_command_line(cluster):
    address = cluster.start_router("flag-keyed-router", "--api_key=k-one,k-two")
    with pdserve.Client(address, api_key="k-two") as client:
        wait_serving(client)
        assert client.generate("x", max_tokens=2, ignore_eos=True).token_ids
    with pdserve.Client(address, api_key="k-one,k-two") as client:
        with pytest.raises(pdserve.UnauthenticatedError):
            client.generate("x", max_tokens=2)


def test_pdctl_sends_its_key(keyed_router):
    with pdserve.Client(keyed_router) as client:
        wait_serving(client)

    def pdctl(*args, env=None):
        return subprocess.run([str(BUILD / "client/pdctl"), "status", "--server=" + keyed_router,
                               *args], capture_output=True, text=True, env=env)

    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
    keyless = pdctl(env=env)
    assert keyless.returncode == 1 and "UNAUTHENTICATED" in keyless.stderr
    # Health needs no key: its lines come first, so a keyless probe still
    # sees the cluster (deploy/local/cluster.sh waits on them).
    assert "serving: true" in keyless.stdout and "model:" not in keyless.stdout
    keyed = pdctl("--api_key=second-key", env=env)
    assert keyed.returncode == 0 and "model: builtin:tiny" in keyed.stdout
    from_env = pdctl(env=dict(env, PDSERVE_API_KEY="first-key"))
    assert from_env.returncode == 0 and "model: builtin:tiny" in from_env.stdout
