"""Client: the blocking client (grpc's sync API)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, List, Optional, TypeVar, Union

import grpc

from pdserve import _common
from pdserve._common import Chunk, Completion, Prompt, RetryPolicy
from pdserve._errors import PdserveError
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

T = TypeVar("T")


class _CallState:
    """What cancel() and the call's generator share."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.call: Optional[grpc.Call] = None

    def cancel(self) -> None:
        self.cancelled.set()
        call = self.call
        if call is not None:
            call.cancel()


class Stream(Iterator[Chunk]):
    """The chunks of one Generate call, as they arrive.

    Iterating runs the call (retrying before the first chunk, see
    RetryPolicy); a failure raises a PdserveError subclass. Stopping early
    cancels the call at the server: close() it, leave a `with` block, or
    cancel() it from any thread (the iteration then raises CancelledError).
    Dropping the last reference to an unfinished stream cancels it too.
    """

    def __init__(self, client: "Client", request: pb.GenerateRequest, timeout: float) -> None:
        self.request_id: str = request.request_id
        # The generator holds the state, not the Stream: no reference cycle,
        # so dropping the last reference cancels at once.
        self._state = _CallState()
        self._chunks = _run(self._state, client, request, timeout)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def cancel(self) -> None:
        """Cancels the call from any thread; idempotent."""
        self._state.cancel()

    def close(self) -> None:
        """Cancels the call and ends the iteration (from the iterating thread)."""
        self.cancel()
        self._chunks.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_state"):
            self._state.cancel()


def _run(state: _CallState, client: "Client", request: pb.GenerateRequest, timeout: float) -> Iterator[Chunk]:
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        if state.cancelled.is_set():
            raise _common.cancelled_error(attempt, request.request_id)
        call = client._stub.Generate(
            request,
            timeout=max(0.0, deadline - time.monotonic()),
            metadata=client._metadata,
        )
        state.call = call
        if state.cancelled.is_set():  # cancel() ran before _call was set.
            call.cancel()
        received = False
        try:
            for response in call:
                received = True
                yield Chunk.from_proto(response)
            return
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        finally:
            # A no-op once the call is over; cancels it when the
            # iteration stops early (close(), break, garbage).
            call.cancel()
            state.call = None
        if state.cancelled.is_set():
            raise _common.cancelled_error(attempt, request.request_id)
        error, wait = _common.give_up(
            code, details, attempt, received, client._retry, deadline,
            time.monotonic(), request.request_id)
        if error is not None:
            raise error
        if state.cancelled.wait(wait):
            raise _common.cancelled_error(attempt, request.request_id)


class Client:
    """A blocking client of a pd-router (pdserve.v1.Generation).

        with pdserve.Client("127.0.0.1:50051", api_key="k") as client:
            print(client.generate("Once upon a time", max_tokens=32).text)
            for chunk in client.stream("Once", max_tokens=32, temperature=0.7):
                print(chunk.text, end="", flush=True)

    Every call has a deadline (`timeout` seconds for generate/stream,
    `call_timeout` for the rest; a call's own timeout= overrides) covering
    all its attempts. Failed attempts are retried per `retry` (UNAVAILABLE
    and RESOURCE_EXHAUSTED only, a stream only before its first chunk).
    `api_key` is sent as `authorization: Bearer <key>`. `tls=True` or
    `root_certificates` (PEM) make the channel TLS (system roots when none
    are given); otherwise it is plaintext. Thread-safe: one channel serves
    every call.
    """

    def __init__(
        self,
        target: str,
        *,
        api_key: Optional[str] = None,
        tls: bool = False,
        root_certificates: Union[bytes, str, None] = None,
        timeout: float = _common.DEFAULT_TIMEOUT,
        call_timeout: float = _common.DEFAULT_CALL_TIMEOUT,
        retry: Optional[RetryPolicy] = None,
    ) -> None:
        if not target:
            raise ValueError("the server address is empty")
        if timeout <= 0 or call_timeout <= 0:
            raise ValueError("timeout and call_timeout must be positive")
        _common.check_api_key(api_key)
        credentials = _common.credentials(tls, root_certificates)
        self._channel = (
            grpc.secure_channel(target, credentials)
            if credentials is not None
            else grpc.insecure_channel(target)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = _common.metadata(api_key)
        self._timeout = timeout
        self._call_timeout = call_timeout
        self._retry = retry if retry is not None else RetryPolicy()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def stream(self, prompt: Prompt, *, timeout: Optional[float] = None, **fields: Any) -> Stream:
        """Streams the completion of `prompt` (text, or token ids). `fields`
        are GenerateRequest or SamplingParams fields: max_tokens=, stop=,
        temperature=, seed=, request_id=, ..."""
        request = _common.build_request(prompt, fields)
        return Stream(self, request, timeout if timeout is not None else self._timeout)

    def generate(self, prompt: Prompt, *, timeout: Optional[float] = None, **fields: Any) -> Completion:
        """The whole completion of `prompt`; see stream()."""
        with self.stream(prompt, timeout=timeout, **fields) as chunks:
            return Completion.from_chunks(chunks)

    def tokenize(
        self,
        text: str,
        *,
        add_special_tokens: Optional[bool] = None,
        model: str = "",
        timeout: Optional[float] = None,
    ) -> List[int]:
        request = pb.TokenizeRequest(text=text, model=model)
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        response = self._unary(self._stub.Tokenize, request, timeout)
        return list(response.token_ids)

    def list_models(self, *, timeout: Optional[float] = None) -> List[pb.ModelInfo]:
        return list(self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout).models)

    def health(self, *, timeout: Optional[float] = None) -> pb.HealthResponse:
        return self._unary(self._stub.Health, pb.HealthRequest(), timeout)

    def _unary(self, method: Callable[..., T], request: Any, timeout: Optional[float]) -> T:
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(
                    request,
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self._metadata,
                )
            except grpc.RpcError as e:
                error, wait = _common.give_up(
                    e.code(), e.details() or "", attempt, False, self._retry, deadline,
                    time.monotonic(), None)
                if error is not None:
                    raise error from None
                time.sleep(wait)



