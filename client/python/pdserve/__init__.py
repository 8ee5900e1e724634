"""pdserve: the Python client of pdserve's gRPC Generation API (pd-router).

    import pdserve
    with pdserve.Client("127.0.0.1:50051") as client:
        print(client.generate("Once upon a time", max_tokens=32).text)

Client (blocking) and AsyncClient (asyncio) share one call contract with
the C++ SDK: a deadline per call over all its attempts; retries with
exponential backoff and jitter on UNAVAILABLE or RESOURCE_EXHAUSTED only,
and for a stream only before its first chunk; cancellation that reaches the
server; `authorization: Bearer <api_key>`; errors as PdserveError
subclasses carrying the gRPC code. See docs/python_sdk.md.

The messages are re-exported as pdserve.pb (pdserve.v1.generation_pb2).
"""

from pdserve._aio import AsyncClient, AsyncStream
from pdserve._client import Client, Stream
from pdserve._common import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_TIMEOUT,
    Choice,
    Chunk,
    Completion,
    RetryPolicy,
)
from pdserve._errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from pdserve.v1 import generation_pb2 as pb

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "CancelledError",
    "Choice",
    "Chunk",
    "Client",
    "Completion",
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "PdserveError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "Stream",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "pb",
]
