"""Every message on every socket: typed msgspec structs, one tagged union per socket.

On the wire a message is one ZeroMQ frame: a protocol-version byte, then the msgpack
array ``[type name, *fields]`` (positional, trailing defaults omitted). Each socket decodes
with its own :class:`Codec`, which accepts only that socket's union, so decoding *is* the
validation: a wrong type, a missing or extra field, a bad value or a message meant for
another socket becomes a :class:`ProtocolError` with a readable reason, which receivers
answer with an :class:`Error` reply or a log line, never by dying.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

import msgspec

from memspec.common.metrics import Summary, Totals

PROTOCOL_VERSION = 2  # 1: msgpack maps with a "v" key (before typed unions)
MAX_FRAME_BYTES = 8 << 20  # a frame larger than this is rejected before msgpack sees it
MAX_FRAMES = 1
MAX_REASON_CHARS = 300  # a ProtocolError's reason (echoed in an Error reply and logged)


class ProtocolError(ValueError):
    """Frames that are not a valid message of this protocol version for this socket."""


class Message(msgspec.Struct, tag=True, array_like=True, omit_defaults=True,
              forbid_unknown_fields=True, gc=False):
    """Base of every message; the tag (first array element) is the class name."""


# --- nested fields -----------------------------------------------------------------------
class DecoderInfo(msgspec.Struct, tag="decoder", forbid_unknown_fields=True):
    load_s: float
    K: int
    transport: str  # "shm" | "cuda-ipc"
    slot_bytes: int
    bandwidth_bytes_s: float  # edge-emulated pacing of every load (0: unpaced)
    handles: list[str]
    dtype: str = ""  # the target's precision (pool dtype, "auto" resolved)
    isa: str = ""  # the CPU kernel path its forward runs (memspec.common.isa; "" on GPUs)
    # seconds per start-up phase (procs/decoder/startup.py): what a restart costs, and where
    startup: dict[str, float] = {}


class LoaderInfo(msgspec.Struct, tag="loader", forbid_unknown_fields=True):
    transports: list[str]
    io: str
    chunk: int


class PredictorInfo(msgspec.Struct, tag="predictor", forbid_unknown_fields=True):
    drafts: list[str]
    load_s: float
    head: str
    device: str
    threads: int
    T: int


ProcInfo = DecoderInfo | LoaderInfo | PredictorInfo


class ProcStatus(msgspec.Struct, forbid_unknown_fields=True):
    pid: int | None
    state: str
    restarts: int = 0
    rss_mb: float = 0.0
    shared_mb: float = 0.0
    isa: str = ""  # the decoder's CPU kernel path, once it is ready
    dtype: str = ""  # the decoder's target precision, once it is ready
    crashes: int = 0  # exits in a row without a stable run since (a crash loop when > 1)
    backoff_s: float = 0.0  # seconds until the supervisor starts it again (a crash loop)
    recovery_s: float = 0.0  # its last restart: crash noticed -> ready again
    startup: dict[str, float] = {}  # the decoder's start-up phases of its last start
    standby_pid: int | None = None  # the decoder's standby (procs/decoder/standby.py), if any
    bandwidth_bytes_s: float = 0.0  # the decoder's edge-emulated load pacing (0: unpaced)
    ready_s: float = 0.0  # its last start: spawned (or taken over, a standby) -> Ready
    pss_mb: float = 0.0  # proportional set size: shared pages split among their users
    uss_mb: float = 0.0  # unique set size: what ending the process would free
    standby_kept: bool = False  # the decoder: its server keeps a standby (once idle)


class TensorRange(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """Bytes [start, end) of a weight file's data section and their sha256 (a manifest's
    entry: common/manifest.py)."""

    name: str
    start: int
    end: int
    sha256: str


class SlotStatus(msgspec.Struct, forbid_unknown_fields=True):
    slot: int
    generation: int
    state: str  # "free" | "loading" | "resident"
    draft: str | None


# --- lifecycle (every process -> supervisor) ---------------------------------------------
class Ready(Message):
    proc: str
    pid: int
    info: ProcInfo


class Heartbeat(Message):
    proc: str
    pid: int
    state: str = "idle"


class Shutdown(Message):
    reason: str = ""


class PeerRestarted(Message):
    """Supervisor -> decoder: re-sync with a process that came back."""

    proc: str
    pid: int


# --- decoder <-> predictor -----------------------------------------------------------------
class Snapshot(Message):
    req_id: str
    seq: int
    prompt: str
    recent_ids: list[int]


class Ranking(Message):
    req_id: str
    seq: int
    drafts: list[str]
    scores: list[float]
    latency_s: float


# --- decoder <-> loader --------------------------------------------------------------------
class Load(Message):
    slot: int
    generation: int
    draft: str
    path: str  # the draft's model.safetensors
    transport: str  # "shm" | "cuda-ipc"
    handle: str  # shm name, or a serialised CUDA IPC handle
    capacity: int
    storage: str = "native"
    bandwidth_bytes_s: float = 0.0  # edge-emulated pacing; 0: unpaced
    expected_sha256: str = ""  # of the file's data section; "": not checked
    header_sha256: str = ""  # of bytes [0, data offset): the header the ranges belong to
    ranges: list[TensorRange] = []  # tile the data section; each checked as it is copied


class Cancel(Message):
    slot: int
    generation: int


class Loaded(Message):
    slot: int
    generation: int
    draft: str
    nbytes: int
    seconds: float
    checksum: str  # sha256 of the data section; "" when it was checked range by range


class LoadFailed(Message):
    slot: int
    generation: int
    draft: str
    reason: str


# --- clients <-> supervisor <-> decoder ----------------------------------------------------
class ChatTurn(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One chat message; the target's chat template renders a list of them."""

    role: str
    content: str
    # an assistant turn's calls, as JSON text of OpenAI's `tool_calls` list (common/toolcalls.py)
    tool_calls: str = ""


