"""Shared fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before torch / transformers load
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the suite runs several processes

import weakref  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import zmq  # noqa: E402
from tinymodels import make_tiny, make_tiny_head, save_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A target and three drafts (self copy, random, smaller) as HF folders."""
    root = tmp_path_factory.mktemp("tiny")
    save_model(make_tiny(0), root / "target")
    save_model(make_tiny(0), root / "self")
    save_model(make_tiny(1, layers=1), root / "random")
    save_model(make_tiny(2, layers=1, hidden=32), root / "small")
    return root


@pytest.fixture(scope="session")
def tiny_heads(tiny_dir, tmp_path_factory):
    """Two draft heads for the tiny target."""
    root = tmp_path_factory.mktemp("heads")
    # one stored as the pool ships heads (packed Q8_0), one in bf16: both formats run
    return [make_tiny_head(root / f"head{i}", seed=10 + i, q8=i == 0) for i in range(2)]


@pytest.fixture
def knobs(tmp_path, monkeypatch):
    """``knobs({"head.FIRST": 0.0, ...})``: the runtime reads those tuned values (a scratch
    tuned.json named by MEMSPEC_TUNED), every other knob as committed."""
    import json

    from memspec.common.tuned import TUNED_ENV, TUNED_FILE

    made = [0]

    def use(values: dict) -> None:
        data = json.loads(TUNED_FILE.read_text())
        for name, value in values.items():
            data["knobs"][name]["value"] = value
        made[0] += 1  # a new name each time: a reader caches a file's knobs by its path
        scratch = tmp_path / f"tuned-{made[0]}.json"
        scratch.write_text(json.dumps(data))
        monkeypatch.setenv(TUNED_ENV, str(scratch))

    return use


# ZeroMQ contexts a test body made and left open (a test that failed half-way) are
# destroyed with linger 0 as the test ends. Otherwise one is garbage-collected in some later
# test, and closing it there can block forever on a socket still holding a message: the
# whole run would stall instead of reporting one failure.
_CONTEXTS: weakref.WeakSet = weakref.WeakSet()
_context_init = zmq.Context.__init__


def _tracked_init(self, *args, **kwargs):
    _context_init(self, *args, **kwargs)
    _CONTEXTS.add(self)


zmq.Context.__init__ = _tracked_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = set(_CONTEXTS)
    yield
    keep = _pyzmq_internal()
    for ctx in set(_CONTEXTS) - before:  # fixtures' own contexts (setup) are theirs to close
        if not ctx.closed and ctx is not keep:
            ctx.destroy(linger=0)


def _pyzmq_internal():
    """pyzmq's own garbage-collector context (started by the first large zero-copy send):
    destroying it under pyzmq aborts the process."""
    try:
        from zmq.utils.garbage import gc
    except ImportError:
        return None
    return getattr(gc, "_context", None)
