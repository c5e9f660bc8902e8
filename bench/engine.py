"""`memspec bench engine`: the engine against the hardware floor and against llama.cpp.

Measured in one run on this machine, for the pool's chosen target precision and for every
other one tried (fp32 is the eager HF path the engine had before static caches):
- the floor: the target's weights as a bare pass of matmuls (every layer's 7 projections
  and the LM head, no attention, no glue), with the fastest kernels this build has;
- the engine's target step (1 token), verify (gamma+1 tokens) and draft step costs;
- target-only and general-static tokens/s on dev prompts, interleaved per prompt;
- where each precision's greedy output first departs from fp32's, per prompt;
- llama.cpp's target-only tokens/s on the same GGUF with the same thread count, when the
  optional `llama-cpp-python` is installed (`pip install memspec[bench]`);
- how much a busy predictor and loader slow the decoder's iterations (interference).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from memspec.bench import peers
from memspec.common.config import PoolConfig, check_paths, load_pool
from memspec.common.machine import machine_info, machine_line
from memspec.common.metrics import gmean
from memspec.common.plotting import save_outputs
from memspec.procs.decoder.forward.checkpoint import lean_arch, load_state_dict, read_config
from memspec.procs.decoder.forward.linear import DenseLinear, Linear, PermutedLinear, make_linear
from memspec.procs.decoder.forward.native import extension, linear_spec
from memspec.procs.decoder.forward.precision import resolve_dtype
from memspec.procs.decoder.forward.quantized import dense_state_dict, quant_format, split_weights
from memspec.procs.decoder.forward.runners import default_act_dtype
from memspec.procs.decoder.inprocess import LocalRuntime, build_local, run_request
from memspec.procs.decoder.models import encode_prompt
from memspec.procs.decoder.oracle.tablefiles import numerics_key
from memspec.procs.decoder.sched.acceptance import SamplingParams
from memspec.zoo.prompts import load_prompts

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DTYPES = ("int4", "int8", "bfloat16", "float32")
# the products the native forward runs per layer (lean_cpu.cpp joins q/k/v and gate/up)
JOINED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def _rounds_ms(fns: dict[str, Any], reps: int = 21, warm: int = 3) -> dict[str, list[float]]:
    """Each of `fns` timed once per round, the rounds back to back: a shared host's load
    drifts by tens of percent within seconds (measured on a 2-core EPYC VM: a step from
    3.9 to 6.3 ms within a minute), so costs timed in blocks one after the other give
    ratios of two different machines; timed round by round, each round's ratio is one."""
    for _ in range(warm):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(1e3 * (time.perf_counter() - t0))
    return times


def _median_ms(fn, reps: int = 15, warm: int = 3) -> float:
    return statistics.median(_rounds_ms({"": fn}, reps, warm)[""])