def chat_text(turns: list[ChatTurn]) -> str:
    """The text of a chat the predictor ranks drafts from (`Submit.prompt`): what the
    system and user said (a one-turn chat gives the prompt `memspec generate` would)."""
    return "\n".join(t.content for t in turns if t.role != "assistant") or turns[-1].content


class Submit(Message):
    """A request. `prompt` is a user turn rendered by the target's chat template (what
    `memspec generate` does), unless `messages` is given: then the whole chat is rendered
    and `prompt` is only the text the predictor ranks the drafts from ("": the decoder takes
    `chat_text(messages)`). Generation ends at the first of `stop` (the text is cut before
    it). Every field's limits: common/limits.py."""

    req_id: str
    prompt: str
    max_new_tokens: int = 0  # 0: the pool's default
    policy: str = ""  # "": the pool's default
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    trace: bool = False  # Done.stats gets a per-iteration / per-load timeline
    ucb_c: float | None = None  # mab-* exploration constant (None: the pool's)
    messages: list[ChatTurn] = []
    stop: list[str] = []
    top_k: int = 0  # 0: off; 1: greedy (procs/decoder/sched/acceptance.py)
    min_p: float = 0.0  # 0: off
    # Set by the supervisor only, to resume a request whose decoder crashed: the tokens the
    # client already has (decoded as context after the prompt, the rest of the budget
    # generated after them) and the characters of text it already has (the rest is owed)
    resume_ids: list[int] = []
    resume_chars: int = 0
    # the speculation gate for this request (None: the pool's spec_gate); last, so that a
    # frame from a client that predates it decodes unchanged
    gate: bool | None = None
    # tokens still to come for a ranking to be asked for (None: the pool's rank_horizon);
    # for the sweep that chooses a pool's value on dev
    rank_horizon: int | None = None
    # at most this many decoder threads for this request (None: every core while the
    # helpers rest, procs/decoder/forward/threads.py); how the bench measures the old one-thread
    # pipeline beside today's, and for a user who shares the machine with other work
    threads: int | None = None
    # the output's format: "" (free text), "json_object" (any JSON object) or "json_schema"
    # (`json_schema`, a JSON Schema as JSON text): every emitted token is the target's
    # choice among those the grammar allows (procs/decoder/sched/constraint.py)
    response_format: str = ""
    json_schema: str = ""
    # each token's log-probability under the target and this many alternatives (OpenAI's
    # `top_logprobs`, 0-20; None: none)
    logprobs: int | None = None
    # tools the model may call (JSON text of OpenAI's `tools` list) and whether it must:
    # "" or "auto", "none", "required", or "function:NAME" (common/toolcalls.py)
    tools: str = ""
    tool_choice: str = ""


class Queued(Message):
    """Supervisor -> client: the request was accepted and `ahead` requests run before it
    (0: it is running). Sent at once and again every few seconds until it ends, so a client
    tells a long queue from a server that is gone, and the supervisor notices a client
    that left (its request is then cancelled)."""

    req_id: str
    ahead: int


class Abort(Message):
    """Supervisor -> decoder: stop this request at the next scheduling point."""

    req_id: str


class TopLogprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A likely token at a position: its text, id and log-probability under the target."""

    token: str
    id: int
    logprob: float


class TokenLogprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An emitted token's log-probability and the most likely tokens at its position."""

    token: str
    id: int
    logprob: float
    top: list[TopLogprob] = []


