"""Lossless speculative decoding: greedy output must equal target-only greedy, token for token."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from exactruns import exact_and_full
from safetensors.torch import load_file, save_file
from tinymodels import TINY_VOCAB, make_tiny, make_tiny_head, save_model

from memspec.common.errors import RequestError
from memspec.procs.decoder import engine as engine_module
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.models import build_target, load_causal_lm
from memspec.procs.decoder.slots import ID_MAP_KEY, SlotBuffer, load_into_slot

PROMPTS = [[1, 5, 9, 22], [1, 40, 41, 42, 43, 44, 45], [1, 7]]
# float32: the eager HF path; the others: the lean forward over static caches, as the C++
# forward ("fast", on CPUs) and as plain PyTorch
DTYPES = ["float32", "bfloat16", "int8", "int4", "bfloat16-torch", "int8-torch", "int4-torch"]


def engine_with(tiny_dir, names, gamma=4, eos=(), dtype="float32", lookup=0, home=None):
    """`dtype` "int4-prepared" (with `home`): the target as the decoder opens it, its
    packed blocks read from a prepared cache (built by a first open, read by a second)."""
    fmt, _, path = dtype.partition("-")
    prepared = home if path == "prepared" else None
    if prepared is not None:
        build_target(tiny_dir / "target", fmt, prepared=prepared)
    target = build_target(tiny_dir / "target", fmt, fast=path != "torch", prepared=prepared)
    eng = SpecEngine(target, eos, gamma=gamma, lookup=lookup)
    for name in names:
        eng.add_draft(load_into_slot(name, tiny_dir / name, SlotBuffer(1 << 20), TINY_VOCAB))
    return eng


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("draft", ["self", "random", "small"])
def test_greedy_identical_to_target_only(tiny_dir, draft, dtype):
    eng = engine_with(tiny_dir, [draft], dtype=dtype)
    hf = load_causal_lm(tiny_dir / "target")
    for prompt in PROMPTS:
        ref, ref_stats = eng.generate(prompt, 40)
        out, stats = eng.generate(prompt, 40, select=lambda s: draft)
        assert out == ref
        if dtype == "float32":
            assert ref == hf_greedy(hf, prompt, 40)
        summary = stats.summary()
        assert summary["num_drafts"] == len(stats.records)
        assert ref_stats.summary()["num_drafts"] == 0
        if draft == "self" and dtype == "float32":  # the target drafting for itself
            assert summary["acceptance_rate"] == 1.0
            assert summary["mean_acceptance_length"] == 5.0


@pytest.mark.parametrize("dtype", ["float32", "int4", "int8-torch"])
def test_context_lookup_keeps_output_identical_and_lifts_a_bad_draft(tiny_dir, tiny_heads,
                                                                     dtype):
    """With the lookup on, proposals come from the context where it repeats itself; output
    stays the target's greedy output for model drafts and heads, and what a draft gets
    accepted changes (the lookup is really consulted)."""
    eng = engine_with(tiny_dir, ["random", "small"], dtype=dtype, lookup=1)
    plain = engine_with(tiny_dir, ["random"], dtype=dtype)
    if dtype != "float32":
        eng.add_draft(load_into_slot("h", tiny_heads[0], SlotBuffer(1 << 20), TINY_VOCAB,
                                     eng.target_parts))
    moved = []
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 60)
        for name in eng.drafts:
            out, stats = eng.generate(prompt, 60, select=lambda s, n=name: n)
            assert out == ref, name
        order = itertools.cycle([*eng.drafts, None])
        out, _ = eng.generate(prompt, 60, select=lambda s, o=order: next(o))
        assert out == ref
        _, on = eng.generate(prompt, 60, select=lambda s: "random")
        _, off = plain.generate(prompt, 60, select=lambda s: "random")
        moved.append([r.accepted for r in on.records] != [r.accepted for r in off.records])
    assert any(moved)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_lookup_first_hands_repeating_iterations_to_the_lookup(tiny_dir, tiny_heads, dtype):
    """LOOKUP_FIRST: an iteration of a model draft or a head whose context ends with a
    suffix of at least that many tokens seen before is the lookup's alone (recorded as
    the lookup's); every other iteration is the draft's, which catches up on what it
    skipped, booked as its catch-up (not as its draft time, which the gate prices it by).
    Output stays the target's greedy output; 0 turns it off."""
    from memspec.procs.decoder.drafts.lookup import NgramIndex
    from memspec.procs.decoder.sched.costs import LOOKUP

    eng = engine_with(tiny_dir, ["small", "random"], dtype=dtype, lookup=1)
    if dtype != "float32":
        eng.add_draft(load_into_slot("h", tiny_heads[0], SlotBuffer(1 << 20), TINY_VOCAB,
                                     eng.target_parts))
    prompts = [*PROMPTS, [1, 5, 9, 22, 31, 5, 9, 22, 31, 5, 9]]
    routed = {True: 0, False: 0}
    for first, name, prompt in itertools.product((0, 2), eng.drafts, prompts):
        eng.lookup_first = first
        ref, _ = eng.generate(prompt, 60)
        out, stats = eng.generate(prompt, 60, select=lambda s, n=name: n)
        assert out == ref, (first, name)
        seq = prompt + out
        for r in stats.records:
            idx = NgramIndex(1, seq[:r.context])
            looked = bool(first) and idx.match(seq[max(0, r.context - idx.n_max):r.context]) >= first
            assert (r.draft == LOOKUP) == looked, (first, name, r.context)
            if first:
                routed[looked] += 1
        for prev, r in zip(stats.records, stats.records[1:]):
            if prev.draft == LOOKUP and r.draft == name:  # resumed after the lookup ran
                assert r.catchup_tokens > 0 and r.t_catchup > 0, (first, name, r.context)
    assert routed[True] and routed[False]


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_a_verify_row_is_bitwise_the_step_of_that_token(tiny_dir, fmt):
    """The PyTorch forward (the fallback where the C++ one is not built, and eager GPU
    runs): each row of a verify gives the very logits a step of that token alone gives, on
    the target's own greedy text. (A verify once attended with all its rows at once, and a
    bf16 target's speculative output left its greedy output 75 tokens in.)"""
    target = build_target(tiny_dir / "target", fmt, fast=False)
    eng = SpecEngine(target, (), gamma=4)
    ref, _ = eng.generate(PROMPTS[1], 90)
    ids = torch.tensor(PROMPTS[1] + ref)
    for ctx in range(36, 90, 3):
        one, many = target.new_cache(eng.max_len), target.new_cache(eng.max_len)
        target.forward(ids[:ctx], 0, one)
        target.forward(ids[:ctx], 0, many)
        verify = target.forward(ids[ctx:ctx + 5], ctx, many)
        for j in range(5):
            step = target.forward(ids[ctx + j:ctx + j + 1], ctx + j, one)
            assert torch.equal(step[0], verify[j]), (ctx, j)