def _paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a / b, each round's pair timed back to back."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def floor_fns(pool: PoolConfig, dtype: str, rows: int):
    """A bare matmul pass over the target's weights in ``dtype``: this build's kernels (the
    chosen kernel path's block kernels for int4 / int8, its 16-bit kernel for bf16) where
    the native forward is built, PyTorch's own otherwise; fp32 is PyTorch's BLAS."""
    cfg = read_config(pool.target)
    act = torch.float32 if dtype == "float32" else default_act_dtype(torch.device("cpu"))
    qfmt = quant_format(pool.target)
    weights = dense_state_dict(pool.target) if qfmt is None or dtype != "int4" else \
        load_state_dict(pool.target)
    ext = extension()
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    if qfmt is not None and dtype == "int4":  # a GPTQ / AWQ target: its own blocks
        arch = lean_arch(cfg)
        assert arch is not None
        _, built = split_weights(qfmt, arch, weights, act)
        mats = [built[f"model.layers.{i}.{name}"]
                for i in range(arch.layers) for name in PROJECTIONS]
        if "lm_head" in built:
            mats, head = mats + [built["lm_head"]], None
    else:  # joined as the forward holds them: q, k, v in one product, gate and up in one
        mats = [torch.cat([weights[f"model.layers.{i}.{name}.weight"] for name in group])
                for i in range(int(cfg["num_hidden_layers"])) for group in JOINED]
    plan = []
    pairs = [(m, dtype) for m in mats] + \
        ([(head, "int8" if dtype == "int4" else dtype)] if head is not None else [])
    for w, fmt in pairs:
        lin = w if isinstance(w, Linear) else make_linear(w, fmt, act)
        k, x_dtype = _in_features(lin), act
        # act-order layers gather their input in Python: that gather is part of their pass
        if ext is not None and fmt in ("int4", "int8", "bfloat16") and \
                not isinstance(lin, PermutedLinear):
            lin, x_dtype = ext.Linear(linear_spec(lin)), torch.float32
        plan.append((lin, torch.randn(rows, k).to(x_dtype)))
    del weights, mats
    if ext is not None:  # the weights in memory as the forward holds them
        ext.huge_pages([lin for lin, _ in plan if isinstance(lin, ext.Linear)])

    if ext is not None and all(isinstance(lin, ext.Linear) for lin, _ in plan):
        lins, xs = [lin for lin, _ in plan], [x for _, x in plan]  # one C++ call: no
        return lambda: ext.run_linears(lins, xs)  # Python between the products

    @torch.inference_mode()
    def run() -> None:
        for lin, x in plan:
            lin(x)

    return run


def _in_features(lin: Linear) -> int:
    if isinstance(lin, PermutedLinear):
        return int(lin.perm.numel())
    return int((lin.weight if isinstance(lin, DenseLinear) else lin.q).shape[1])


@torch.inference_mode()
def costs(rt: LocalRuntime, pool: PoolConfig, dtype: str, ctx: int) -> dict[str, float]:
    """Step, verify and draft-step times of the engine's own runners at context ``ctx``."""
    eng, g = rt.engine, pool.gamma
    target = eng.target
    cache = target.new_cache(eng.max_len)
    prompt = torch.randint(0, 1000, (ctx,))
    prefill_ms = _median_ms(lambda: target.forward(prompt, 0, cache, last_only=True), reps=5,
                            warm=1)
    one = torch.randint(0, 1000, (1,))
    many = torch.randint(0, 1000, (g + 1,))
    rt.ensure_resident(pool.general)
    draft = eng.drafts[pool.general]
    dcache = draft.new_cache(eng.max_len)
    if draft.kind == "head":  # a head: its own outputs after a teacher-forced prefix
        ids = torch.randint(0, 1000, (ctx + 1,))
        tcache = target.new_cache(eng.max_len)
        target.forward(ids[:-1], 0, tcache, last_only=True)
        feats = torch.cat([torch.zeros_like(tcache.feat[:1]), tcache.feat[:ctx - 1]])
        _, hidden = draft.runner.teacher(ids[:ctx], 0, dcache, feats)
        draft_step = lambda: draft.runner.step(one, ctx, dcache, hidden)  # noqa: E731
    else:
        draft.runner.forward(torch.randint(0, 1000, (ctx,)), 0, dcache, last_only=True)
        draft_step = lambda: draft.runner.forward(one, ctx, dcache)  # noqa: E731
    times = _rounds_ms({"step_ms": lambda: target.forward(one, ctx, cache),
                        "verify_ms": lambda: target.forward(many, ctx, cache),
                        # gamma steps back to back, as an iteration runs them: the first
                        # reads the head's weights from DRAM (the target's stream evicted
                        # them), the rest from cache
                        "draft_gamma_ms": lambda: [draft_step() for _ in range(g)],
                        "floor_step_ms": floor_fns(pool, dtype, 1),
                        "floor_verify_ms": floor_fns(pool, dtype, g + 1)})
    out = {k: statistics.median(v) for k, v in times.items()}
    out["draft_step_ms"] = out.pop("draft_gamma_ms") / g  # (a step's mean)
    out["prefill_ms"] = prefill_ms
    # the ratios: per round (each round's costs timed back to back), then the median
    out["step_over_floor"] = _paired(times, "step_ms", "floor_step_ms")
    out["verify_over_step"] = _paired(times, "verify_ms", "step_ms")
    out["verify_over_floor"] = _paired(times, "verify_ms", "floor_verify_ms")
    out["draft_gamma_over_step"] = _paired(times, "draft_gamma_ms", "step_ms")
    return out


