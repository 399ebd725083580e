"""The messages between the three managers: one tagged union per channel.

    TokenizerManager ──SchedulerInbox──► Scheduler ──DetokenizerInbox──► DetokenizerManager
    DetokenizerManager ──TokenizerInbox──► TokenizerManager
    DetokenizerManager ──StopStringHit──► Scheduler (a stop string ended a request)

With several tokenizer/HTTP workers (``server.workers``), the main process
runs only the supervisor and a ``Coordinator``; it tells every worker how
the scheduler is (``RuntimeStatus``: up or down, resume, failure), and a
worker tells it when its outputs stalled (``WorkerStalled``).

Outputs are deltas: each step sends the new token ids of every request that
advanced, never the whole sequence. Per-request settings the detokenizer
needs travel once, in a DecodeInit inside the first output of a request.
Control requests (flush cache, server info, health) use the runtime's
``call`` and return plain values.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np

from transports import Array, CodecError, Decoder, Encoder

__all__ = [
    "AbortReq",
    "AbortWhere",
    "BatchStrOut",
    "BatchTokenIDOut",
    "ControlInbox",
    "DecodeInit",
    "DetokenizerInbox",
    "DetokenizerInfo",
    "DetokenizerInfoReq",
    "FinishReason",
    "FlushCacheReq",
    "ForgetRequests",
    "GenerateReq",
    "GenerateReqId",
    "HealthProbe",
    "SamplingParams",
    "SetPaused",
    "SchedulerInbox",
    "RuntimeStatus",
    "ServerInfo",
    "ServerInfoReq",
    "StopStringHit",
    "TokenizerInbox",
    "UpdateWeightsAll",
    "UpdateWeightsReq",
    "Weights",
    "WeightsResult",
    "WireCheck",
    "WorkerStalled",
    "wire_field",
]


# Bounded types for what clients send: msgspec checks them while decoding, so an
# out-of-range value is a 400 naming its field before anything runs.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # tokens; the context window bounds it later
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # the vocabulary bounds it later
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]  # OpenAI's bound
NumSamples = Annotated[int, msgspec.Meta(ge=1, le=128)]  # OpenAI's bound on n
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=2**31 - 1)]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=0.01, le=100.0)]  # near 0 its division overflows
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # frequency and presence, as OpenAI
StopString = Annotated[str, msgspec.Meta(min_length=1)]  # count and length: bounded by the server's limits
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]  # OpenAI's logit_bias range
LogitBias = Annotated[dict[str, Bias], msgspec.Meta(max_length=1024)]  # token id (as text) -> bias
Constraint = Annotated[str, msgspec.Meta(min_length=1, max_length=1 << 20)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class SamplingParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Per-request sampling, with SGLang's names (``seed`` as vLLM/OpenAI).

    Also the schema of ``sampling_params`` in ``POST /generate``: an unknown,
    mistyped or out-of-range field is an error that names it.
    """

    max_new_tokens: Count | None = 128  # None: up to the context window
    min_new_tokens: Count = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    seed: Int64 | None = None
    stop: list[StopString] = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: NumSamples = 1
    logit_bias: LogitBias | None = None
    # constrained decoding, at most one (serving/managers/grammar.py): SGLang's names, and a lark grammar
    json_schema: Constraint | None = None  # a JSON schema, as JSON text
    regex: Constraint | None = None
    ebnf: Constraint | None = None
    grammar: Constraint | None = None

    def check(self) -> str | None:
        """The first problem with these values, named by field, or None (the same
        bounds as the types, for parameters built in Python rather than decoded)."""
        try:
            msgspec.convert(msgspec.to_builtins(self), SamplingParams)
        except msgspec.ValidationError as exc:
            return _readable(str(exc))
        if self.top_k == 0:
            return "top_k: must be -1 (off) or >= 1"
        if self.logit_bias and not all(key.isdigit() for key in self.logit_bias):
            return "logit_bias: keys are token ids"
        return None


def _readable(message: str) -> str:
    """msgspec's ``Expected ... - at `$.top_p``` as ``top_p: expected ...``."""
    text, _, where = message.partition(" - at `$.")
    if not where:
        return message
    return f"{where.rstrip('`')}: {text[:1].lower()}{text[1:]}"