@pytest.mark.parametrize("kind", ["int4", "bfloat16-torch"])
def test_a_head_proposes_looked_up_tokens_outside_its_vocabulary(tiny_dir, tmp_path, kind):
    """A head reads target ids, so where the context repeats it proposes the looked-up token
    even when its own (output) vocabulary lacks it: with a head of 8 tokens out of 96, some
    accepted proposals lie outside those 8, and output stays the target's greedy output."""
    head = make_tiny_head(tmp_path / "h8", seed=5, vocab=8)
    eng = engine_with(tiny_dir, [], dtype=kind, lookup=1)
    bound = load_into_slot("h", head, SlotBuffer(1 << 20), TINY_VOCAB, eng.target_parts)
    eng.add_draft(bound)
    inside = set(bound.to_target.tolist())
    outside = 0
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 80)
        out, stats = eng.generate(prompt, 80, select=lambda s: "h")
        assert out == ref
        pos = 0
        for r in stats.records:
            outside += sum(t not in inside for t in out[pos:pos + min(r.accepted, r.emitted)])
            pos += r.emitted
    assert outside > 0


def test_a_head_that_lands_after_a_request_started_still_runs(tiny_dir, tiny_heads):
    """open_engine keeps the heads' feature rows from the start: a request that began before
    its head was bound (a cold start) can switch to the head when it lands."""
    from types import SimpleNamespace

    from memspec.procs.decoder.models import _keep_head_features

    eng = engine_with(tiny_dir, [], dtype="int4")
    _keep_head_features(eng, SimpleNamespace(drafts=[SimpleNamespace(path=tiny_dir / "none"),
                                                     SimpleNamespace(path=tiny_heads[0])]))
    ref, _ = eng.generate(PROMPTS[1], 30)
    s = eng.start(PROMPTS[1], 30)
    s.step(None)
    eng.add_draft(load_into_slot("h", tiny_heads[0], SlotBuffer(1 << 20), TINY_VOCAB,
                                 eng.target_parts))
    while not s.done:
        s.step("h")
    assert s.generated == ref


