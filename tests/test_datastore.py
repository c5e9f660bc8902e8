"""Datastore drafts: the tables, their lookups, binding from a slot, the engine's use of them
(output identical to target-only greedy) and the gate pricing them as model-free."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from exactruns import exact_and_full
from safetensors.torch import save_file
from tinymodels import TINY_VOCAB

from memspec.common.config import (
    ConfigError,
    check_kind,
    folder_kind,
    load_pool,
    tokenizer_fingerprint,
)
from memspec.common.errors import ModelError
from memspec.common.manifest import write_manifest
from memspec.procs.decoder.drafts.datastore import (
    DATASTORE_KIND,
    SEP,
    Datastore,
    StoreParams,
    build_tables,
    next_labels,
    stream,
    tail_key,
)
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.models import build_target
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.procs.decoder.sched.gate import GateCosts, SpecGate
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot
from memspec.zoo.stores import store_walk

DOCS = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8], [1, 2, 3, 5], [7, 1, 2, 3, 4]]


def test_the_longest_seen_context_proposes_its_most_frequent_continuation():
    store = Datastore(build_tables(stream(DOCS), 1, 4, min_count=1), StoreParams(1, 0.0))
    assert store.propose([1, 2, 3]) == 4  # 3 of 4
    assert store.propose([9, 1, 2, 3]) == 4  # an unseen longer context backs off
    assert store.propose([2, 3, 4]) in (9, 8)  # a tie: either, deterministically
    assert store.propose([42]) is None
    assert store.propose([4, 9]) is None  # documents do not run into each other (SEP)


def test_an_unsure_longest_match_proposes_nothing_rather_than_a_shorter_one():
    tables = build_tables(stream(DOCS), 1, 4, min_count=1)
    assert Datastore(tables, StoreParams(1, 0.7)).propose([1, 2, 3]) == 4  # 0.75 >= 0.7
    assert Datastore(tables, StoreParams(1, 0.8)).propose([1, 2, 3]) is None
    assert Datastore(tables, StoreParams(4, 0.0)).propose([1, 2, 3]) is None  # seen 3 times
    # contexts whose best continuation is rarer than min_count are not even stored
    pruned = build_tables(stream(DOCS), 1, 4, min_count=2)
    assert pruned["keys.4"].size < tables["keys.4"].size
    assert Datastore(pruned, StoreParams(2, 0.0)).propose([1, 2, 3]) == 4


def test_tables_are_checked_before_use():
    tables = build_tables(stream(DOCS), 1, 3, min_count=1)
    with pytest.raises(ValueError):
        Datastore({k: v for k, v in tables.items() if not k.endswith(".2")})
    with pytest.raises(ValueError):
        Datastore({**tables, "next.1": tables["next.1"][:-1]})
    assert stream([]).size == 0 and SEP < 0


def test_labels_replace_what_follows_a_context():
    """Teacher-forced labels (the target's next token after a corpus prefix) stand where the
    stream's own next token would; the stream's labels give the tables it gives alone."""
    toks = stream(DOCS)
    plain = build_tables(toks, 1, 3, min_count=1)
    same = build_tables(toks, 1, 3, min_count=1, labels=next_labels(toks))
    assert all(np.array_equal(plain[k], same[k]) for k in plain)
    labels = next_labels(toks)
    labels[labels == 4] = 6  # the target would have said 6 wherever the text said 4
    store = Datastore(build_tables(toks, 1, 4, min_count=1, labels=labels), StoreParams(1, 0.0))
    assert store.propose([1, 2, 3]) == 6
    assert store.propose([7]) == 1  # other contexts keep what followed them
    unlabelled = labels.copy()
    unlabelled[:] = SEP
    assert build_tables(toks, 1, 2, min_count=1, labels=unlabelled)["keys.1"].size == 0
    with pytest.raises(ValueError):
        build_tables(toks, 1, 2, labels=labels[:-1])


def _store_folder(path, docs, target_dir=None):
    store = Datastore(build_tables(stream(docs), 1, 4, min_count=1), StoreParams(1, 0.0))
    path.mkdir(parents=True)
    save_file({k: torch.from_numpy(v) for k, v in store.tables().items()},
              str(path / "model.safetensors"))
    cfg = {"memspec_kind": DATASTORE_KIND, "n_min": 1, "n_max": 4, "min_count": 1,
           "min_conf": 0.0}
    if target_dir is not None:
        cfg["memspec_tokenizer_sha256"] = tokenizer_fingerprint(target_dir)
    (path / "config.json").write_text(json.dumps(cfg))
    write_manifest(path)
    return store


def test_a_store_binds_from_a_slot_as_views_and_proposes_the_same(tmp_path):
    store = _store_folder(tmp_path / "s", DOCS)
    bound = load_into_slot("s", tmp_path / "s", SlotBuffer(1 << 16), TINY_VOCAB)
    assert bound.kind == DATASTORE_KIND
    for tail in ([1, 2, 3], [2, 3, 4], [7, 1], [5]):
        assert bound.runner.store.propose(tail) == store.propose(tail)
    assert folder_kind(tmp_path / "s") == DATASTORE_KIND
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"memspec_kind": DATASTORE_KIND}))
    save_file({"keys.1": torch.zeros(3, dtype=torch.long), "next.1": torch.zeros(2,
              dtype=torch.int32), "count.1": torch.zeros(3, dtype=torch.int32),
               "total.1": torch.zeros(3, dtype=torch.int32)}, str(bad / "model.safetensors"))
    with pytest.raises(ModelError, match="datastore 'bad'"):
        load_into_slot("bad", bad, SlotBuffer(1 << 16), TINY_VOCAB)


def _greedy(target, prompt, n):
    eng = SpecEngine(target, (), gamma=4)
    return eng.generate(prompt, n)[0]


@pytest.mark.parametrize("lookup", [0, 2])
def test_engine_output_is_target_only_greedy_with_a_good_and_a_wrong_store(tiny_dir, tmp_path,
                                                                           lookup):
    """A store built from the target's own output is accepted (it really proposes); one that
    proposes only wrong tokens is rejected every time; the output is the same either way."""
    target = build_target(tiny_dir / "target", "float32")
    prompts = [[1, 5, 9, 22], [1, 40, 41, 42, 43, 44, 45]]
    refs = [_greedy(target, p, 40) for p in prompts]
    _store_folder(tmp_path / "good", [p + r for p, r in zip(prompts, refs, strict=True)])
    rng = np.random.default_rng(0)
    wrong = [[int(t) for t in rng.integers(3, TINY_VOCAB, 60)] for _ in range(40)]
    wrong = [[t if t not in r else 2 for t in w] for w, r in zip(wrong, refs * 20, strict=False)]
    _store_folder(tmp_path / "wrong", wrong)
    eng = SpecEngine(target, (), gamma=4, lookup=lookup)
    for name in ("good", "wrong"):
        eng.add_draft(load_into_slot(name, tmp_path / name, SlotBuffer(1 << 20), TINY_VOCAB))
    for prompt, ref in zip(prompts, refs, strict=True):
        out, stats = eng.generate(prompt, 40, select=lambda s: "good")
        assert out == ref
        assert sum(r.accepted for r in stats.records) > 20  # it speculated, and it paid
        assert all(r.draft == "good" for r in stats.records)
        out, stats = eng.generate(prompt, 40, select=lambda s: "wrong")
        assert out == ref
        if lookup == 0:
            assert sum(r.accepted for r in stats.records) == 0
            # with no lookup, every proposal is the store's own
            assert all(r.store_led == (r.proposed > 0) for r in stats.records)
        walk = store_walk(prompt, ref, eng.drafts["good"].runner.store, 4, lookup)
        _, stats = eng.generate(prompt, 40, select=lambda s: "good")
        assert [(r.proposed, r.accepted) for r in stats.records] == walk  # the replay is
        # the engine's walk, row for row (the dev figures of `memspec zoo stores`)


def test_sampling_runs_a_store_as_plain_target_steps(tiny_dir, tmp_path):
    from memspec.procs.decoder.sched.acceptance import SamplingParams

    target = build_target(tiny_dir / "target", "float32")
    _store_folder(tmp_path / "s", DOCS)
    eng = SpecEngine(target, (), gamma=4)
    eng.add_draft(load_into_slot("s", tmp_path / "s", SlotBuffer(1 << 16), TINY_VOCAB))
    params = SamplingParams(temperature=0.8, seed=3)
    a, stats = eng.generate([1, 2, 3], 20, params, select=lambda s: "s")
    b, _ = eng.generate([1, 2, 3], 20, params)
    assert a == b and all(r.proposed == 0 for r in stats.records)


def test_the_gate_prices_a_store_as_the_verify_alone():
    costs = GateCosts(target=(0.004, 0.0), verify=(0.007, 0.0), draft_prior_s=0.003,
                      free=frozenset({"code"}))
    assert costs.spec_line("code") == costs.spec_line(LOOKUP) == (0.007, 0.0)
    assert costs.spec_line("head") == (0.010, 0.0)
    gate = SpecGate(costs)
    from memspec.common.metrics import IterationRecord

    gate.observe(IterationRecord("code", 0, 0, 1, 0.0, t_verify=0.004, context=10))
    assert "code" not in gate.tau  # proposing nothing was a target step, not a failed draft


def test_a_pool_of_stores_loads_and_a_wrong_kind_is_one_line(tmp_path, tiny_dir):
    _store_folder(tmp_path / "s", DOCS, target_dir=tiny_dir / "target")
    pool_file = tmp_path / "pool.toml"
    pool_file.write_text(f"""[pool]
target = "{tiny_dir / 'target'}"
general = "s"
[[drafts]]
name = "s"
path = "{tmp_path / 's'}"
kind = "datastore"
""")
    pool = load_pool(pool_file)
    assert pool.drafts[0].kind == DATASTORE_KIND
    check_kind(pool.drafts[0])
    wrong = pool.drafts[0].__class__(**{**pool.drafts[0].__dict__, "kind": "head"})
    with pytest.raises(ConfigError, match='set kind = "datastore"'):
        check_kind(wrong)


def _store_engine(tiny_dir, tmp_path):
    """A float32 engine with store "s" that knows 25 tokens of the prompt's greedy answer
    (and one unrelated run), the prompt and that answer (40 tokens)."""
    target = build_target(tiny_dir / "target", "float32")
    prompt = [1, 5, 9, 22]
    ref = _greedy(target, prompt, 40)
    _store_folder(tmp_path / "s", [prompt + ref[:25], [3, 4, 5, 6]])
    eng = SpecEngine(target, (), gamma=4, lookup=2)
    eng.add_draft(load_into_slot("s", tmp_path / "s", SlotBuffer(1 << 16), TINY_VOCAB))
    return eng, prompt, ref


def test_the_trace_table_of_a_store_replays_the_engine(tiny_dir, tmp_path):
    """A_d(t) from zoo/tables.py (what traces, oracles and the predictor's labels read) gives
    the accepted count of every iteration the engine runs with the store."""
    from memspec.zoo.tables import runtime_table

    eng, prompt, ref = _store_engine(tiny_dir, tmp_path)
    table = runtime_table(eng, eng.drafts["s"], prompt, ref)
    _, stats = eng.generate(prompt, 40, select=lambda s: "s")
    t = 0
    for rec in stats.records:
        assert rec.accepted == min(table[t], 40 - t - 1) or t + rec.emitted == 40
        t += rec.emitted
    assert any(table) and not all(table)


def test_a_store_told_its_table_proposes_only_what_the_target_accepts(tiny_dir, tmp_path):
    """oracle-dynamic's exact proposals (`Session.propose`) for a datastore: it follows the
    same chain, so it proposes a prefix of it, every proposal is accepted, a position where
    it would be rejected is a plain step, and the output is the target's own."""
    from memspec.zoo.tables import runtime_table

    eng, prompt, ref = _store_engine(tiny_dir, tmp_path)
    (out, stats), (full, fstats) = exact_and_full(
        eng, prompt, 40, "s", runtime_table(eng, eng.drafts["s"], prompt, ref))
    assert out == ref == full
    assert all(r.accepted == r.proposed for r in stats.records)
    assert [r.emitted for r in stats.records] == [r.emitted for r in fstats.records]
    assert sum(r.proposed for r in stats.records) < sum(r.proposed for r in fstats.records)


def test_two_pools_on_one_target_keep_their_own_tables(tmp_path, tiny_dir, monkeypatch):
    """Tracing a second pool (datastores, small models) on the default pool's target must not
    overwrite the default pool's tables, nor show up among its traced sets."""
    from memspec.common.config import load_pool as load
    from memspec.procs.decoder.oracle import tablefiles

    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "home"))
    pools = []
    for name in ("a", "b"):
        _store_folder(tmp_path / name, DOCS, target_dir=tiny_dir / "target")
        f = tmp_path / f"{name}.toml"
        f.write_text(f'[pool]\ntarget = "{tiny_dir / "target"}"\ngeneral = "{name}"\n'
                     f'[[drafts]]\nname = "{name}"\npath = "{tmp_path / name}"\n'
                     'kind = "datastore"\n')
        pools.append(load(f))
    paths = [tablefiles.tables_path(p, "dev", "int4-x") for p in pools]
    assert paths[0] != paths[1] and all("@" in p.name for p in paths)
    paths[0].parent.mkdir(parents=True)
    paths[0].write_text("{}")
    tablefiles.tables_path(pools[1], "dev-L256", "int4-x").write_text("{}")
    assert tablefiles.traced_sets(pools[0], "int4-x") == ["dev"]
    assert tablefiles.traced_sets(pools[1], "int4-x") == ["dev-L256"]