def _first_divergence(ids: list[int], ref: list[int]) -> int | None:
    """Index of the first token where ``ids`` departs from ``ref`` (None: never)."""
    for i, (a, b) in enumerate(zip(ids, ref)):
        if a != b:
            return i
    return None if len(ids) == len(ref) else min(len(ids), len(ref))


def llama_cpp_costs(llm: peers.LlamaCpp, ctx: int, gamma: int) -> dict[str, float]:
    """llama.cpp's figures for the operations `costs` times of ours, at the same context:
    a 1-row step and a (gamma + 1)-row verify, every row's logits computed."""
    prompt = [100 + i % 900 for i in range(ctx)]

    def prefill() -> None:  # the prompt's logits only for its last row, as ours
        llm.reset()
        llm.decode(prompt)

    prefill_ms = _median_ms(prefill, reps=5, warm=1)
    own = []  # the same prefill by llama.cpp's own clock (llama_perf_context)
    for _ in range(3):
        llm.perf_reset()
        prefill()  # leaves the context in the cache
        own.append(llm.perf()["prefill_ms"])
    one, many = llm.rows([123], ctx), llm.rows([123 + i for i in range(gamma + 1)], ctx)
    try:  # the batches are filled before the clocks: only llama.cpp's work is timed
        times = _rounds_ms({"step_ms": lambda: llm.rows_at(one, ctx),
                            "verify_ms": lambda: llm.rows_at(many, ctx)}, reps=31)
    finally:
        llm.free(one)
        llm.free(many)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(prefill_ms=prefill_ms, prefill_ms_own_clock=statistics.median(own),
               context_tokens=ctx,
               verify_over_step=_paired(times, "verify_ms", "step_ms"))
    return out


def llama_cpp_run(pool: PoolConfig, rt: LocalRuntime, prompts: list[str], max_new: int,
                  threads: int, ctx: int) -> dict[str, Any] | None:
    """llama.cpp's greedy target-only decode on the GGUF our target came from, timed per
    token through its C API: ``llama_decode`` of one token, then the argmax of its logits
    (what our target-only step does too), the same threads; the prompt is one
    ``llama_decode`` call before the clock starts, as our steady tokens/s leaves prefill
    out. ``LLAMA_CPP_LIB_PATH`` picks another build of libllama (e.g. an AVX2-only one to
    compare with ``MEMSPEC_ISA=avx2``); its own feature line is recorded."""
    if not peers.available():
        _log("llama-cpp-python is not installed (pip install 'memspec[bench]'): no peer anchor")
        return None
    why = peers.unavailable(pool.target)
    if why is not None:
        _log(f"{why}: no peer anchor")
        return None
    llm = peers.LlamaCpp(threads, pool.gamma, gguf=peers.source_gguf(pool.target))
    eos = set(rt.engine.eos_ids)
    same = llama_cpp_costs(llm, ctx, pool.gamma)
    rates, step_ms, own_ms, outputs, ours = [], [], [], [], []
    for prompt in prompts:
        ids = encode_prompt(rt.tokenizer, prompt)
        llm.reset()
        llm.decode(ids)
        llm.perf_reset()  # its own clock from here: the decoding steps only
        out = [llm.argmax()]
        decode_s = 0.0
        t0 = time.perf_counter()
        while out[-1] not in eos and len(out) < max_new:
            t = time.perf_counter()
            llm.decode([out[-1]])
            decode_s += time.perf_counter() - t
            out.append(llm.argmax())
        spent = time.perf_counter() - t0
        if len(out) > 1:
            rates.append((len(out) - 1) / spent)
            step_ms.append(1e3 * decode_s / (len(out) - 1))
            perf = llm.perf()
            if perf["decode_tokens"]:
                own_ms.append(perf["decode_ms"] / perf["decode_tokens"])
            # ours again right after, on the same prompt: a paired ratio that a drifting
            # host load cannot tilt (the main loop ran ours minutes earlier)
            ours.append(run_request(rt, prompt, "target-only", max_new,
                                    SamplingParams())["stats"]["tokens_per_s_steady"])
        outputs.append(out)
    return {"tok_s": statistics.median(rates), "per_prompt_tok_s": rates,
            "ours_paired_tok_s": ours,
            "ours_over_llama_cpp_paired": gmean([a / b for a, b in zip(ours, rates) if b > 0]),
            "decode_step_ms": statistics.median(step_ms),
            # llama.cpp's own report of the same steps (llama_perf_context): a clock
            # that leaves out the Python call and the argmax around each llama_decode
            "decode_step_ms_own_clock": statistics.median(own_ms) if own_ms else None,
            "gguf": llm.gguf.name,
            "threads": threads, "outputs": outputs, "version": llm.lc.__version__,
            "system_info": llm.system_info(), "same_operation": same,
            "lib": os.environ.get("LLAMA_CPP_LIB_PATH", "bundled")}