def _prompt_rows(cache, n: int) -> list[torch.Tensor]:
    """K, V (and head features) of positions [0, n), whatever the K layout."""
    k = cache.k
    if cache.k_blocked:  # [layers, kv_heads, cap/16, head_dim, 16] -> [.., cap, head_dim]
        L, H, B, D, W = k.shape
        k = k.permute(0, 1, 2, 4, 3).reshape(L, H, B * W, D)
    rows = [k[:, :, :n], cache.v[:, :, :n]]
    return rows + ([cache.feat[:n]] if cache.feat is not None else [])


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "int4-torch", "int4-prepared",
                                   "int8-prepared"])
def test_prefill_in_chunks_leaves_the_same_cache(tiny_dir, dtype, monkeypatch, tmp_path):
    """A caller waiting on the first ranking gets `between` calls during the prefill; the
    native forward chunks (every PREFILL_CHUNK tokens while asked) and its cache rows
    (head features included) and output stay bit-identical, so when a ranking lands never
    changes a token. A runner that cannot promise that prefills in one piece. The
    decoder's own target (a prepared cache's packed blocks) chunks too: it once did not
    (its kinds were missing from ROW_EXACT_KINDS), so it prefilled whole and PyTorch's
    OpenMP threads spun beside the forward's pool."""
    chunk = 32  # whatever the tuned chunk is: several chunks within the tiny context
    monkeypatch.setattr(engine_module, "PREFILL_CHUNK", chunk)
    eng = engine_with(tiny_dir, ["small"], dtype=dtype, home=tmp_path / "home")
    eng.use_features([0, 1])  # what a head draft reads
    native = type(eng.target).__name__ == "NativeLM"
    assert getattr(eng.target, "exact_chunks", False) == native
    prompt = [1 + (i * 7) % 90 for i in range(3 * chunk + 5)]
    n = len(prompt) - 1
    ref = eng.generate(prompt, 24, select=lambda s: "small")[0]
    plain = eng.start(prompt, 24)  # the engine reuses one target cache: copy, then poison
    want = [t.clone() for t in _prompt_rows(plain._tcache, n)]
    for t in (plain._tcache.k, plain._tcache.v, plain._tcache.feat):
        t.fill_(float("nan"))  # a row the chunked prefill misses stays NaN and fails
    calls: list[int] = []

    def between() -> bool:
        calls.append(1)
        return len(calls) < 2  # the ranking "lands" at the second call: the rest at once

    chunked = eng.start(prompt, 24, between=between)
    if not native:
        assert calls == []
        return
    assert len(calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(_prompt_rows(chunked._tcache, n), want))
    while not chunked.done:
        chunked.step("small")
    assert chunked.generated == ref


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_native_forward_bits_do_not_depend_on_the_thread_count(tiny_dir, dtype):
    """The native kernels hand work items to whichever thread is free (one that loses its
    core to the loader leaves its share to the other), so no output may depend on which
    thread computed it, or how many there were."""
    eng = engine_with(tiny_dir, ["small"], dtype=dtype)
    if type(eng.target).__name__ != "NativeLM":
        pytest.skip("the native forward cannot be built here")
    ids = torch.tensor([1 + (i * 7) % 90 for i in range(45)])  # several 8-row blocks
    was = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = eng.target.new_cache(64)
            with torch.inference_mode():
                logits = eng.target.forward(ids, 0, cache).clone()
            out.append([logits] + [t.clone() for t in _prompt_rows(cache, len(ids))])
    finally:
        torch.set_num_threads(was)
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0], other))


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_packed_weights_in_huge_pages_give_the_same_products():
    """A model's packed weights move into one 2 MB-aligned block advised as huge pages (a
    decode step streams all of them; on 4 KiB pages each page is a TLB miss and a stop for
    the prefetchers). The products must not change; where the kernel takes the advice
    (Linux THP "always" or "madvise") the block is in huge pages."""
    from memspec.procs.decoder.forward.linear import Int4Linear
    from memspec.procs.decoder.forward.native import extension, linear_spec

    ext = extension()
    if ext is None:
        pytest.skip("the native forward cannot be built here")
    g = torch.Generator().manual_seed(0)
    packed = [ext.Linear(linear_spec(Int4Linear(torch.randn(1536, 2048, generator=g),
                                                torch.float32))) for _ in range(3)]
    x = torch.randn(5, 2048, generator=g)
    before = [lin(x) for lin in packed]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text() if thp.exists() else ""
    import gc

    from memspec.common.child import trim_heap

    gc.collect()  # an earlier test's memory freed and given back now (huge_pages trims
    trim_heap()  # the heap too), not while we count
    huge = _anon_huge_kb() if Path("/proc/self/smaps_rollup").exists() else 0
    ext.huge_pages(packed)  # ~6 MB: two whole huge pages at least
    assert all(torch.equal(lin(x), b) for lin, b in zip(packed, before))
    if "[always]" in mode or "[madvise]" in mode:
        assert _anon_huge_kb() - huge >= 2048


