"""AsyncClient: the asyncio client (grpc.aio), with Client's contract."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable, List, Optional, TypeVar, Union

import grpc
import grpc.aio

from pdserve import _common
from pdserve._common import Chunk, Completion, Prompt, RetryPolicy
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

T = TypeVar("T")


class _CallState:
    """What cancel() and the call's generator share."""

    def __init__(self) -> None:
        self.cancelled = False
        self.wake: Optional[asyncio.Event] = None
        self.call: Optional[grpc.aio.Call] = None

    def cancel(self) -> None:
        self.cancelled = True
        if self.call is not None:
            self.call.cancel()
        if self.wake is not None:
            self.wake.set()


class AsyncStream(AsyncIterator[Chunk]):
    """The chunks of one Generate call: `async for chunk in stream`.

    Retries before the first chunk as Client does; a failure raises a
    PdserveError subclass. Stopping early cancels the call at the server:
    cancel() it (from the event loop's thread; the iteration then raises
    pdserve.CancelledError), `await stream.aclose()`, leave an `async with`
    block, or cancel the task iterating it (asyncio.CancelledError goes on
    as usual). Dropping the last reference to an unfinished stream cancels
    it too.
    """

    def __init__(self, client: "AsyncClient", request: pb.GenerateRequest, timeout: float) -> None:
        self.request_id: str = request.request_id
        # The generator holds the state, not the stream: no reference cycle,
        # so dropping the last reference cancels at once.
        self._state = _CallState()
        self._chunks = _run(self._state, client, request, timeout)

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        """Cancels the call; idempotent. From the event loop's thread (from
        another: loop.call_soon_threadsafe(stream.cancel))."""
        self._state.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await self._chunks.aclose()

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        state = getattr(self, "_state", None)
        if state is not None and state.call is not None:
            state.call.cancel()


async def _run(
    state: _CallState, client: "AsyncClient", request: pb.GenerateRequest, timeout: float
) -> AsyncIterator[Chunk]:
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        if state.cancelled:
            raise _common.cancelled_error(attempt, request.request_id)
        call = client._stub.Generate(
            request,
            timeout=max(0.0, deadline - time.monotonic()),
            metadata=client._metadata,
        )
        state.call = call
        received = False
        try:
            async for response in call:
                received = True
                yield Chunk.from_proto(response)
            return
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or ""
        except asyncio.CancelledError:
            # grpc.aio reports a cancelled call this way: ours (cancel())
            # is a PdserveError; a cancelled task stays cancelled.
            if not state.cancelled:
                raise
            code, details = grpc.StatusCode.CANCELLED, ""
        finally:
            # A no-op once the call is over; cancels it when the
            # iteration stops early (aclose(), task cancelled).
            call.cancel()
            state.call = None
        if state.cancelled:
            raise _common.cancelled_error(attempt, request.request_id)
        error, wait = _common.give_up(
            code, details, attempt, received, client._retry, deadline,
            time.monotonic(), request.request_id)
        if error is not None:
            raise error
        state.wake = asyncio.Event()
        try:
            await asyncio.wait_for(state.wake.wait(), wait)
        except asyncio.TimeoutError:
            pass
        state.wake = None
        if state.cancelled:
            raise _common.cancelled_error(attempt, request.request_id)


class AsyncClient:
    """Client over grpc.aio: the same arguments, methods and contract, as
    coroutines, and stream() as an AsyncStream. Create it inside the event
    loop that uses it.

        async with pdserve.AsyncClient("127.0.0.1:50051") as client:
            completion = await client.generate("Once upon a time", max_tokens=32)
            async for chunk in client.stream("Once", max_tokens=32):
                print(chunk.text, end="")
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
            grpc.aio.secure_channel(target, credentials)
            if credentials is not None
            else grpc.aio.insecure_channel(target)
        )
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = _common.metadata(api_key)
        self._timeout = timeout
        self._call_timeout = call_timeout
        self._retry = retry if retry is not None else RetryPolicy()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def stream(self, prompt: Prompt, *, timeout: Optional[float] = None, **fields: Any) -> AsyncStream:
        request = _common.build_request(prompt, fields)
        return AsyncStream(self, request, timeout if timeout is not None else self._timeout)

    async def generate(
        self, prompt: Prompt, *, timeout: Optional[float] = None, **fields: Any
    ) -> Completion:
        async with self.stream(prompt, timeout=timeout, **fields) as stream:
            return Completion.from_chunks([chunk async for chunk in stream])

    async def tokenize(
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
        response = await self._unary(self._stub.Tokenize, request, timeout)
        return list(response.token_ids)

    async def list_models(self, *, timeout: Optional[float] = None) -> List[pb.ModelInfo]:
        response = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return list(response.models)

    async def health(self, *, timeout: Optional[float] = None) -> pb.HealthResponse:
        return await self._unary(self._stub.Health, pb.HealthRequest(), timeout)

    async def _unary(
        self, method: Callable[..., Awaitable[T]], request: Any, timeout: Optional[float]
    ) -> T:
        deadline = time.monotonic() + (timeout if timeout is not None else self._call_timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await method(
                    request,
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as e:
                error, wait = _common.give_up(
                    e.code(), e.details() or "", attempt, False, self._retry, deadline,
                    time.monotonic(), None)
                if error is not None:
                    raise error from None
                await asyncio.sleep(wait)
