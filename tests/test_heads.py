"""Draft-head training: the trainable twin matches the runtime head, the loop learns on a
tiny target, and what it saves binds and decodes losslessly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinymodels import TINY_VOCAB, make_tiny_head

from memspec.procs.decoder.drafts.head import read_head_config
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward.checkpoint import read_config
from memspec.procs.decoder.models import build_target
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot
from memspec.zoo.head_train import ALL, Batches, HeadPlan, chain_ok, draft_index
from memspec.zoo.heads import (
    DevSet,
    HeadData,
    HeadShape,
    new_trainable,
    read_head_weights,
    train_one,
)
from memspec.zoo.heads_data import Shard, build_shard, open_runtime_target

SHAPE = HeadShape(feature_layers=(0, 1), intermediate=64, vocab=TINY_VOCAB)


@pytest.fixture(scope="module")
def rt(tiny_dir):
    target = tiny_dir / "target"
    return open_runtime_target(target, SHAPE.extract_layers(read_config(target)),
                               dtype="bfloat16")


def test_trainable_head_is_the_runtime_head(tiny_dir, rt, tmp_path):
    """Step s of the unrolled forward gives the logits of the runtime head's s-th proposal
    (teacher-forced prefix, then its own outputs in place of features)."""
    layers = rt.layers
    path = make_tiny_head(tmp_path / "h", seed=3, feature_layers=layers, vocab=48)
    bound = load_into_slot("h", path, SlotBuffer(1 << 20), TINY_VOCAB, rt.engine.target_parts)
    arch, _ = read_head_config(path)
    weights, to_target = read_head_weights(path)
    twin = new_trainable(rt, arch, to_target, seed=0)
    twin.load_head_state(weights)
    ids = torch.tensor([1, 5, 9, 22, 30, 31, 32, 40, 41, 50, 51, 52])
    cache = rt.runner.new_cache(32)
    rt.runner.forward(ids, 0, cache)
    feat = cache.feat[:len(ids)].clone()
    shifted = torch.cat([torch.zeros_like(feat[:1]), feat[:-1]])
    with torch.no_grad():
        outs = twin(ids[None], shifted[None], 4)
    L = 6
    hc = bound.new_cache(32)
    logits, hidden = bound.runner.teacher(ids[:L], 0, hc, shifted[:L])
    for s in range(4):
        if s:
            logits, hidden = bound.runner.step(ids[L + s - 1:L + s], L + s - 1, hc, hidden)
        ref = twin.logits(outs[s][0, L - 1 + s])
        assert torch.allclose(logits[-1].float(), ref, atol=0.1), s
        assert int(logits[-1].argmax()) == int(ref.argmax()), s


def test_chain_mask_counts_greedy_runs():
    nxt = torch.tensor([[5, 6, 7, 8, 9]])
    arg = torch.tensor([[5, 6, 0, 8, 9]])  # row 2's next token is not the target's choice
    ok = chain_ok(nxt, arg, 3)
    assert ok[0].all()
    assert ok[1].tolist() == [[False, True, True, False, True]]
    assert ok[2].tolist() == [[False, False, True, False, False]]


def _responses(rt, n: int, length: int) -> list[dict]:
    g = np.random.default_rng(0)
    rows = []
    for i in range(n):
        prompt = [1, *g.integers(3, TINY_VOCAB, 5).tolist()]
        tokens, _ = rt.engine.generate(prompt, length)
        rows.append({"id": f"p{i}", "domain": ["general", "code"][i % 2],
                     "prompt_ids": prompt, "tokens": tokens})
    return rows


def test_training_learns_and_the_head_stays_lossless(tiny_dir, rt, tmp_path, knobs):
    rows = _responses(rt, 12, 24)
    shard = build_shard(rt, [r["prompt_ids"] + r["tokens"] for r in rows],
                        [len(r["prompt_ids"]) - 1 for r in rows], [r["domain"] for r in rows],
                        "tiny")
    path = tmp_path / "shard.npz"
    shard.save(path)
    shard = Shard.load(path)
    assert shard.sequences == 12 and shard.feat.shape[1] == 64 * len(rt.layers)
    to_target = np.arange(TINY_VOCAB)
    data = HeadData(rt, tiny_dir / "target", to_target, {"responses": shard},
                    DevSet(rt, rows[:6]), {"note": "tiny"})
    plan = HeadPlan("general", 1.0, 1e-2, (("responses", ALL, 1.0),), batch_rows=256,
                    warmup_steps=5, max_steps=120, eval_every_steps=40, patience=5, seed=1)
    rec = train_one(data, SHAPE, plan, tmp_path / "heads")
    assert rec["steps"] == 120 and len(rec["evals"]) == 4
    assert rec["evals"][0]["dev"] == 0.0  # a fresh head is scored from the first checkpoint
    # greedy tiny-target text is learnable: later checkpoints beat the first clearly
    assert rec["best_dev"] > max(1.6, rec["evals"][1]["dev"] + 0.3), rec["evals"]
    knobs({"head.FIRST": 0.0})  # (a tiny head is unsure of most first proposals: this counts
    # what it learned, not where a CPU's floor would have it propose)
    eng = SpecEngine(build_target(tiny_dir / "target", "bfloat16"), (), gamma=4)  # as served
    eng.add_draft(load_into_slot("general", tmp_path / "heads" / "general", SlotBuffer(1 << 20),
                                 TINY_VOCAB, eng.target_parts))
    accepted = iterations = 0
    for r in rows[:4]:
        ref, _ = eng.generate(r["prompt_ids"], 30)
        out, stats = eng.generate(r["prompt_ids"], 30, select=lambda s: "general")
        assert out == ref
        accepted += stats.summary()["num_accepted_tokens"]
        iterations += stats.summary()["num_drafts"]
    assert 1 + accepted / iterations > 1.3  # the served head proposes what it learned


def test_batches_cut_long_sequences_keeping_the_response(rt):
    rows = _responses(rt, 2, 20)
    shard = build_shard(rt, [r["prompt_ids"] + r["tokens"] for r in rows],
                        [len(r["prompt_ids"]) - 1 for r in rows], ["general"] * 2, "t")
    plan = HeadPlan("g", 1.0, 1e-3, (("responses", ALL, 1.0),), batch_rows=64, max_len=10)
    b = Batches({"responses": shard}, plan, (0, 1), rt.layers, 64, seed=0).draw()
    assert b["inp"].shape[1] == 10
    a = int(shard.offsets[1]) - 10 if b["nxt"][0, -1] == shard.nxt[shard.offsets[1] - 1] \
        else int(shard.offsets[2]) - 10
    assert torch.equal(b["feat"][0, 0], torch.from_numpy(
        shard.feat[a - 1].astype(np.float32)))  # the row before the cut, not zeros
    assert int(b["start"][0]) == 0  # the prompt was cut away


def test_draft_index_marks_out_of_vocabulary():
    inv = draft_index(np.array([7, 3, 9]), 12)
    assert inv[[7, 3, 9]].tolist() == [0, 1, 2]
    assert int((inv == -1).sum()) == 9


def test_the_graph_step_is_the_eager_step(tiny_dir, rt, tmp_path):
    """What a CUDA graph captures for a head step (position as data, the whole cache read
    with later keys masked) gives the eager step's logits and output, writes the same K/V
    row, and leaves every other row as it was. Run eagerly here, so any CPU checks it."""
    path = make_tiny_head(tmp_path / "h", seed=4, feature_layers=rt.layers, vocab=48)
    eng = SpecEngine(build_target(tiny_dir / "target", "bfloat16", fast=False), (), gamma=4)
    bound = load_into_slot("h", path, SlotBuffer(1 << 20), TINY_VOCAB, eng.target_parts)
    head = bound.runner
    assert head.native is None  # the PyTorch forward: what runs on a GPU
    ids = torch.tensor([1, 5, 9, 22, 30, 31, 32, 40, 41, 50])
    L = 7
    feats = torch.randn(L, head.arch.features, generator=torch.Generator().manual_seed(0))
    eager, graph = bound.new_cache(32), head.new_cache(32)
    _, hidden = head.teacher(ids[:L], 0, eager, feats[:L])
    graph.k.copy_(eager.k)
    graph.v.copy_(eager.v)
    graph.k[:, :, L + 1:] = 7.0  # stale rows past the position: masked, never read
    tables = head.graph_tables(graph.capacity)
    for s in range(3):
        tok, pos = ids[L + s:L + s + 1], L + s
        before = graph.k.clone()
        want, want_h = head.step(tok, pos, eager, hidden)
        got, got_h = head.graph_step(tok, torch.tensor(pos), graph, hidden, tables)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
        torch.testing.assert_close(got_h, want_h, rtol=0.02, atol=0.02)
        assert torch.equal(graph.k[:, :, pos], eager.k[:, :, pos])
        assert torch.equal(graph.v[:, :, pos], eager.v[:, :, pos])
        untouched = torch.ones(graph.capacity, dtype=torch.bool)
        untouched[pos] = False
        assert torch.equal(graph.k[:, :, untouched], before[:, :, untouched])
        hidden = want_h


def test_a_fine_tune_whose_parent_is_not_built_stops_at_once(tmp_path):
    """--only math without a general head: a one-line error naming both, before the minutes
    of responses and target rows a build spends first."""
    from memspec.common.errors import MemspecError
    from memspec.zoo.heads import default_plans, parent_dir

    plans = default_plans(None)
    dirs = {"general": tmp_path / "general", "math": tmp_path / "math"}
    with pytest.raises(MemspecError) as err:
        parent_dir(plans["math"], dirs)
    assert "general" in str(err.value) and "--only general,math" in err.value.fix
    assert parent_dir(plans["general"], dirs) is None
    (tmp_path / "general").mkdir()
    (tmp_path / "general" / "model.safetensors").write_bytes(b"")
    assert parent_dir(plans["math"], dirs) == tmp_path / "general"


def test_a_continued_head_goes_on_from_its_own_weights(tiny_dir, rt, tmp_path, monkeypatch):
    """--continue: training starts from the head on disk (scored again at step 0), at a
    lower rate, keeps it if nothing beats it, and its record holds the run before."""
    from memspec.common.errors import MemspecError
    from memspec.zoo.heads import CONTINUE_LR, CONTINUE_PATIENCE, continue_plans

    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "home"))
    rows = _responses(rt, 8, 20)
    shard = build_shard(rt, [r["prompt_ids"] + r["tokens"] for r in rows],
                        [len(r["prompt_ids"]) - 1 for r in rows], [r["domain"] for r in rows],
                        "tiny")
    data = HeadData(rt, tiny_dir / "target", np.arange(TINY_VOCAB), {"responses": shard},
                    DevSet(rt, rows[:4]), {"note": "tiny"})
    plan = HeadPlan("general", 1.0, 1e-2, (("responses", ALL, 1.0),), batch_rows=256,
                    warmup_steps=5, max_steps=60, eval_every_steps=30, patience=5, seed=1)
    dirs = {"general": tmp_path / "heads" / "general"}
    plans = {"general": plan}
    with pytest.raises(MemspecError, match="no weights to continue from"):
        continue_plans(plans, ["general"], dirs)
    first = train_one(data, SHAPE, plan, dirs)
    continue_plans(plans, ["general"], dirs)
    assert plans["general"].init_from == "general@previous"
    assert plans["general"].lr == pytest.approx(plan.lr * CONTINUE_LR)
    second = train_one(data, SHAPE, plans["general"], dirs)
    assert second["evals"][0]["dev"] == pytest.approx(first["best_dev"], abs=1e-9)
    assert second["best_dev"] >= first["best_dev"]
    assert second["continues"]["steps"] == 60 and second["continues"]["best_dev"] == \
        first["best_dev"]
    # each round warms up to half the last one's peak, and waits out its warm-up dip
    continue_plans(plans, ["general"], dirs)
    assert plans["general"].lr == pytest.approx(plan.lr * CONTINUE_LR ** 2)
    assert plans["general"].patience == max(plan.patience, CONTINUE_PATIENCE)
    (dirs["general"] / "training.json").write_text("{not json")
    with pytest.raises(MemspecError, match="no readable training rate"):
        continue_plans(plans, ["general"], dirs)