def test_the_bare_matmul_floor_runs_every_product_in_one_native_call(tiny_dir, tmp_path,
                                                                     monkeypatch):
    """`memspec bench engine`'s floor: the target's products as the forward joins them (q, k
    and v in one, gate and up in one), all in one C++ call; each comes out as the same
    product called on its own."""
    from memspec.bench.engine import floor_fns
    from memspec.common.config import load_pool
    from memspec.procs.decoder.forward.linear import Int4Linear
    from memspec.procs.decoder.forward.native import extension, linear_spec

    ext = extension()
    if ext is None:
        pytest.skip("the native forward cannot be built here")
    g = torch.Generator().manual_seed(1)
    packed = [ext.Linear(linear_spec(Int4Linear(torch.randn(n, 64, generator=g),
                                                torch.float32))) for n in (96, 32, 64)]
    xs = [torch.randn(5, 64, generator=g) for _ in packed]
    together = ext.run_linears(packed, xs)
    assert all(torch.equal(a, lin(x)) for a, lin, x in zip(together, packed, xs))
    calls: list[int] = []
    real = ext.run_linears
    monkeypatch.setattr(ext, "run_linears",
                        lambda lins, xs: calls.append(len(lins)) or real(lins, xs))
    pool = tmp_path / "pool.toml"
    pool.write_text(f'[pool]\ntarget = "{tiny_dir / "target"}"\n')
    floor_fns(load_pool(str(pool)), "int4", 5)()
    layers = json.loads((tiny_dir / "target" / "config.json").read_text())["num_hidden_layers"]
    assert calls == [4 * layers + 1]  # qkv, o, gate_up, down per layer, then the LM head


def test_random_draft_is_mostly_rejected(tiny_dir):
    eng = engine_with(tiny_dir, ["random"])
    _, stats = eng.generate(PROMPTS[0], 40, select=lambda s: "random")
    assert stats.summary()["acceptance_rate"] < 0.3


@pytest.mark.parametrize("dtype", DTYPES)
def test_switching_every_iteration_never_changes_a_token(tiny_dir, dtype):
    names = ["self", "random", "small"]
    eng = engine_with(tiny_dir, names, gamma=3, dtype=dtype)
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 50)
        order = itertools.cycle(names + [None])  # target-only steps in between too
        out, stats = eng.generate(prompt, 50, select=lambda s, o=order: next(o))
        assert out == ref
        assert stats.switches >= len(stats.records) // 2
        assert {r.draft for r in stats.records} == set(names) | {None}
        assert sum(r.t_catchup > 0 for r in stats.records) > 0