def test_a_chain_says_whether_the_store_led_it():
    """The gate weighs a store against the lookup alone by the iterations its own token
    led: the lookup's token goes first where the context repeats."""
    from memspec.procs.decoder.drafts.datastore import led_chain
    from memspec.procs.decoder.drafts.lookup import NgramIndex

    store = Datastore(build_tables(stream(DOCS), 1, 3, 1))
    idx = NgramIndex(2, [7, 8, 9, 5, 7, 8])  # "7 8" was followed by 9
    props, led = led_chain(idx, store, [7, 8], 4)
    assert props[0] == 9 and not led
    props, led = led_chain(idx, store, [1, 2], 4)
    assert props and props[0] == store.propose([1, 2]) and led
    assert led_chain(None, None, [1, 2], 4) == ([], False)


def test_teacher_forced_windows_store_the_targets_labels():
    """zoo stores --sources: corpus windows with the target's argmax after each prefix become
    a store that proposes the target's token, never across a window's end."""
    from memspec.zoo.store_sources import window_parts

    x = np.array([[1, 2, 3], [7, 1, 2]])
    y = np.array([[5, 6, 4], [1, 5, 6]])  # the target's next token after each prefix
    toks, labels = window_parts(x, y)
    tables = build_tables(toks, 1, 2, min_count=1, labels=labels)
    store = Datastore(tables, StoreParams(1, 0.0))
    assert store.propose([1, 2]) == 6 and store.propose([7]) == 1
    assert store.propose([3]) == 4  # the label of a window's last position is kept ...
    assert tail_key([3, 7], 2) not in set(tables["keys.2"].tolist())  # ... no context spans two