def llama_cpp_e2e(rt: LocalRuntime, prompts: list[str], max_new: int, threads: int,
                  gamma: int) -> dict[str, Any] | None:
    """What a llama-cpp-python user runs instead, end to end: greedy `create_completion` on
    the same GGUF, plain and with its own prompt-lookup speculation
    (`LlamaPromptLookupDecoding`, gamma tokens a proposal), against our in-process
    target-only and lookup-only (the runtime's own prompt lookup, which the memspec policy
    gates) on the same prompts, interleaved per prompt. Every clock runs from the call to its
    last token, prefill included; llama-cpp-python's Python sampling is part of what its user
    gets, which is why its plain rate here is below the per-token C API rate above.
    (`memspec bench` runs the three-process memspec beside the same peers: bench/peers.py.)"""
    if peers.unavailable(rt.pool.target) is not None:
        return None
    llm = peers.LlamaCpp(threads, gamma, gguf=peers.source_gguf(rt.pool.target))
    names = {"llama.cpp": False, "llama.cpp+lookup": True}
    rates: dict[str, list[float]] = {k: [] for k in
                                     (*names, "ours target-only", "ours lookup-only")}
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(rt.tokenizer, prompt)
        for name, lookup in names.items():
            t0 = time.perf_counter()
            n = llm.completion(ids, max_new, lookup)
            rates[name].append(n / (time.perf_counter() - t0))
        for policy in ("target-only", "lookup-only"):
            t0 = time.perf_counter()
            got = run_request(rt, prompt, policy, max_new, SamplingParams())
            spent = time.perf_counter() - t0
            toks = got["token_ids"]
            if toks and toks[-1] in rt.engine.eos_ids:  # llama.cpp does not count its EOS
                toks = toks[:-1]
            rates[f"ours {policy}"].append(len(toks) / spent)
        _log(f"end to end {i + 1}/{len(prompts)}: "
             + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()) + " tok/s")

    def ratio(a: str, b: str) -> float:  # gmean leaves out a prompt that ended at once
        return gmean([x / y for x, y in zip(rates[a], rates[b]) if y > 0])

    return {"tok_s": {k: gmean(v) for k, v in rates.items()},
            "per_prompt_tok_s": rates, "gamma": gamma,
            "lookup_over_plain_llama_cpp": ratio("llama.cpp+lookup", "llama.cpp"),
            "ours_target_only_over_llama_cpp": ratio("ours target-only", "llama.cpp"),
            "ours_lookup_only_over_llama_cpp_lookup": ratio("ours lookup-only",
                                                             "llama.cpp+lookup"),
            "ours_lookup_only_over_llama_cpp": ratio("ours lookup-only", "llama.cpp")}