def test_vocab_subset_draft_with_id_map(tiny_dir, tmp_path):
    """A draft over a frequency-ranked subset of the target vocabulary stays lossless."""
    keep = torch.arange(0, TINY_VOCAB, 2)  # every other target id
    full = load_file(tiny_dir / "self" / "model.safetensors")
    sub = {k: v.clone() for k, v in full.items()}
    sub["model.embed_tokens.weight"] = full["model.embed_tokens.weight"][keep].clone()
    sub[ID_MAP_KEY] = keep.to(torch.int64)
    d = save_model(make_tiny(0, vocab=len(keep)), tmp_path / "sub")
    save_file(sub, d / "model.safetensors", metadata={"format": "pt"})
    eng = engine_with(tiny_dir, [])
    eng.add_draft(load_into_slot("sub", d, SlotBuffer(1 << 20), TINY_VOCAB))
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 30)
        out, stats = eng.generate(prompt, 30, select=lambda s: "sub")
        assert out == ref
        for rec in stats.records:
            assert rec.accepted <= rec.proposed


def test_eos_and_max_new_tokens(tiny_dir):
    eng = engine_with(tiny_dir, ["self"])
    ref, _ = eng.generate(PROMPTS[1], 30)
    stop = ref[7]
    eng.eos_ids = frozenset({stop})
    first = ref.index(stop)
    out, _ = eng.generate(PROMPTS[1], 30, select=lambda s: "self")
    assert out == ref[: first + 1]
    eng.eos_ids = frozenset()
    for n in (1, 2, 5, 13):
        out, _ = eng.generate(PROMPTS[1], n, select=lambda s: "self")
        assert out == ref[:n]


def test_too_long_prompt_is_a_request_error(tiny_dir):
    eng = engine_with(tiny_dir, [])
    with pytest.raises(RequestError, match="exceeds the target's context"):
        eng.generate([1] * 250, 20)


def test_draft_kv_catches_up_only_the_missing_suffix(tiny_dir):
    eng = engine_with(tiny_dir, ["self", "random"])
    s = eng.start(PROMPTS[1], 40)
    s.step("self")
    s.step("random")
    seen_before = s._drafts["self"].length
    s.step("random")
    s.step("self")
    # the re-activated draft fed only tokens produced since it last ran
    assert s._drafts["self"].length >= seen_before
    assert s._drafts["self"].length <= len(s.tokens) - 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_drafts_are_lossless_and_switch_with_model_drafts(tiny_dir, tiny_heads, dtype):
    """Heads read the target's features per position (kept across verify rollbacks and
    target-only steps); output stays the target's own greedy output whatever runs."""
    eng = engine_with(tiny_dir, ["random"], gamma=3, dtype=dtype)
    for i, path in enumerate(tiny_heads):
        eng.add_draft(load_into_slot(f"h{i}", path, SlotBuffer(1 << 20), TINY_VOCAB,
                                     eng.target_parts))
    assert eng.drafts["h0"].kind == "head"
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 40)
        for name in ("h0", "h1"):
            out, stats = eng.generate(prompt, 40, select=lambda s, n=name: n)
            assert out == ref
            assert {r.draft for r in stats.records} == {name}
        order = itertools.cycle(["h0", "random", None, "h1", "h1", None])
        out, stats = eng.generate(prompt, 40, select=lambda s, o=order: next(o))
        assert out == ref
        assert stats.switches > 3


