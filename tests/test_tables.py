"""Acceptance tables and replay: exact against the real engine, and known answers by hand."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import TINY_VOCAB, make_tiny, save_model

from memspec.common.config import DraftSpec, PoolConfig
from memspec.common.errors import ConfigError
from memspec.common.metrics import gmean
from memspec.common.paths import default_target_dir
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.models import load_causal_lm
from memspec.procs.decoder.oracle.replay import (
    Replay,
    dynamic_scores,
    lookahead,
    oracle_dynamic,
    oracle_static,
    pooled,
    replay,
    replay_static,
)
from memspec.procs.decoder.slots import ID_MAP_KEY, BoundDraft, SlotBuffer, load_into_slot
from memspec.zoo.evaluate import (
    acceptance_report,
    evaluate,
    format_report,
    split_prompts,
    traces_path,
)
from memspec.zoo.tables import acceptance_table, capped_engine_accepts, table_from_correct

PROMPTS = [[1, 5, 9, 22], [1, 40, 41, 42, 43, 44, 45], [1, 7], [1, 80, 3, 3, 17, 60]]
DRAFTS = ["self", "random", "small"]
MAX_NEW = 40
STOP = 0.17  # a floor the tiny head's top probability straddles (its median)


@pytest.fixture(scope="module")
def bound(tiny_dir) -> dict[str, BoundDraft]:
    return {n: load_into_slot(n, tiny_dir / n, SlotBuffer(1 << 20), TINY_VOCAB) for n in DRAFTS}


@pytest.fixture(scope="module")
def target(tiny_dir) -> torch.nn.Module:
    return load_causal_lm(tiny_dir / "target")


def _engine(target, drafts: dict[str, BoundDraft], gamma: int, eos=()) -> SpecEngine:
    eng = SpecEngine(target, eos, gamma=gamma)
    for d in drafts.values():
        eng.add_draft(d)
    return eng


def _table(d: BoundDraft, prompt, tokens, gamma) -> list[int]:
    return acceptance_table(d.model, prompt, tokens, gamma, d.to_draft, d.to_target,
                            vocab=TINY_VOCAB)


def _engine_accepts(eng: SpecEngine, prompt, tokens, select) -> tuple[list[int], list[str]]:
    out, stats = eng.generate(prompt, MAX_NEW, select=select)
    assert out == tokens  # lossless: the trajectory is draft-independent
    recs = stats.records
    capped = capped_engine_accepts([r.accepted for r in recs], [r.emitted for r in recs],
                                   len(tokens))
    return capped, [r.draft for r in recs]


# --------------------------------------------------------------------------- vs the engine


@pytest.mark.parametrize("gamma", [3, 4])
def test_static_replay_equals_engine(target, bound, gamma):
    eng = _engine(target, bound, gamma)
    for prompt in PROMPTS:
        tokens, _ = eng.generate(prompt, MAX_NEW)
        for name, d in bound.items():
            table = _table(d, prompt, tokens, gamma)
            r = replay_static({name: table}, name, gamma)
            accepts, _ = _engine_accepts(eng, prompt, tokens, lambda s, n=name: n)
            assert r.accepted == accepts, (name, prompt)


def test_switching_schedule_replay_equals_engine(target, bound):
    """Per-draft KV caches and catch-up must not change what a draft proposes."""
    gamma = 3
    eng = _engine(target, bound, gamma)
    for prompt in PROMPTS:
        tokens, _ = eng.generate(prompt, MAX_NEW)
        tables = {n: _table(d, prompt, tokens, gamma) for n, d in bound.items()}
        order = itertools.cycle(["small", "self", "random", "random"])
        accepts, used = _engine_accepts(eng, prompt, tokens, lambda s, o=order: next(o))
        r = replay(tables, used, gamma)
        assert r.drafts == used
        assert r.accepted == accepts


def test_eos_inside_proposals_is_capped(target, bound):
    """A trajectory ending at EOS: the engine may accept past it, the table stops there."""
    gamma = 4
    plain = _engine(target, bound, gamma)
    full, _ = plain.generate(PROMPTS[0], MAX_NEW)
    eos = full[len(full) // 2]
    tokens = full[:full.index(eos) + 1]
    eng = _engine(target, bound, gamma, eos=(eos,))
    for name, d in bound.items():
        table = _table(d, PROMPTS[0], tokens, gamma)
        out, stats = eng.generate(PROMPTS[0], MAX_NEW, select=lambda s, n=name: n)
        assert out == tokens
        recs = stats.records
        capped = capped_engine_accepts([r.accepted for r in recs], [r.emitted for r in recs],
                                       len(tokens))
        assert replay_static({name: table}, name, gamma).accepted == capped


def test_self_draft_table_is_gamma_capped_at_end(target, bound):
    gamma = 4
    eng = _engine(target, bound, gamma)
    for prompt in PROMPTS:
        tokens, _ = eng.generate(prompt, MAX_NEW)
        table = _table(bound["self"], prompt, tokens, gamma)
        assert table == [min(gamma, len(tokens) - t) for t in range(len(tokens))]
        r = replay_static({"self": table}, "self", gamma)
        assert r.iterations == -(-len(tokens) // (gamma + 1))


def test_vocab_subset_draft_table(tiny_dir, target, tmp_path):
    """A draft over every other target id: inputs and argmax go through the id maps."""
    keep = torch.arange(0, TINY_VOCAB, 2)
    full = load_file(tiny_dir / "self" / "model.safetensors")
    sub = dict(full)
    sub["model.embed_tokens.weight"] = full["model.embed_tokens.weight"][keep].clone()
    sub[ID_MAP_KEY] = keep.to(torch.int64)
    d = save_model(make_tiny(0, vocab=len(keep)), tmp_path / "sub")
    save_file(sub, d / "model.safetensors", metadata={"format": "pt"})
    b = load_into_slot("sub", d, SlotBuffer(1 << 20), TINY_VOCAB)
    eng = _engine(target, {"sub": b}, 4)
    for prompt in PROMPTS:
        tokens, _ = eng.generate(prompt, MAX_NEW)
        table = _table(b, prompt, tokens, 4)
        accepts, _ = _engine_accepts(eng, prompt, tokens, lambda s: "sub")
        assert replay_static({"sub": table}, "sub", 4).accepted == accepts


def test_oracles_on_real_tables(target, bound):
    gamma = 4
    eng = _engine(target, bound, gamma)
    for prompt in PROMPTS:
        tokens, _ = eng.generate(prompt, MAX_NEW)
        tables = {n: _table(d, prompt, tokens, gamma) for n, d in bound.items()}
        name, best = oracle_static(tables, gamma)
        assert name == "self"
        for n in tables:
            assert best.iterations <= replay_static(tables, n, gamma).iterations
        assert oracle_dynamic({"random": tables["random"]}, gamma).accepted == \
            replay_static(tables, "random", gamma).accepted


# --------------------------------------------------------------------------- by hand


def test_table_from_correct_runs_and_caps():
    c = [True, True, True, False, True, True, True, True, True, True]
    assert table_from_correct(c, 4) == [3, 2, 1, 0, 4, 4, 4, 3, 2, 1]
    assert table_from_correct(c, 2) == [2, 2, 1, 0, 2, 2, 2, 2, 2, 1]
    assert table_from_correct([], 4) == []


def test_replay_known_answer():
    # positions: 0 -(a=2)-> 3 -(a=0)-> 4 -(a=4)-> 9 -(a=1, capped by the end)-> 10
    table = [2, 0, 0, 0, 4, 0, 0, 0, 0, 3]
    r = replay_static({"d": table}, "d", 4)
    assert r.positions == [0, 3, 4, 9]
    assert r.accepted == [2, 0, 4, 1]
    assert r.iterations == 4
    assert r.mean_acceptance_length == pytest.approx(1 + 7 / 4)
    assert r.acceptance_rate == pytest.approx(7 / 16)
    # gamma caps hand-made entries too
    assert replay_static({"d": [9] * 6}, "d", 2).accepted == [2, 2]


def test_replay_schedule_forms_and_errors():
    tables = {"a": [0] * 4, "b": [3, 3, 3, 3]}
    assert replay(tables, ["a", "b"], 3).accepted == [0, 3]
    assert replay(tables, lambda it, pos: "b", 3).accepted == [3]
    with pytest.raises(ValueError):
        replay(tables, ["a"], 3)
    with pytest.raises(ValueError):
        replay({"a": [0], "b": [0, 0]}, ["a"], 3)
    empty = replay({"a": []}, ["a"], 3)
    assert empty.iterations == 0 and empty.mean_acceptance_length == 1.0


def test_oracle_static_prefers_fewest_iterations():
    tables = {"general": [1] * 20, "code": [4] * 10 + [0] * 10, "math": [0] * 10 + [4] * 10}
    name, best = oracle_static(tables, 4)
    static = {n: replay_static(tables, n, 4).iterations for n in tables}
    assert static == {"general": 10, "code": 12, "math": 12}
    assert name == "general" and best.iterations == 10
    for n in tables:
        assert best.iterations <= static[n]


def test_oracle_dynamic_switches_between_phases():
    # first half only "code" predicts, second half only "math": switching wins
    tables = {"general": [1] * 40, "code": [4] * 20 + [0] * 20, "math": [0] * 20 + [4] * 20}
    _, st = oracle_static(tables, 4)
    dyn = oracle_dynamic(tables, 4, interval=4)
    assert dyn.drafts[:4] == ["code"] * 4
    assert "math" in dyn.drafts
    assert dyn.iterations < st.iterations
    assert dyn.mean_acceptance_length > st.mean_acceptance_length


def test_oracle_dynamic_single_draft_and_interval_edges():
    table = [3, 0, 1, 2, 4, 4, 0, 0, 1, 2, 3, 4, 0]
    for interval in (1, 2, 4, 100):
        assert oracle_dynamic({"d": table}, 4, interval).accepted == \
            replay_static({"d": table}, "d", 4).accepted
    with pytest.raises(ValueError):
        oracle_dynamic({"d": table}, 4, interval=0)


def test_oracle_dynamic_is_greedy_not_optimal():
    """Per-interval greed can lose to a static draft; what holds is per-interval best reach."""
    tables = {"a": [3, 0, 0, 0, 4, 0, 0, 0, 0], "b": [4, 0, 0, 0, 0, 0, 0, 0, 0]}
    _, st = oracle_static(tables, 4)
    dyn = oracle_dynamic(tables, 4, interval=1)
    assert st.drafts == ["a", "a"]
    assert dyn.drafts[0] == "b" and dyn.iterations == 5 > st.iterations
    assert oracle_dynamic(tables, 4, interval=2).iterations == 2  # longer look-ahead sees it
    for interval in (1, 2, 3):
        dyn = oracle_dynamic(tables, 4, interval)
        for s in range(0, dyn.iterations, interval):
            end = dyn.positions[s + interval] if s + interval < dyn.iterations else 9
            best = max(lookahead(t, dyn.positions[s], 4, interval)[0] for t in tables.values())
            assert end == best


def test_dynamic_scores_ties_keep_what_is_there():
    tables = {"a": [2] * 12, "b": [2] * 12, "c": [2] * 12}

    def best(**kw):
        scores = dynamic_scores(tables, 0, 4, 4, **kw)
        return max(scores, key=lambda d: scores[d])

    assert best() == "a"  # pool order
    assert best(resident={"c"}) == "c" and best(active="b", resident={"c"}) == "b"
    # the next intervals break a tie within this one
    s = dynamic_scores({"a": [1] * 8 + [0] * 16, "b": [1] * 24}, 0, 4, 2)
    assert s["b"] > s["a"] and int(s["a"]) == int(s["b"]) == 4


def test_pooled_and_gmean():
    a = Replay(4, 10, ["d"] * 2, [0, 5], [4, 4])
    b = Replay(4, 4, ["d"] * 2, [0, 1], [0, 2])
    p = pooled([a, b])
    assert p["iterations"] == 4 and p["accepted"] == 10
    assert p["mean_acceptance_length"] == pytest.approx(1 + 10 / 4)
    assert p["acceptance_rate"] == pytest.approx(10 / 16)
    assert gmean([1.0, 4.0]) == pytest.approx(2.0)


def test_capped_engine_accepts():
    # 10 tokens; last iteration accepts 4 past a remaining length of 3
    assert capped_engine_accepts([2, 4, 4], [3, 5, 2], 10) == [2, 4, 2]


# --------------------------------------------------------------------------- zoo eval pieces


def test_acceptance_report_by_hand():
    trajs = [{"domain": "general", "tokens": [0] * 10}, {"domain": "code", "tokens": [0] * 10},
             {"domain": "code", "tokens": []}]
    tables = {"general": [[4] * 10, [0] * 10, []], "code": [[0] * 10, [4] * 10, []]}
    r = acceptance_report(tables, trajs, "general", ["general", "code"], 4, 4)
    assert r["mean_acceptance_length"]["general"] == {"general": 1 + 8 / 2, "code": 1.0}
    assert r["acceptance_rate"]["code"]["code"] == pytest.approx(8 / 8)
    assert r["oracle_static_choice"] == {"general": {"general": 1}, "code": {"code": 1}}
    assert r["oracle_static_over_general"]["code"] == pytest.approx(5.0)
    assert r["oracle_static_over_general"]["gmean"] == pytest.approx(5.0 ** 0.5)
    assert r["oracle_dynamic_over_oracle_static"]["gmean"] == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_evaluate_on_tiny_pool(tiny_dir, tmp_path, dtype):
    """The whole report minus trajectory building, on tiny models (draft models and a
    head, through the engine's runners): keys, exactness, costs."""
    from tinymodels import make_tiny_head

    from memspec.procs.decoder.models import build_target

    head = make_tiny_head(tmp_path / "head", seed=4)
    drafts = (DraftSpec("self", "general", tiny_dir / "self"),
              DraftSpec("random", "code", tiny_dir / "random"),
              DraftSpec("small", "law", tiny_dir / "small"),
              DraftSpec("head", "law", head, kind="head"))
    pool = PoolConfig(target=tiny_dir / "target", drafts=drafts, general="self", gamma=4, N=4)
    eng = SpecEngine(build_target(tiny_dir / "target", dtype), (), gamma=4)
    trajs = []
    for i, prompt in enumerate(PROMPTS + [[1, 11, 12], [1, 90, 2]]):
        tokens, _ = eng.generate(prompt, 24)
        trajs.append({"id": f"p{i}", "domain": ["general", "code", "law"][i % 3],
                      "prompt_ids": prompt, "tokens": tokens})
    r = evaluate(pool, eng, trajs, check_per_domain=1)
    assert r["drafts"] == ["self", "random", "small", "head"]
    assert r["draft_kinds"]["head"] == "head" and r["draft_kinds"]["small"] == "model"
    assert r["domains"] == ["general", "code", "law"]
    if dtype == "float32":  # the target drafting for itself (other dtypes: its fp32 copy)
        assert all(r["mean_acceptance_length"]["self"][d] == 5.0 for d in r["domains"])
        assert r["oracle_static_over_general"]["gmean"] == pytest.approx(1.0)
    check = r["table_vs_engine"]
    assert check["prompts"] == 3 and check["iterations_compared"] > 0
    assert check["mismatching_iterations"] == 0 and check["trajectory_divergences"] == 0
    assert set(r["draft_load_s"]) == set(r["load_over_iteration"]) == {"self", "random",
                                                                        "small", "head"}
    assert r["sd_iteration_s"] > 0
    r["prompts_per_domain"] = 2
    text = format_report(r)
    assert "oracle-dynamic" in text and "load" in text
    json.dumps(r)


def test_split_prompts_and_traces_path(monkeypatch, tmp_path):
    rows = split_prompts("dev", ["math", "general"], 3)
    assert [r["domain"] for r in rows] == ["math"] * 3 + ["general"] * 3
    assert all(r["split"] == "dev" for r in rows)
    assert len(split_prompts("mixed", ["general"], 4)) == 4  # mixed ignores the domains
    with pytest.raises(ConfigError, match="nosuchdomain"):
        split_prompts("dev2", ["nosuchdomain"], 1)
    with pytest.raises(ConfigError, match="evaluation split"):
        split_prompts("train", ["general"], 1)
    with pytest.raises(ConfigError, match="evaluation split"):
        split_prompts("test2", ["general"], 1)  # read once, by a headline bench only
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path))
    pool = PoolConfig(target=default_target_dir(), drafts=())
    assert traces_path(pool, "dev") == tmp_path / "traces" / "dev.jsonl"
    other = PoolConfig(target=tmp_path / "other-target", drafts=())
    assert traces_path(other, "dev2").name == "dev2-other-target.jsonl"