def run(pool_path: str | None, n_prompts: int, max_new: int,
        dtypes: list[str] | None = None, target: str | None = None) -> dict[str, Any]:
    """``target``: another target folder in place of the pool's (e.g. a GPTQ / AWQ one);
    the pool's drafts must share its tokenizer."""
    torch.manual_seed(0)
    pool = load_pool(pool_path)
    if target:
        path = Path(target).expanduser().resolve()
        if path.suffix.lower() == ".gguf":  # a GGUF of the user's: its converted folder
            from memspec.zoo.target import converted_gguf

            path = converted_gguf(path)
        pool = dataclasses.replace(pool, target=path)
        check_paths(pool)
    chosen = resolve_dtype(pool.dtype, pool.target, "cpu")
    tried = [chosen] + [d for d in (dtypes or DTYPES) if d != chosen]
    t0 = time.perf_counter()
    ext = extension()
    native_s = time.perf_counter() - t0
    domains = tuple(dict.fromkeys(d.domain for d in pool.drafts)) or ("general",)
    per = max(1, -(-n_prompts // len(domains)))
    rows = load_prompts("dev", domains, per_domain=per)
    prompts = [r["prompt"] for r in rows][:n_prompts]
    _log(f"{len(prompts)} dev prompts, {max_new} new tokens, dtypes {tried}, "
         f"native forward {'on' if ext is not None else 'off'}")
    rts = {d: build_local(pool, dtype=d) for d in tried}
    res: dict[str, Any] = {d: {"target_only": [], "general_static": [], "ids": [],
                               "acceptance": []} for d in tried}
    greedy = SamplingParams()
    for i, prompt in enumerate(prompts):
        for d in tried:  # interleaved: drift in machine load hits every dtype alike
            base = run_request(rts[d], prompt, "target-only", max_new, greedy)
            spec = run_request(rts[d], prompt, "general-static", max_new, greedy)
            if base["token_ids"] != spec["token_ids"]:
                raise RuntimeError(f"{d}: general-static output differs from target-only")
            res[d]["target_only"].append(base["stats"]["tokens_per_s_steady"])
            res[d]["general_static"].append(spec["stats"]["tokens_per_s_steady"])
            res[d]["acceptance"].append(spec["stats"]["mean_acceptance_length"])
            res[d]["ids"].append(base["token_ids"])
        _log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{d} {res[d]['target_only'][-1]:.0f}/{res[d]['general_static'][-1]:.0f} tok/s"
            for d in tried))
    ctx = statistics.median(len(encode_prompt(rts[chosen].tokenizer, p)) for p in prompts) \
        + max_new // 2
    per_dtype: dict[str, Any] = {}
    ref = res.get("float32", {}).get("ids")
    for d in tried:
        c = costs(rts[d], pool, d, int(ctx))
        entry = {"dtype": d, **c,
                 "target_only_tok_s": statistics.median(res[d]["target_only"]),
                 "general_static_tok_s": statistics.median(res[d]["general_static"]),
                 "mean_acceptance_length": statistics.mean(res[d]["acceptance"])}
        # per prompt, the two runs back to back (see _rounds_ms), then the geometric mean
        entry["general_static_over_target_only"] = gmean(
            [s / b for s, b in zip(res[d]["general_static"], res[d]["target_only"]) if b > 0])
        if ref is not None:
            div = [_first_divergence(a, b) for a, b in zip(res[d]["ids"], ref)]
            entry["first_divergence_from_fp32"] = div
            entry["identical_to_fp32"] = sum(x is None for x in div)
        per_dtype[d] = entry
        _log(f"{d}: step {c['step_ms']:.2f} ms (floor {c['floor_step_ms']:.2f}), verify "
             f"{c['verify_ms']:.2f} ms, draft step {c['draft_step_ms']:.3f} ms")
    threads = torch.get_num_threads()
    # llama.cpp runs the GGUF the target came from (the demo's, or a brought GGUF's):
    # a target converted from no GGUF has no peer on the same weights (llama_cpp_run says so)
    peer = llama_cpp_run(pool, rts[chosen], prompts, max_new, threads, int(ctx))
    top = per_dtype[chosen]
    out: dict[str, Any] = {
        "machine": machine_line(), "machine_info": machine_info(), "threads": threads,
        "target": str(pool.target),
        "isa": machine_info()["isa"], "numerics": numerics_key(chosen),
        "native_forward": ext is not None, "native_load_s": native_s,
        "gamma": pool.gamma, "max_new_tokens": max_new, "prompts": len(prompts),
        "context_tokens": int(ctx),
        **{k: top[k] for k in ("dtype", "step_ms", "verify_ms", "draft_step_ms",
                               "floor_step_ms", "floor_verify_ms", "step_over_floor",
                               "verify_over_step", "verify_over_floor", "draft_gamma_over_step",
                               "target_only_tok_s", "general_static_tok_s",
                               "general_static_over_target_only")},
        "per_dtype": per_dtype,
    }
    if "float32" in per_dtype:
        out["target_only_speedup_vs_fp32_eager"] = (top["target_only_tok_s"]
                                                     / per_dtype["float32"]["target_only_tok_s"])
    if peer is not None:
        out["llama_cpp_tok_s"] = peer["tok_s"]
        out["target_only_over_llama_cpp"] = top["target_only_tok_s"] / peer["tok_s"]
        div = [_first_divergence(a, b) for a, b in zip(peer["outputs"], res[chosen]["ids"])]
        out["llama_cpp"] = {k: v for k, v in peer.items() if k != "outputs"}
        out["llama_cpp"]["identical_to_ours"] = sum(x is None for x in div)
        out["llama_cpp"]["first_divergence_from_ours"] = div
        e2e = llama_cpp_e2e(rts[chosen], prompts, max_new, threads, pool.gamma)
        if e2e is not None:
            out["llama_cpp_e2e"] = e2e
    else:
        out["llama_cpp_tok_s"] = None
    return out