@pytest.mark.parametrize("stored", [0, 1], ids=["q8-packed", "bf16"])
def test_native_head_matches_the_pytorch_reference(tiny_dir, tiny_heads, stored):
    """The C++ head and the PyTorch head give the same proposals from the same state (a
    packed head's PyTorch forward runs its blocks' values)."""
    fast = engine_with(tiny_dir, [], dtype="int8")
    slow = engine_with(tiny_dir, [], dtype="int8-torch")
    for eng in (fast, slow):
        eng.add_draft(load_into_slot("h", tiny_heads[stored], SlotBuffer(1 << 20), TINY_VOCAB,
                                     eng.target_parts))
    assert fast.drafts["h"].runner.native is not None
    assert slow.drafts["h"].runner.native is None
    props = []
    for eng in (fast, slow):
        s = eng.start(PROMPTS[1], 12)
        s.step(None)
        s.step(None)
        head = eng.drafts["h"].runner
        dc = s._draft_cache(eng.drafts["h"])
        L = len(s.tokens)
        feats = s._tfeat(-1, L - 1)
        logits, hidden = head.teacher(s._tok[:L], 0, dc.cache, feats)
        props.append(logits.float())
    assert torch.allclose(props[0], props[1], atol=0.1, rtol=0.05)
    assert props[0].argmax() == props[1].argmax()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_head_step_embeds_its_token_as_the_target_does(tiny_dir, tiny_heads, dtype):
    """The C++ step embeds its proposal itself: the rows are the target's embedding as
    tensor ops give it (Q8_0 values times their scales), and the step's logits and output
    are, bit for bit, the head's forward of those rows."""
    from memspec.procs.decoder.forward.linear import GROUP

    eng = engine_with(tiny_dir, [], dtype=dtype)
    lean = eng.target.lean
    ids = torch.tensor([3, 17, 42, 95])
    ref = lean.embed_w[ids].float()
    if lean.embed_scale is not None:
        ref = (ref.view(4, -1, GROUP) * lean.embed_scale[ids].float().unsqueeze(2)).view(4, -1)
    assert torch.equal(eng.target.model.embed(ids), ref)
    eng.add_draft(load_into_slot("h", tiny_heads[0], SlotBuffer(1 << 20), TINY_VOCAB,
                                 eng.target_parts))
    head = eng.drafts["h"].runner
    assert head.native is not None
    hidden = torch.randn(1, lean.arch.hidden, generator=torch.Generator().manual_seed(0))
    for i in range(4):
        a = head.step(ids[i:i + 1], 0, head.new_cache(16), hidden)
        b = head._native_forward(ref[i:i + 1], hidden, 0, head.new_cache(16))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_head_needs_the_target(tiny_heads):
    from memspec.common.errors import ModelError

    with pytest.raises(ModelError, match="needs the target"):
        load_into_slot("h", tiny_heads[0], SlotBuffer(1 << 20), TINY_VOCAB)


@pytest.mark.parametrize("dtype", ["float32", "int4", "int8-torch"])
def test_lookup_only_is_lossless_and_speculates_on_repeats(tiny_dir, dtype):
    """The context lookup alone as the draft: output is the target's greedy output, it
    proposes where the context repeats, and an iteration with nothing to propose is a
    plain target step (no verify, not counted as a draft)."""
    from memspec.procs.decoder.sched.costs import LOOKUP

    eng = engine_with(tiny_dir, [], dtype=dtype, lookup=1)
    proposed = 0
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 60)
        out, stats = eng.generate(prompt, 60, select=lambda s: LOOKUP)
        assert out == ref
        proposed += sum(r.proposed for r in stats.records)
        assert all(r.draft == LOOKUP for r in stats.records)
        empty = [r for r in stats.records if r.proposed == 0]
        assert all(r.emitted == 1 and r.t_draft == 0.0 for r in empty)
        assert stats.summary()["num_drafts"] == len(stats.records) - len(empty)
    assert proposed > 0


@pytest.mark.parametrize("verify_steps", [1.0, 8.0])
def test_lookup_depth_keeps_output_identical_and_follows_the_row_cost(tiny_dir, verify_steps):
    """With calibrated costs the lookup's proposals are only as long as pay for their rows:
    free rows -> up to gamma tokens, costly rows -> one token; either way the output is the
    target's own greedy output."""
    from memspec.procs.decoder.drafts.lookup_depth import LookupDepth
    from memspec.procs.decoder.sched.costs import LOOKUP

    eng = engine_with(tiny_dir, [], lookup=1)
    refs = [eng.generate(p, 60)[0] for p in PROMPTS]
    eng.depth_costs = ((1e-3, 0.0), (verify_steps * 1e-3, 0.0))
    old = LookupDepth.PRIOR, LookupDepth.WEIGHT
    LookupDepth.PRIOR, LookupDepth.WEIGHT = [0.6, 0.75, 0.75, 0.75], 8
    try:
        lengths = set()
        for prompt, ref in zip(PROMPTS, refs):
            out, stats = eng.generate(prompt, 60, select=lambda s: LOOKUP)
            assert out == ref
            lengths |= {r.proposed for r in stats.records if r.proposed}
    finally:
        LookupDepth.PRIOR, LookupDepth.WEIGHT = old
    assert lengths, "the lookup never proposed"
    assert lengths == {1} if verify_steps > 1.5 else max(lengths) == eng.gamma