# --------------------------------------------------------------------------- runtime tables


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    from tinymodels import make_tiny_head

    return make_tiny_head(tmp_path_factory.mktemp("rt-head") / "h", seed=3)


@pytest.mark.parametrize(("dtype", "lookup", "stop", "first"),
                         [("int4", 0, 0.0, 0.0), ("bfloat16", 0, 0.0, 0.0),
                          ("int8-torch", 0, 0.0, 0.0), ("int4", 1, 0.0, 0.0),
                          ("int8-torch", 3, 0.0, 0.0), ("int4", 0, STOP, 0.0),
                          ("int4", 1, STOP, 0.0), ("int4", 0, 0.0, STOP),
                          ("int4", 1, STOP, STOP)])
def test_runtime_tables_replay_the_engine_exactly(tiny_dir, tiny_head, dtype, lookup, stop,
                                                  first, knobs):
    """Tables from the engine's own runners (model drafts and heads) replay every
    iteration's accepted count of real runs, static and switching schedules alike, with
    the context lookup off and on, and with heads that stop proposing where unsure
    (head.STOP) or propose nothing (head.FIRST: the iteration is a target step)."""
    from memspec.procs.decoder.models import build_target
    from memspec.zoo.tables import runtime_table

    knobs({"head.STOP": stop, "head.FIRST": first})
    fmt, _, path = dtype.partition("-")
    gamma = 3
    eng = SpecEngine(build_target(tiny_dir / "target", fmt, fast=path != "torch"), (),
                     gamma=gamma, lookup=lookup)
    eng.lookup_first = 0  # a table is a draft's own iterations (LOOKUP_FIRST: test_engine)
    for n in DRAFTS:
        eng.add_draft(load_into_slot(n, tiny_dir / n, SlotBuffer(1 << 20), TINY_VOCAB))
    eng.add_draft(load_into_slot("head", tiny_head, SlotBuffer(1 << 20), TINY_VOCAB,
                                 eng.target_parts))
    names = [*DRAFTS, "head"]
    stopped: set[int] = set()  # a head's proposal counts below gamma
    for prompt in PROMPTS:
        tokens, _ = eng.generate(prompt, MAX_NEW)
        tables = {n: runtime_table(eng, eng.drafts[n], prompt, tokens) for n in names}
        assert any(tables["self"])
        for name in names:
            accepts, _ = _engine_accepts(eng, prompt, tokens, lambda s, n=name: n)
            assert replay_static({name: tables[name]}, name, gamma).accepted == accepts, name
        order = itertools.cycle(["head", "small", "head", None, "self", "random"])
        out, stats = eng.generate(prompt, MAX_NEW, select=lambda s, o=order: next(o))
        assert out == tokens
        recs = [r for r in stats.records if r.draft]
        pos = 0
        for r in stats.records:
            if r.draft:
                want = min(tables[r.draft][pos], len(tokens) - pos)
                assert min(r.accepted, len(tokens) - pos) == want, (r.draft, pos)
            pos += r.emitted
        assert {r.draft for r in recs} == set(names)
        head_props = {r.proposed for r in recs if r.draft == "head"}
        stopped |= head_props - {gamma}
    assert bool(stopped - {0}) == bool(stop)  # an unsure head proposed fewer than gamma
    assert (0 in stopped) == bool(first)  # ... or, unsure of its first, nothing


