"""Typed messages: each socket's codec accepts exactly its union, nested fields included,
and every rejection is a ProtocolError with a reason a person can act on."""

from __future__ import annotations

import msgspec
import pytest
from hostile import hostile_frames
from msgspec.msgpack import encode as packb

from memspec.bench.messages import measure, samples
from memspec.common.errors import RequestError
from memspec.common.limits import check_gate
from memspec.common.messages import (
    CLIENT_REQUESTS,
    CONTROL,
    DECODER_REPLIES,
    DECODER_REQUESTS,
    LOADER_REQUESTS,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Codec,
    Done,
    LoaderInfo,
    ProtocolError,
    Ready,
    Shutdown,
    Submit,
    encode,
)
from memspec.common.metrics import as_json

CODECS: list[Codec] = [CLIENT_REQUESTS, CONTROL, DECODER_REPLIES, DECODER_REQUESTS,
                       LOADER_REQUESTS]


def frame(*fields: object) -> list[bytes]:
    return [bytes([PROTOCOL_VERSION]) + packb(list(fields))]


def test_every_message_round_trips_through_its_sockets_codec():
    for name, (msg, codec) in samples().items():
        frames = encode(msg)
        assert len(frames) == 1 and frames[0][0] == PROTOCOL_VERSION
        assert codec.decode(frames) == msg, name


def test_a_codec_accepts_only_its_sockets_types():
    for msg, _codec in samples().values():
        for codec in CODECS:
            if type(msg) in codec.types:
                assert codec.decode(encode(msg)) == msg
                continue
            with pytest.raises(ProtocolError, match=f"{type(msg).__name__} is not accepted "
                                                    f"on the {codec.socket} socket"):
                codec.decode(encode(msg))


def test_shutdown_is_no_client_message():
    with pytest.raises(ProtocolError, match="Shutdown is not accepted on the client socket"):
        CLIENT_REQUESTS.decode(encode(Shutdown(reason="stop the server")))
    assert DECODER_REQUESTS.decode(encode(Shutdown())) == Shutdown()


def test_nested_fields_are_validated_on_decode():
    done = samples()["Done"][0]
    assert isinstance(done, Done)
    stats = as_json(done.stats)
    stats["time"]["decode"] = "fast"
    with pytest.raises(ProtocolError, match="invalid Done.*decode"):
        DECODER_REPLIES.decode(frame("Done", "r", "text", [1, 2], stats))
    stats = as_json(done.stats)
    stats["surprise"] = 1
    with pytest.raises(ProtocolError, match="surprise"):
        DECODER_REPLIES.decode(frame("Done", "r", "text", [1, 2], stats))
    with pytest.raises(ProtocolError, match="invalid Ready"):
        CONTROL.decode(frame("Ready", "loader", 7, {"type": "loader", "io": "direct"}))
    with pytest.raises(ProtocolError, match="invalid Ready"):
        CONTROL.decode(frame("Ready", "loader", 7, {"type": "gpu", "io": "direct"}))
    ok = Ready("loader", 7, LoaderInfo(["shm"], "direct", 1 << 20))
    assert CONTROL.decode(encode(ok)) == ok
    with pytest.raises(ProtocolError, match="invalid Status"):
        DECODER_REPLIES.decode(frame("Status", {}, [{"slot": "zero", "generation": 0,
                                                     "state": "free", "draft": None}]))


def test_fields_are_checked_and_defaults_may_be_left_out():
    assert CLIENT_REQUESTS.decode(frame("Submit", "r", "hi")) == Submit("r", "hi")
    for bad in (frame("Submit", "r"), frame("Submit", 5, "hi"), frame("Submit", "r", "hi", True),
                frame("Submit", "r", "hi", 0, "", 0.0, 1.0, None, False, None, "extra")):
        with pytest.raises(ProtocolError, match="invalid Submit"):
            CLIENT_REQUESTS.decode(bad)


def test_versions_and_frame_limits_have_readable_reasons():
    with pytest.raises(ProtocolError, match=f"protocol version 99, expected {PROTOCOL_VERSION}"):
        CLIENT_REQUESTS.decode([bytes([99]) + packb(["Submit", "r", "hi"])])
    with pytest.raises(ProtocolError, match="protocol version 1 or not memspec"):
        CLIENT_REQUESTS.decode([packb({"v": 1, "type": "Submit", "req_id": "r"})])
    with pytest.raises(ProtocolError, match=f"exceeds {MAX_FRAME_BYTES}"):
        CLIENT_REQUESTS.decode([b"\x02" * (MAX_FRAME_BYTES + 1)])
    with pytest.raises(ProtocolError, match="expected 1 frame, got 2"):
        CLIENT_REQUESTS.decode([*encode(Submit("r", "hi")), b""])
    for frames in hostile_frames(Shutdown()):
        with pytest.raises(ProtocolError):
            CLIENT_REQUESTS.decode(frames)


def test_summaries_print_as_plain_json():
    done = samples()["Done+trace"][0]
    out = as_json(done.stats)
    assert out["time"]["decode"] > 0 and out["trace"]["iterations"][0]["draft"] == "general"
    assert msgspec.convert(out, type(done.stats)) == done.stats


def test_the_message_benchmark_runs():
    got = measure(budget_s=0.002)
    assert set(got) == set(samples()) and all(v["us"] > 0 and v["bytes"] > 0
                                               for v in got.values())


def test_a_per_request_gate_is_optional_typed_and_old_frames_still_decode():
    """Submit.gate (None: the pool's spec_gate) is the last field: a frame from a client
    that predates it decodes with the pool's gate, one that sets it round-trips, and
    anything but a bool or nil is refused by the codec (and by check_gate for a Submit
    that never crossed a socket)."""
    old = frame("Submit", "r", "hi", 8, "memspec", 0.0, 1.0, None, False, None, [], [], 0,
                0.0, [], 0)
    assert CLIENT_REQUESTS.decode(old).gate is None
    for gate in (True, False):
        msg = Submit("r", "hi", policy="mab-async", gate=gate)
        assert CLIENT_REQUESTS.decode(encode(msg)) == msg
        assert DECODER_REQUESTS.decode(encode(msg)).gate is gate
    assert encode(Submit("r", "hi")) == encode(Submit("r", "hi", gate=None))  # omitted
    with pytest.raises(ProtocolError, match=r"invalid Submit.*\$\[16\]"):
        CLIENT_REQUESTS.decode(frame("Submit", "r", "hi", 8, "memspec", 0.0, 1.0, None,
                                     False, None, [], [], 0, 0.0, [], 0, "yes"))
    for bad in ("yes", 1):
        with pytest.raises(RequestError, match="gate .* is not True, False or None"):
            check_gate(Submit("r", "hi", gate=bad))
    check_gate(Submit("r", "hi", gate=False))


@pytest.mark.parametrize("gate", ["yes", 1])
def test_the_python_api_refuses_a_gate_that_is_not_a_bool_before_sending(gate):
    from memspec.launch.api import _submit

    with pytest.raises(RequestError, match="gate .* is not True, False or None"):
        _submit("hi", gate=gate)
    assert _submit("hi", gate=False).gate is False and _submit("hi").gate is None
