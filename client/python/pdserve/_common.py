"""What the sync and the async client share: the retry policy, the result
types, request building, channel credentials and the retry decision."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from pdserve._errors import PdserveError, error_for
from pdserve.v1 import generation_pb2 as pb

#: Seconds: the default deadline of generate() and stream() (all attempts).
DEFAULT_TIMEOUT = 600.0
#: Seconds: the default deadline of tokenize(), list_models() and health().
DEFAULT_CALL_TIMEOUT = 10.0

#: The codes that say "this attempt was not taken up; another may be".
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})

Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class RetryPolicy:
    """When and how often a failed attempt is tried again.

    Only UNAVAILABLE and RESOURCE_EXHAUSTED are retried, and a stream only
    while no message has arrived. The wait before attempt k+1 (k >= 1) is
    b = min(max_backoff, initial_backoff * multiplier ** (k - 1)), drawn
    uniformly from [b * (1 - jitter), b], and never past the deadline.
    The defaults are the C++ SDK's (client/pdserve_client.h).
    """

    #: Attempts of one call, the first included; 1 disables retries.
    max_attempts: int = 3
    #: Seconds.
    initial_backoff: float = 0.1
    multiplier: float = 2.0
    #: Seconds.
    max_backoff: float = 2.0
    #: Share of each wait drawn at random, in [0, 1].
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if (
            self.max_attempts < 1
            or self.initial_backoff < 0
            or self.max_backoff < self.initial_backoff
            or not self.multiplier >= 1
            or not 0 <= self.jitter <= 1
        ):
            raise ValueError(
                "bad RetryPolicy %r: max_attempts >= 1, initial_backoff >= 0, "
                "max_backoff >= initial_backoff, multiplier >= 1, jitter in [0, 1]" % (self,)
            )

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return ceiling * (1.0 - self.jitter * random.random())


def _finish_name(value: int) -> Optional[str]:
    if value == 0:
        return None
    name = pb.FinishReason.Name(value)
    return name[len("FINISH_REASON_"):].lower() if name.startswith("FINISH_REASON_") else name


def _index(response: pb.GenerateResponse) -> int:
    # GenerateResponse.index (which of n choices) where the proto has it.
    return int(getattr(response, "index", 0))


@dataclass(frozen=True)
class Chunk:
    """One GenerateResponse of a stream."""

    request_id: str
    #: Text generated since the previous chunk of this choice (may be empty
    #: while a UTF-8 character or a possible stop string is incomplete).
    text: str
    token_ids: List[int]
    #: Which choice this chunk extends (0 unless the request asked for n > 1).
    index: int
    #: "stop" or "length" on the last chunk of a choice; None before.
    finish_reason: Optional[str]
    #: Set on the last chunk only.
    usage: Optional[pb.Usage]
    #: The message as received: every field, those added to the proto later
    #: included.
    raw: pb.GenerateResponse

    @classmethod
    def from_proto(cls, response: pb.GenerateResponse) -> "Chunk":
        return cls(
            request_id=response.request_id,
            text=response.text,
            token_ids=list(response.token_ids),
            index=_index(response),
            finish_reason=_finish_name(response.finish_reason),
            usage=response.usage if response.HasField("usage") else None,
            raw=response,
        )


@dataclass(frozen=True)
class Choice:
    """One completion of a prompt (a request asks for one unless n > 1)."""

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    #: One per token when the request asked for logprobs.
    logprobs: List[pb.TokenLogprobs]


@dataclass(frozen=True)
class Completion:
    """The whole result of generate(): the chunks of a stream put together."""

    request_id: str
    choices: List[Choice]
    usage: Optional[pb.Usage]
    #: Every message as received.
    responses: List[pb.GenerateResponse] = field(repr=False)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> List[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.choices[0].finish_reason

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> "Completion":
        texts: Dict[int, List[str]] = {}
        tokens: Dict[int, List[int]] = {}
        logprobs: Dict[int, List[pb.TokenLogprobs]] = {}
        finish: Dict[int, Optional[str]] = {}
        responses: List[pb.GenerateResponse] = []
        request_id = ""
        usage: Optional[pb.Usage] = None
        for c in chunks:
            responses.append(c.raw)
            request_id = request_id or c.request_id
            texts.setdefault(c.index, []).append(c.text)
            tokens.setdefault(c.index, []).extend(c.token_ids)
            logprobs.setdefault(c.index, []).extend(c.raw.logprobs)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
            if c.usage is not None:
                usage = c.usage
        indices = sorted(texts) or [0]
        choices = [
            Choice(
                index=i,
                text="".join(texts.get(i, [])),
                token_ids=tokens.get(i, []),
                finish_reason=finish.get(i),
                logprobs=logprobs.get(i, []),
            )
            for i in indices
        ]
        return cls(request_id=request_id, choices=choices, usage=usage, responses=responses)


def _is_repeated(f: Any) -> bool:
    is_repeated = getattr(f, "is_repeated", None)
    if isinstance(is_repeated, bool):
        return is_repeated
    return f.label == f.LABEL_REPEATED


def _assign(message: Message, name: str, value: Any) -> None:
    """Sets field `name` of `message` from a Python value, whatever its kind."""
    f = message.DESCRIPTOR.fields_by_name[name]
    target = getattr(message, name) if f.message_type is not None or _is_repeated(f) else None
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        target.clear()
        for k, v in dict(value).items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif _is_repeated(f):
        if isinstance(value, (str, bytes)) or isinstance(value, Message):
            value = [value]
        del target[:]
        for v in value:
            if isinstance(v, Mapping):
                json_format.ParseDict(dict(v), target.add())
            else:
                target.append(v)
    elif f.message_type is not None:
        message.ClearField(name)
        if isinstance(value, Mapping):
            json_format.ParseDict(dict(value), getattr(message, name))
        else:
            getattr(message, name).CopyFrom(value)
    else:
        setattr(message, name, value)


# Keyword arguments that are not fields: the prompt goes first, positionally.
_PROMPT_FIELDS = ("text", "token_ids")


def build_request(prompt: Prompt, fields: Mapping[str, Any]) -> pb.GenerateRequest:
    """A GenerateRequest of `prompt` (text, or token ids) and `fields`: each
    a field of GenerateRequest or of SamplingParams (set in `sampling`), so
    fields added to the proto work without a new SDK. None leaves a field
    unset (the server's default)."""
    request = pb.GenerateRequest()
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("the prompt is text (str) or token ids (a sequence of int), not bytes")
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    sampling_fields = pb.SamplingParams.DESCRIPTOR.fields_by_name
    request_fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        if value is None:
            continue
        if name in _PROMPT_FIELDS:
            raise TypeError("pass the prompt as the first argument, not %s=" % name)
        if name in sampling_fields:
            _assign(request.sampling, name, value)
        elif name in request_fields:
            _assign(request, name, value)
        else:
            raise TypeError(
                "%r is not a field of pdserve.v1.GenerateRequest or SamplingParams" % name
            )
    if not request.request_id:
        # One id for every attempt of the call.
        request.request_id = uuid.uuid4().hex
    return request


def metadata(api_key: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    if not api_key:
        return ()
    return (("authorization", "Bearer " + api_key),)


def check_api_key(api_key: Optional[str]) -> None:
    if api_key is not None and not all(0x20 < ord(c) < 0x7F for c in api_key):
        raise ValueError("the API key must be printable ASCII without spaces")


def credentials(
    tls: bool, root_certificates: Union[bytes, str, None]
) -> Optional[grpc.ChannelCredentials]:
    """TLS credentials, or None for a plaintext channel. Root certificates
    (PEM) imply TLS; TLS without them uses the system's roots."""
    if root_certificates is None and not tls:
        return None
    if isinstance(root_certificates, str):
        root_certificates = root_certificates.encode()
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def give_up(
    code: grpc.StatusCode,
    details: str,
    attempt: int,
    received: bool,
    policy: RetryPolicy,
    deadline: float,
    now: float,
    request_id: Optional[str],
) -> Tuple[Optional[PdserveError], float]:
    """After a failed attempt: (the error to raise, 0) or (None, seconds to
    wait before the next attempt)."""
    if received or code not in RETRYABLE:
        return error_for(code, details, attempt, request_id), 0.0
    if attempt >= policy.max_attempts:
        return error_for(code, details + " (no attempt left)", attempt, request_id), 0.0
    wait = policy.backoff(attempt)
    if now + wait >= deadline:
        return (
            error_for(code, details + " (no time left before the deadline)", attempt, request_id),
            0.0,
        )
    return None, wait


def cancelled_error(attempt: int, request_id: Optional[str]) -> PdserveError:
    return error_for(grpc.StatusCode.CANCELLED, "cancelled by the caller", attempt, request_id)