@pytest.mark.parametrize(("name", "value"),
                         [("head.STOP", STOP), ("head.FIRST", STOP), ("head.VOCAB", 4096)])
def test_tables_made_with_other_head_knobs_are_stale(tmp_path, knobs, name, value):
    """Where a head stops proposing (``head.STOP``), where it proposes nothing
    (``head.FIRST``) and how many rows it scores (``head.VOCAB``) change its accepted
    counts: tables written under one setting are re-made under another, never replayed."""
    from memspec.common.tuned import knob
    from memspec.procs.decoder.oracle.tablefiles import TraceTables, read_tables, write_tables

    assert knob(name) != value  # (the committed setting is another)
    fp = {"general": "a" * 64}
    tt = TraceTables(4, ["general"], fp, {"x": {"domain": "general",
                                                "tables": {"general": [1, 0]}}}, "int4")
    path = tmp_path / "tables-dev.json"
    write_tables(path, tt)
    assert read_tables(path, 4, fp, "int4") is not None
    knobs({name: value})
    assert read_tables(path, 4, fp, "int4") is None
    write_tables(path, tt)
    assert read_tables(path, 4, fp, "int4") is not None


def test_a_head_stops_only_where_rows_cost():
    """On a GPU a verify's extra rows are free: a head there always proposes gamma (its
    tables likewise), whatever ``head.STOP`` says for CPUs."""
    from memspec.common.tuned import knob
    from memspec.procs.decoder.drafts.head import first_floor, stop_floor, unsure

    assert stop_floor("cuda") == first_floor("cuda") == 0.0
    assert stop_floor("cpu") == float(knob("head.STOP") or 0.0)
    assert first_floor("cpu") == float(knob("head.FIRST") or 0.0)
    row = torch.tensor([2.0, 0.0, 0.0, 0.0])  # top probability 0.71
    assert unsure(row, 0.8) and not unsure(row, 0.7) and not unsure(row, 0.0)