def logprobs_json(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """`memspec generate --json`'s `logprobs`: one object per token."""
    return [{"token": t.token, "id": t.id, "logprob": t.logprob,
             "top": [{"token": a.token, "id": a.id, "logprob": a.logprob} for a in t.top]}
            for t in entries]


class ToolCall(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A call the reply made: an id, the tool's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class Tokens(Message):
    req_id: str
    ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = []  # one per id, where the request asked for them


class Done(Message):
    req_id: str
    text: str
    token_ids: list[int]
    stats: Summary
    finish_reason: str = ""  # "stop" (end of sequence or a stop string) | "length"
    # one per token this decoder emitted, where asked for (a resumed request's tokens from
    # before a decoder crash have none)
    logprobs: list[TokenLogprob] = []
    # with tools: the calls read back from the reply (then `text` is what is left of it)
    tool_calls: list[ToolCall] = []


ErrorKind = Literal["", "request", "busy", "unavailable"]


class Error(Message):
    """`kind` says what the client may do: "request" (the request itself is wrong: fix it),
    "busy" (the queue is full: retry later), "unavailable" (a process is restarting or the
    server is stopping: retry later), "" (anything else, e.g. cancelled)."""

    req_id: str
    message: str
    kind: ErrorKind = ""


class StatusRequest(Message):
    pass


class Status(Message):
    procs: dict[str, ProcStatus]
    slots: list[SlotStatus]
    quarantined: dict[str, str] = {}  # draft -> why it is never loaded or run
    totals: Totals | None = None  # the supervisor's counters (None from the decoder)
    pool_id: str = ""  # the supervisor's pool (paths.pool_identity; "" from the decoder)


# --- encoding and one decoder per socket ----------------------------------------------------
_ENCODER = msgspec.msgpack.Encoder()
_ALL = {cls.__name__: cls for cls in Message.__subclasses__()}
M = TypeVar("M", bound=Message)


def encode(msg: Message) -> list[bytes]:
    """The frames of one message (the version byte and the body share one buffer)."""
    buf = bytearray((PROTOCOL_VERSION,))
    _ENCODER.encode_into(msg, buf, 1)
    return [buf]


class Codec(Generic[M]):
    """Decodes what one socket may receive: exactly the message types it names."""

    def __init__(self, socket: str, *types: type[Message]) -> None:
        self.socket = socket
        self.types = types
        self._decoder = msgspec.msgpack.Decoder(types[0] if len(types) == 1
                                                else _union(types))

    def decode(self, frames: list[bytes]) -> M:
        """Validate untrusted frames; every failure is a ProtocolError with a readable reason."""
        if len(frames) != MAX_FRAMES:
            raise ProtocolError(f"expected {MAX_FRAMES} frame, got {len(frames)}")
        frame = frames[0]
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        if not frame:
            raise ProtocolError("empty frame")
        version = frame[0]
        if version != PROTOCOL_VERSION:
            raise ProtocolError(_version_reason(version))
        body = memoryview(frame)[1:]
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(_clip(self._reason(body, exc))) from None

    def _reason(self, body: memoryview, exc: Exception) -> str:
        """Name a known message sent to the wrong socket; else msgspec's own words."""
        try:
            raw = msgspec.msgpack.decode(body)
        except msgspec.DecodeError:
            return f"not msgpack ({exc})"
        name = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
        if name is not None and len(name) > 40:
            name = name[:37] + "..."
        if name in _ALL and name not in {t.__name__ for t in self.types}:
            allowed = ", ".join(t.__name__ for t in self.types)
            return f"{name} is not accepted on the {self.socket} socket (only {allowed})"
        return f"invalid {name or 'message'}: {exc}"


def _clip(reason: str) -> str:
    """msgspec quotes the offending value (a megabyte type name, say): an error reply and a
    log line stay small."""
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return reason[:MAX_REASON_CHARS - 30] + f"... ({len(reason)} characters)"


def _union(types: tuple[type[Message], ...]) -> Any:
    out: Any = types[0]
    for t in types[1:]:
        out = out | t
    return out


def _version_reason(first: int) -> str:
    if first >= 0x80:  # a msgpack map or array: a version-1 peer, or not memspec at all
        return (f"protocol version 1 or not memspec (frame starts with 0x{first:02x}), "
                f"expected version {PROTOCOL_VERSION}")
    return f"protocol version {first}, expected {PROTOCOL_VERSION}"


def type_name(msg: Message) -> str:
    return type(msg).__name__


# What each socket receives (docs/DESIGN.md draws them): the loader's and predictor's
# ROUTERs, the decoder's DEALERs to them, the decoder's ROUTER for the supervisor, the
# supervisor's DEALER to it, its client ROUTER and control PULL, and the client's DEALER.
LOADER_REQUESTS: Codec[Load | Cancel] = Codec("loader", Load, Cancel)
LOADER_REPLIES: Codec[Loaded | LoadFailed | Error] = Codec(
    "loader-reply", Loaded, LoadFailed, Error)
PREDICTOR_REQUESTS: Codec[Snapshot] = Codec("predictor", Snapshot)
PREDICTOR_REPLIES: Codec[Ranking | Error] = Codec("predictor-reply", Ranking, Error)
DECODER_REQUESTS: Codec[Submit | Abort | StatusRequest | PeerRestarted | Shutdown] = Codec(
    "decoder", Submit, Abort, StatusRequest, PeerRestarted, Shutdown)
DECODER_REPLIES: Codec[Tokens | Done | Error | Status] = Codec(
    "decoder-reply", Tokens, Done, Error, Status)
CLIENT_REQUESTS: Codec[Submit | StatusRequest] = Codec("client", Submit, StatusRequest)
CLIENT_REPLIES: Codec[Queued | Tokens | Done | Error | Status] = Codec(
    "client-reply", Queued, Tokens, Done, Error, Status)
CONTROL: Codec[Ready | Heartbeat | Status | Error] = Codec(
    "control", Ready, Heartbeat, Status, Error)
