"""Every message on every socket: typed, versioned, msgpack on the wire, validated on receipt.

A message is a multipart ZeroMQ frame list: ``[header, *raw]`` where ``header`` is a msgpack
map ``{"v": PROTOCOL_VERSION, "type": name, **fields}`` and ``raw`` are optional byte
frames for large arrays (described by the header, never pickled). :func:`decode` turns
untrusted frames into a message object or raises :class:`ProtocolError` — receivers answer
that with an :class:`Error` reply or a log line, never by dying.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, get_type_hints

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 << 20  # a frame larger than this is rejected before msgpack sees it
MAX_FRAMES = 4


class ProtocolError(ValueError):
    """Frames that are not a valid message of this protocol version."""


_REGISTRY: dict[str, type[Message]] = {}


@dataclass
class Message:
    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.TYPE = cls.__name__
        _REGISTRY[cls.TYPE] = cls


def _check(value: Any, hint: Any, name: str, mtype: str) -> Any:
    """Check one field against its annotation (int, float, str, bool, list[...], dict, None)."""
    origin = getattr(hint, "__origin__", None)
    args = getattr(hint, "__args__", ())
    if hint is Any:
        return value
    if args and type(None) in args:  # X | None
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], name, mtype)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{mtype}.{name} must be a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{mtype}.{name} must be an integer")
        return value
    if hint in (str, bool, bytes):
        if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
            raise ProtocolError(f"{mtype}.{name} must be {hint.__name__}")
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{mtype}.{name} must be a list")
        return [_check(v, args[0], f"{name}[]", mtype) for v in value] if args else list(value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{mtype}.{name} must be a map")
        return value
    raise ProtocolError(f"{mtype}.{name} has an unsupported type")


def encode(msg: Message, raw: list[bytes] | None = None) -> list[bytes]:
    body = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    body.update({f.name: getattr(msg, f.name) for f in fields(msg)})
    return [msgpack.packb(body, use_bin_type=True), *(raw or [])]


def decode(frames: list[bytes]) -> tuple[Message, list[bytes]]:
    """Validate untrusted frames; every failure is a ProtocolError with a readable reason."""
    if not frames or len(frames) > MAX_FRAMES:
        raise ProtocolError(f"expected 1..{MAX_FRAMES} frames, got {len(frames)}")
    for f in frames:
        if len(f) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(f)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise ProtocolError("header is not a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {body.get('v')!r}, expected {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(body.get("type")) if isinstance(body.get("type"), str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {body.get('type')!r}")
    hints = get_type_hints(cls)
    kwargs = {}
    names = {f.name for f in fields(cls)}
    extra = set(body) - names - {"v", "type"}
    if extra:
        raise ProtocolError(f"{cls.TYPE} has unknown field {sorted(map(str, extra))[0]!r}")
    for f in fields(cls):
        if f.name not in body:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{cls.TYPE}.{f.name} is missing")
            continue
        kwargs[f.name] = _check(body[f.name], hints[f.name], f.name, cls.TYPE)
    return cls(**kwargs), list(frames[1:])


# --- lifecycle (every process -> supervisor) ---------------------------------------------
@dataclass
class Ready(Message):
    proc: str
    pid: int
    info: dict = field(default_factory=dict)


@dataclass
class Heartbeat(Message):
    proc: str
    pid: int
    state: str = "idle"


@dataclass
class Shutdown(Message):
    reason: str = ""


@dataclass
class PeerRestarted(Message):
    """Supervisor -> decoder: re-sync with a process that came back."""

    proc: str
    pid: int


# --- decoder <-> predictor -----------------------------------------------------------------
@dataclass
class Snapshot(Message):
    req_id: str
    seq: int
    prompt: str
    recent_ids: list[int]


@dataclass
class Ranking(Message):
    req_id: str
    seq: int
    drafts: list[str]
    scores: list[float]
    latency_s: float


# --- decoder <-> loader --------------------------------------------------------------------
@dataclass
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


@dataclass
class Cancel(Message):
    slot: int
    generation: int


@dataclass
class Loaded(Message):
    slot: int
    generation: int
    draft: str
    nbytes: int
    seconds: float
    checksum: str


@dataclass
class LoadFailed(Message):
    slot: int
    generation: int
    draft: str
    reason: str


# --- clients <-> supervisor <-> decoder ----------------------------------------------------
@dataclass
class Submit(Message):
    req_id: str
    prompt: str
    max_new_tokens: int = 0  # 0: the pool's default
    policy: str = ""  # "": the pool's default
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    trace: bool = False  # Done.stats gets a per-iteration / per-load timeline
    ucb_c: float | None = None  # mab-* exploration constant (None: the pool's)


@dataclass
class Tokens(Message):
    req_id: str
    ids: list[int]
    text: str


@dataclass
class Done(Message):
    req_id: str
    text: str
    token_ids: list[int]
    stats: dict


@dataclass
class Error(Message):
    req_id: str
    message: str


@dataclass
class StatusRequest(Message):
    pass


@dataclass
class Status(Message):
    procs: dict
    slots: list[dict]
