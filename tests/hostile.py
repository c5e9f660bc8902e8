"""Frames no socket may die of: every way a peer can send something that is not a message.

`hostile_frames(other)` adds `other`, a valid message meant for another socket, so each
socket also shows it rejects types outside its own union. `random_frames` is the fuzzer of
the fault suite (tests/test_faults.py): thousands of such frames from a seeded generator.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

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


def _value(rng: random.Random, depth: int = 0) -> object:
    """A random msgpack-able value: the shapes a confused or malicious peer sends."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, rng.randrange(-999, 999)])
    if kind == 1:
        return rng.choice([0.5, -1e308, float("inf"), float("nan"), rng.random()])
    if kind == 2:
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return os.urandom(rng.randrange(16))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(NAMES)
    if kind == 6:
        return "x" * rng.choice([0, 1, 1000, 100_000])
    if kind == 7:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 8:
        return {str(_value(rng, depth + 1))[:8]: _value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return [rng.choice(NAMES), *(_value(rng, depth + 1) for _ in range(rng.randrange(8)))]


NAMES = [cls.__name__ for cls in Message.__subclasses__()] + ["NoSuchThing", "", "submit"]


def random_frames(rng: random.Random, n: int, valid: list[Message]) -> Iterator[list[bytes]]:
    """`n` hostile frame lists, every kind in turn: random bytes, random msgpack, a known
    type name with random fields, a message cut short or with flipped bytes, another
    protocol version, extra frames, invalid UTF-8 in a string, and the `valid` messages as
    they are (for this socket, ones that must be refused or are harmless)."""
    for i in range(n):
        msg = rng.choice(valid)
        good = encode(msg)[0]
        kind = i % 9
        if kind == 0:
            yield [os.urandom(rng.randrange(0, 300))]
        elif kind == 1:
            yield [V + packb(_value(rng))]
        elif kind == 2:
            yield [V + packb([rng.choice(NAMES), *(_value(rng) for _ in range(rng.randrange(9)))])]
        elif kind == 3:
            yield [bytes(good[:rng.randrange(1, max(2, len(good)))])]
        elif kind == 4:
            flipped = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(1, len(flipped))] ^= 1 << rng.randrange(8)
            yield [bytes(flipped)]
        elif kind == 5:
            yield [bytes([rng.choice([0, 1, 3, 0x82, 0x93, 255])]) + bytes(good[1:])]
        elif kind == 6:
            yield [bytes(good), *([os.urandom(8)] * rng.randrange(1, 3))]
        elif kind == 7:
            yield [V + b"\x92\xa6Submit\xa3\xff\xfe\xfd"]  # a str that is not UTF-8
        else:
            yield [bytes(good)]
