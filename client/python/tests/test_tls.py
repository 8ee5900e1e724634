"""TLS options against a TLS server of the public API answering Health:
pd-router serves plaintext (TLS ends in front of it), so the SDK's TLS is
tested against this one, with tests/fixtures/tls's self-signed certificate."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

import pdserve
from conftest import REPO
from pdserve.v1 import generation_pb2_grpc as pb_grpc

TLS = REPO / "tests" / "fixtures" / "tls"


class HealthOnly(pb_grpc.GenerationServicer):
    def Health(self, request, context):
        return pdserve.pb.HealthResponse(serving=True, decode_workers=1)


@pytest.fixture(scope="module")
def tls_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(HealthOnly(), server)
    credentials = grpc.ssl_server_credentials(
        [((TLS / "server.key").read_bytes(), (TLS / "server.pem").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    yield "127.0.0.1:%d" % port
    server.stop(0)


ONCE = pdserve.RetryPolicy(max_attempts=1)


def test_root_certificates_make_a_tls_channel(tls_server):
    pem = (TLS / "server.pem").read_text()
    with pdserve.Client(tls_server, root_certificates=pem, retry=ONCE) as client:
        assert client.health().serving

    async def main():
        async with pdserve.AsyncClient(tls_server, root_certificates=pem.encode(),
                                       retry=ONCE) as client:
            assert (await client.health()).decode_workers == 1
    asyncio.run(main())


def test_plaintext_or_untrusted_roots_do_not_connect(tls_server):
    for options in (dict(), dict(tls=True)):  # tls=True alone: the system's roots.
        with pdserve.Client(tls_server, retry=ONCE, call_timeout=2, **options) as client:
            with pytest.raises(pdserve.UnavailableError):
                client.health()