def _print(res: dict[str, Any]) -> None:
    print(f"machine: {res['machine']}; gamma={res['gamma']}, {res['max_new_tokens']} new tokens, "
          f"{res['prompts']} dev prompts, context ~{res['context_tokens']} tokens")
    print(f"target: {res['target']}; kernel path {res['isa']}")
    print(f"{'dtype':<10}{'floor ms':>9}{'step ms':>9}{'step/fl':>8}{'verify ms':>10}"
          f"{'ver/step':>9}{'ver/fl':>7}{'draft ms':>9}{'target tok/s':>13}{'spec tok/s':>11}"
          f"{'spec/tgt':>9}")
    for d, e in res["per_dtype"].items():
        print(f"{d:<10}{e['floor_step_ms']:>9.2f}{e['step_ms']:>9.2f}{e['step_over_floor']:>8.2f}"
              f"{e['verify_ms']:>10.2f}{e['verify_over_step']:>9.2f}"
              f"{e.get('verify_over_floor', float('nan')):>7.2f}{e['draft_step_ms']:>9.3f}"
              f"{e['target_only_tok_s']:>13.1f}{e['general_static_tok_s']:>11.1f}"
              f"{e['general_static_over_target_only']:>9.2f}")
    if res.get("llama_cpp_tok_s"):
        lc = res["llama_cpp"]
        print(f"llama.cpp {lc['version']} ({lc['gguf']}, {res['threads']} threads, per token "
              f"through llama_decode): {res['llama_cpp_tok_s']:.1f} tok/s, decode step "
              f"{lc['decode_step_ms']:.2f} ms (its own clock "
              f"{lc.get('decode_step_ms_own_clock') or float('nan'):.2f}); ours/llama.cpp "
              f"{res['target_only_over_llama_cpp']:.2f}"
              + (f" (paired per prompt: {lc['ours_over_llama_cpp_paired']:.2f})"
                 if lc.get("ours_over_llama_cpp_paired") else ""))
        same, top = lc.get("same_operation"), res["per_dtype"][res["dtype"]]
        if same:
            print(f"  same operation at context {same['context_tokens']}: step "
                  f"{same['step_ms']:.2f} ms (ours {top['step_ms']:.2f}, floor "
                  f"{top['floor_step_ms']:.2f}), {res['gamma'] + 1}-row verify "
                  f"{same['verify_ms']:.2f} ms (ours {top['verify_ms']:.2f}, floor "
                  f"{top['floor_verify_ms']:.2f}); verify/step {same['verify_over_step']:.2f} "
                  f"(ours {top['verify_over_step']:.2f}); a {same['context_tokens']}-token "
                  f"prefill {same['prefill_ms']:.1f} ms (its own clock "
                  f"{same['prefill_ms_own_clock']:.1f}; ours {top['prefill_ms']:.1f})")
    if res.get("llama_cpp_e2e"):
        e = res["llama_cpp_e2e"]
        print("end to end through llama-cpp-python's create_completion (gmean tok/s): "
              + ", ".join(f"{k} {v:.1f}" for k, v in e["tok_s"].items()))
        print(f"  llama.cpp's prompt lookup / its plain decoding "
              f"{e['lookup_over_plain_llama_cpp']:.2f}; ours lookup-only / llama.cpp+lookup "
              f"{e['ours_lookup_only_over_llama_cpp_lookup']:.2f}; ours lookup-only / "
              f"llama.cpp plain {e['ours_lookup_only_over_llama_cpp']:.2f}")
    for d, e in res["per_dtype"].items():
        if "first_divergence_from_fp32" in e and d != "float32":
            print(f"{d}: identical to fp32 on {e['identical_to_fp32']}/{res['prompts']} prompts; "
                  f"first divergence at {e['first_divergence_from_fp32']}")