def test_zoo_stores_builds_the_named_pools_own_stores(tmp_path):
    """`memspec zoo stores --pool P` builds P's datastore drafts at their paths (a brought
    target's pool, say), its dev.json beside them; a pool without one is one line."""
    from memspec.common.errors import ConfigError
    from memspec.common.paths import default_target_dir
    from memspec.zoo.stores import store_folders

    pool = tmp_path / "p.toml"
    pool.write_text(f'[pool]\ntarget = "{default_target_dir()}"\ngeneral = "g"\n'
                    '[[drafts]]\nname = "g"\ndomain = "general"\npath = "s/general"\n'
                    'kind = "datastore"\n[[drafts]]\nname = "c"\ndomain = "code"\n'
                    'path = "s/code"\nkind = "datastore"\n')
    _, folders, root = store_folders(str(pool))
    assert folders == {"general": tmp_path / "s" / "general", "code": tmp_path / "s" / "code"}
    assert root == tmp_path / "s"
    heads = tmp_path / "h.toml"
    heads.write_text(f'[pool]\ntarget = "{default_target_dir()}"\n')
    with pytest.raises(ConfigError) as e:
        store_folders(str(heads))
    assert "no datastore drafts" in str(e.value) and "\n" not in str(e.value)


def test_a_brought_targets_training_caches_are_its_own(tmp_path):
    """Responses, features and draft vocabularies cached for training are the target's own:
    a brought target (zoo stores / zoo drafts --pool) never reads the demo's (they kept a
    dtype-only name, so a requantised or another model's build reused the demo's rows)."""
    from memspec.common.paths import default_target_dir
    from memspec.zoo.engine_trajectories import responses_tag
    from memspec.zoo.heads_data import RuntimeTarget

    assert responses_tag(default_target_dir(), "int4") == "int4"  # the demo's, as before
    other = tmp_path / "Qwen2.5-0.5B.Q4_K_M-0123"
    assert responses_tag(other, "int4") == "int4-Qwen2.5-0.5B.Q4_K_M-0123"
    demo = RuntimeTarget(None, "int4", (3, 29))
    brought = RuntimeTarget(None, "int4", (3, 29), other.name)
    assert demo.tag == "int4-L3-29" and brought.tag == "int4-L3-29-" + other.name
