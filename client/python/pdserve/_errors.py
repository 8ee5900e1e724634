"""Typed errors: one PdserveError subclass per gRPC status code the server
answers (proto/pdserve/v1/generation.proto lists what each one means)."""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc


class PdserveError(Exception):
    """A call failed. `code` is the gRPC status code, `details` the server's
    message, `attempts` how many attempts the call made (retries included),
    `request_id` the call's request id when it had one."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        attempts: int = 1,
        request_id: Optional[str] = None,
    ) -> None:
        self.code = code
        self.details = details
        self.attempts = attempts
        self.request_id = request_id
        suffix = "" if attempts == 1 else " (after %d attempts)" % attempts
        super().__init__("%s: %s%s" % (code.name, details, suffix))


class InvalidArgumentError(PdserveError):
    """A bad request: empty prompt, too long, bad sampling value, unknown model."""


class ResourceExhaustedError(PdserveError):
    """The server is at its limit of requests (admission queue full)."""


class UnavailableError(PdserveError):
    """The server or a worker cannot be reached or failed mid-stream."""


class DeadlineExceededError(PdserveError):
    """The call's deadline passed."""


class CancelledError(PdserveError):
    """The call was cancelled (by this client, e.g. Stream.cancel())."""


class UnauthenticatedError(PdserveError):
    """The server wants an API key (`authorization: Bearer <key>`) and got
    none or a wrong one."""


class PermissionDeniedError(PdserveError):
    pass


class NotFoundError(PdserveError):
    pass


class FailedPreconditionError(PdserveError):
    pass


class InternalError(PdserveError):
    pass


class UnimplementedError(PdserveError):
    pass


_BY_CODE: Dict[grpc.StatusCode, Type[PdserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def error_for(
    code: grpc.StatusCode,
    details: str,
    attempts: int = 1,
    request_id: Optional[str] = None,
) -> PdserveError:
    """The PdserveError subclass of `code` (PdserveError itself for others)."""
    return _BY_CODE.get(code, PdserveError)(code, details, attempts, request_id)