def _plot(res: dict[str, Any], folder: Path) -> Path:
    from memspec.common.plotting import pyplot

    plt = pyplot()

    folder.mkdir(parents=True, exist_ok=True)
    per = res["per_dtype"]
    names = list(per)
    x = range(len(names))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.bar([i - 0.2 for i in x], [per[d]["target_only_tok_s"] for d in names], 0.4,
           label="target-only")
    a1.bar([i + 0.2 for i in x], [per[d]["general_static_tok_s"] for d in names], 0.4,
           label="general-static (speculative)")
    if res.get("llama_cpp_tok_s"):
        a1.axhline(res["llama_cpp_tok_s"], color="k", ls="--", label="llama.cpp target-only")
    a1.set_xticks(list(x), names)
    a1.set_ylabel("tokens/s (steady state)")
    a1.set_title("Throughput by target precision")
    a1.legend(fontsize=8)
    w = 0.27
    a2.bar([i - w for i in x], [per[d]["floor_step_ms"] for d in names], w, label="floor (matmuls)")
    a2.bar(list(x), [per[d]["step_ms"] for d in names], w, label="step (1 token)")
    a2.bar([i + w for i in x], [per[d]["verify_ms"] for d in names], w,
           label=f"verify ({res['gamma'] + 1} tokens)")
    a2.set_xticks(list(x), names)
    a2.set_ylabel("ms")
    a2.set_title("Target cost vs the bare-matmul floor")
    a2.legend(fontsize=8)
    fig.suptitle(res["machine"], fontsize=9)
    fig.tight_layout()
    out = folder / "bench_engine.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main_bench_engine(args) -> int:
    dtypes = args.dtypes.split(",") if getattr(args, "dtypes", None) else None
    res = run(args.pool, args.prompts, args.max_new_tokens, dtypes, getattr(args, "target", None))
    _print(res)
    save_outputs(res, args, _plot, indent=2)
    return 0
