"""Frames no socket may die of: every way a peer can send something that is not a message.

`hostile_frames(other)` adds `other`, a valid message meant for another socket, so each
socket also shows it rejects types outside its own union.
"""

from __future__ import annotations

import os

from msgspec.msgpack import encode as packb

from memspec.common.messages import PROTOCOL_VERSION, Message, encode

V = bytes([PROTOCOL_VERSION])


def hostile_frames(other: Message) -> list[list[bytes]]:
    return [
        [os.urandom(64)],  # random bytes
        [b""],  # an empty frame
        [V + packb(["Submit", 5, ["x"]])],  # wrong field types
        [V + packb(["Load", "zero", 1, "x", "/etc/passwd", "shm", "memspec-x", 1])],
        [V + packb(["NoSuchThing"])],  # unknown type
        [V + packb({"type": "Submit"})],  # not an array
        [V + b"\x93\x01"],  # truncated msgpack
        [packb({"v": 1, "type": "Submit", "req_id": "a", "prompt": "x"})],  # version 1
        [bytes([99]) + packb(["Submit", "a", "x"])],  # a future version
        [b"\x00" * (9 << 20)],  # over the protocol's frame limit
        [*encode(other), b"extra"],  # a second frame
        encode(other),  # valid, but not for this socket
    ]