def test_a_head_scores_the_tuned_cut_of_its_vocabulary_and_stays_lossless(
        tiny_dir, tmp_path, knobs):
    """``head.VOCAB`` (tuned.json) keeps a head's first rows, the commonest ids: a bind
    builds LM rows for those alone, and output stays the target's greedy output with the
    context lookup on or off."""
    head = make_tiny_head(tmp_path / "h", seed=6, vocab=48)
    full = load_into_slot("h", head, SlotBuffer(1 << 20), TINY_VOCAB,
                          engine_with(tiny_dir, [], dtype="int4").target_parts)
    knobs({"head.VOCAB": 6})
    for lookup in (0, 1):
        eng = engine_with(tiny_dir, [], dtype="int4", lookup=lookup)
        bound = load_into_slot("h", head, SlotBuffer(1 << 20), TINY_VOCAB, eng.target_parts)
        assert bound.runner.vocab == 6 and torch.equal(bound.to_target, full.to_target[:6])
        assert bound.runner.lm.q.shape[0] == 6  # LM rows built for the cut alone
        eng.add_draft(bound)
        for prompt in PROMPTS:
            ref, _ = eng.generate(prompt, 40)
            out, _ = eng.generate(prompt, 40, select=lambda s: "h")
            assert out == ref


def test_exact_lookup_depth_proposes_only_what_the_target_accepts(tiny_dir):
    """oracle-dynamic's lookup depth (`Session.propose`, from the trajectory's lookup
    table): every proposal is accepted whole, a position where the lookup would be
    rejected is a plain step, the walk is the full-depth lookup's, and the output is the
    target's own greedy output."""
    from memspec.procs.decoder.drafts.lookup import lookup_table
    from memspec.procs.decoder.sched.costs import LOOKUP

    eng = engine_with(tiny_dir, [], lookup=1)
    saved = 0
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 60)
        (out, stats), (full, fstats) = exact_and_full(
            eng, prompt, 60, LOOKUP, lookup_table(prompt, ref, eng.gamma, 1))
        assert out == ref == full
        assert all(r.accepted == r.proposed for r in stats.records)
        assert [r.emitted for r in stats.records] == [r.emitted for r in fstats.records]
        saved += sum(r.proposed for r in fstats.records) - sum(r.proposed for r in stats.records)
    assert saved > 0, "the full-depth lookup never had a proposal rejected"


@pytest.mark.parametrize("draft", ["small", "head"])
def test_exact_draft_proposals_stop_where_the_target_would_reject(tiny_dir, tiny_heads, draft):
    """A draft told its table (`Session.propose`) proposes only the tokens the target
    accepts (one at least): the same walk as gamma proposals, fewer draft steps and rows,
    the target's own greedy output; a model draft's KV cache stays right after a short
    proposal (the next iteration's proposals are still accepted as the table says)."""
    from memspec.zoo.tables import runtime_table

    eng = engine_with(tiny_dir, [] if draft == "head" else [draft], dtype="int4", lookup=1)
    if draft == "head":
        eng.add_draft(load_into_slot(draft, tiny_heads[0], SlotBuffer(1 << 20), TINY_VOCAB,
                                     eng.target_parts))
    saved = 0
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 40)
        (out, stats), (full, fstats) = exact_and_full(
            eng, prompt, 40, draft, runtime_table(eng, eng.drafts[draft], prompt, ref))
        assert out == ref == full
        assert all(r.accepted == r.proposed or (r.accepted == 0 and r.proposed == 1)
                   for r in stats.records)
        assert [r.emitted for r in stats.records] == [r.emitted for r in fstats.records]
        saved += sum(r.proposed for r in fstats.records) - sum(r.proposed for r in stats.records)
    assert saved > 0