class FinishReason(msgspec.Struct, omit_defaults=True):
    """Why a request ended: ``stop`` (eos, stop token or string: ``matched``),
    ``length`` (max_new_tokens) or ``abort`` (``message`` says why)."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    status_code: int | None = None  # for an abort that is an error: 400 bad input, 503 overload

    def to_json(self) -> dict:
        return msgspec.to_builtins(self)


# -- TokenizerManager → Scheduler -------------------------------------------------


class GenerateReq(msgspec.Struct, tag=True, array_like=True, gc=False):
    rid: str
    # on a resume: prompt + the ids generated so far; another dtype or shape is dropped on receipt
    input_ids: Annotated[np.ndarray, Array(np.int32, ndim=1, max_size=2**24)]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    worker: int = 0  # the tokenizer worker that owns the request
    num_prior_output: int = 0  # resume: the last ids of input_ids that were generated
    replaces: str | None = None  # resume: the rid of the incarnation this one continues
    # on probation (a suspect of crashing the scheduler): run in a model call of its own, so that a
    # call that kills the process names it alone in the scheduler's step journal
    alone: bool = False
    # a resume (a restart's or a migration's, with or without output so far): never refused by the queue bound
    resume: bool = False
    boot: str = ""  # the incarnation of the tokenizer manager that sent it (AbortWhere.spare_boot)


class GenerateReqId(msgspec.Struct, tag="GenerateReq", array_like=True, gc=False):
    """What the scheduler can still read of a ``GenerateReq`` its mailbox refused (the
    mailbox's salvage type): the request's rid and owner, to end it rather than drop it."""

    rid: str
    input_ids: Any = None
    sampling: Any = None
    stream: Any = None
    return_logprob: Any = None
    top_logprobs_num: Any = None
    worker: Any = 0  # an int, when the refused message's is
    num_prior_output: Any = 0
    replaces: Any = None  # a str, when the refused message's is: the incarnation it was to replace


class WireCheck:
    """A sender's check of a ``GenerateReq`` against the wire schema, before it goes:
    what the scheduler's mailbox would refuse, as a message that names the field."""

    def __init__(self) -> None:
        self._encoder = Encoder()
        self._decoder = Decoder(SchedulerInbox)

    def problem(self, msg: GenerateReq) -> str | None:
        try:
            self._decoder.decode(self._encoder.encode(msg))
        except (CodecError, TypeError, OverflowError) as exc:  # (TypeError, OverflowError: not encodable)
            return wire_field(exc.detail if isinstance(exc, CodecError) else str(exc))
        return None


_CLIENT_NAMES = {"sampling": "sampling_params"}


def wire_field(detail: str) -> str:
    """A refusal of a ``GenerateReq`` as ``field: why``, the field as the client names it
    (msgspec's ``... - at `$[3].seed``` → ``sampling_params.seed: ...``)."""
    text, _, where = detail.partition(" - at `$")
    if not where:
        return detail
    where = where.rstrip("`")
    if where.startswith("["):  # array_like: a position (0 is the tag)
        head, _, rest = where[1:].partition("]")
        fields = GenerateReq.__struct_fields__
        name = fields[int(head) - 1] if head.isdigit() and 1 <= int(head) <= len(fields) else f"[{head}]"
    else:
        name, dot, rest = where.lstrip(".").partition(".")
        rest = dot + rest
    return f"{_CLIENT_NAMES.get(name, name)}{rest}: {text[:1].lower()}{text[1:]}"


class AbortReq(msgspec.Struct, tag=True, array_like=True, gc=False):
    rid: str
    message: str = "aborted"


class AbortWhere(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Abort (by ``call``; the reply is how many) every request whose rid is ``rid``
    in any incarnation, or that ``worker`` owns: an /abort_request that reached
    another worker, or the requests of a worker that died."""

    reply: ClassVar[Any] = int
    rid: str | None = None
    worker: int | None = None
    message: str = "aborted"
    # with ``worker``: spare that worker's requests sent by this boot of its tokenizer manager (a
    # restarted one ends what its previous incarnation left running, not what it sent itself)
    spare_boot: str | None = None


class FlushCacheReq(msgspec.Struct, tag=True, array_like=True, gc=False):
    """By ``call``: empty the prefix cache; the reply is whether it was (False while requests run)."""

    reply: ClassVar[Any] = bool


class Weights(msgspec.Struct):
    """The weights a scheduler serves: where they were loaded from, and their digest."""

    path: str | None
    digest: str | None = None


class ServerInfo(msgspec.Struct):
    """A scheduler's answer to ``ServerInfoReq``: its configuration, model and figures."""

    boot: str  # this scheduler process (a restart is a new one)
    scheduler: dict[str, Any]  # its SchedulerConfig
    device: str
    deterministic_inference: bool  # what runs, not only what was asked
    invariance: dict[str, Any] | None  # which paths make it so (None: the mode is off)
    max_context_len: int
    weights: Weights
    waiting: int
    running: int
    requests_by_worker: dict[str, int]  # requests held, by tokenizer worker
    kv_pages_total: int
    kv_pages_free: int
    kv_page_size: int
    cached_pages: int
    retracted: int
    aborted: int
    steps: int
    loading: bool = False  # bound, its model not in yet (the figures above are empty until it is)
    speculative_draft_tokens: int = 0  # draft tokens verified (speculative decoding), and accepted
    speculative_accepted_tokens: int = 0


class ServerInfoReq(msgspec.Struct, tag=True, array_like=True, gc=False):
    reply: ClassVar[Any] = ServerInfo


class HealthProbe(msgspec.Struct, tag=True, array_like=True, gc=False):
    reply: ClassVar[Any] = bool


class WeightsResult(msgspec.Struct, omit_defaults=True):
    """The outcome of a weights update: ``status`` is the HTTP status of a failure (default 400);
    ``weights``, those that serve after a success."""

    success: bool
    message: str
    status: int | None = None
    weights: Weights | None = None


class UpdateWeightsReq(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Load new weights of the same architecture (only sent when no request runs)."""

    reply: ClassVar[Any] = WeightsResult
    model_path: str


class StopStringHit(msgspec.Struct, tag=True, array_like=True, gc=False):
    rid: str
    matched: str


SchedulerInbox = (
    GenerateReq | AbortReq | AbortWhere | FlushCacheReq | ServerInfoReq | HealthProbe | StopStringHit
    | UpdateWeightsReq
)


# -- Scheduler → DetokenizerManager ----------------------------------------------


class DecodeInit(msgspec.Struct, array_like=True, gc=False):
    """What the detokenizer needs to know of a request, sent with its first output."""

    rid: str
    worker: int
    stop: list[str]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    prior_ids: list[int] = []  # resume: generated ids whose text the client already has
    replaces: str | None = None  # resume: the rid whose state this one takes over


class BatchTokenIDOut(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One scheduler step: the requests that advanced, as parallel columns."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    inits: list[DecodeInit] = []
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    boot: str = ""  # the scheduler incarnation that ran the step ("": not told)


class DetokenizerInfo(msgspec.Struct):
    """A detokenizer's answer to ``DetokenizerInfoReq``."""

    requests: int  # requests it holds decoding state for
    unknown_rids: int  # outputs of requests it did not know (late steps of an ended or replaced incarnation)
    swept: int  # states of a restarted scheduler's earlier incarnation it dropped
    boot: str  # this detokenizer process


class DetokenizerInfoReq(msgspec.Struct, tag=True, array_like=True, gc=False):
    """By ``call``: how many requests the detokenizer holds state for."""

    reply: ClassVar[Any] = DetokenizerInfo


class ForgetRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """TokenizerManager → a replica's detokenizer: these incarnations resume on another
    replica (theirs went down); drop their decoding state (unknown ones are ignored)."""

    rids: list[str]


DetokenizerInbox = BatchTokenIDOut | DetokenizerInfoReq | ForgetRequests


# -- DetokenizerManager → TokenizerManager ---------------------------------------


class BatchStrOut(msgspec.Struct, tag=True, array_like=True, gc=False):
    rids: list[str]
    texts: list[str]  # text deltas; never a split character
    new_token_ids: list[list[int]]
    finished: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


class RuntimeStatus(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The main process → each tokenizer worker, after every supervisor event."""

    scheduler_up: bool
    resume: bool = False  # the scheduler or detokenizer restarted: resubmit what is in flight
    crash: str | None = None  # with resume: what crashed and why
    failure: str | None = None  # the runtime gave up: end every request with this error
    restarts: dict[str, int] = {}
    crashes: list[tuple[str, str, int]] = []  # (actor, cause, count)
    recoveries: list[float] = []
    pids: dict[str, int] = {}
    paused: bool = False  # /pause_generation on any worker holds new requests on every worker
    updating: bool = False  # weights are being replaced: new requests wait on every worker


TokenizerInbox = BatchStrOut | RuntimeStatus


# -- tokenizer worker → the main process's Coordinator ---------------------------


class WorkerStalled(msgspec.Struct, tag=True, array_like=True, gc=False):
    """No output for the watchdog's timeout while requests were in flight."""

    worker: int
    message: str


class SetPaused(msgspec.Struct, tag=True, array_like=True, gc=False):
    """By ``call``: pause or continue generation on every worker."""

    paused: bool


class UpdateWeightsAll(msgspec.Struct, tag=True, array_like=True, gc=False):
    """By ``call``: hold new requests on every worker, let those in flight finish on the
    old weights, load new ones, let the held requests go."""

    reply: ClassVar[Any] = WeightsResult
    model_path: str


ControlInbox = WorkerStalled | SetPaused | UpdateWeightsAll
