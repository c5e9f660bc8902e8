"""`memspec bench gpu`: the engine on a CUDA GPU, eager launches against CUDA graphs.

1. Costs at a context of ``--context`` tokens: target step (1 token), verify (gamma+1),
   draft step, for the HF eager path (DynamicCache), the lean forward launched eagerly
   (static caches) and the lean forward replayed as CUDA graphs; the floor is the target's
   matmuls (every projection and the LM head) replayed as one CUDA graph.
2. Target-only decode tokens/s, eager against graphs, over ``--tokens`` tokens.
3. Losslessness on the GPU: tiny random models (a self draft, a random draft and a head),
   target-only against speculative decoding with drafts switching every iteration, eager
   and with graphs.
Timings do not depend on weight values, so ``--random-weights`` times the pool's
architecture where its checkpoint is not on the machine (say so when reporting).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from memspec.common.config import load_pool
from memspec.common.draftfiles import draft_weights_file
from memspec.common.machine import machine_info
from memspec.common.provenance import result_provenance
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward.checkpoint import lean_arch, read_config
from memspec.procs.decoder.forward.cudagraph import GraphLM
from memspec.procs.decoder.forward.lean import LeanLM
from memspec.procs.decoder.forward.runners import HFRunner, set_feature_layers
from memspec.procs.decoder.models import build_target, load_causal_lm
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _log(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def _ms(fn, reps: int = 50, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _target_weights(target_dir: Path, random_weights: bool) -> tuple[dict, torch.nn.Module]:
    """The target's state dict in bf16 on the GPU, and an HF module over the same tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if random_weights:
        cfg = AutoConfig.from_pretrained(target_dir)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    else:
        model = load_causal_lm(target_dir, "target", dtype=torch.bfloat16, device="cuda")
    model.eval()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd, model


def _floor_graph(sd: dict, layers: int, rows: int):
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    mats = [sd[f"model.layers.{i}.{n}.weight"] for i in range(layers) for n in PROJECTIONS]
    mats.append(head)
    xs = [torch.randn(rows, w.shape[1], device="cuda", dtype=w.dtype) for w in mats]

    def body() -> None:
        for w, x in zip(mats, xs):
            torch.nn.functional.linear(x, w)

    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g.replay


@torch.inference_mode()
def costs(pool, target_dir: Path, ctx: int, random_weights: bool, gamma: int) -> dict:
    sd, hf = _target_weights(target_dir, random_weights)
    arch = lean_arch(read_config(target_dir))
    cap = ctx + 64
    lean = LeanLM.from_weights(arch, sd, "bfloat16", torch.bfloat16, fuse=True)
    graph = GraphLM(LeanLM.from_weights(arch, sd, "bfloat16", torch.bfloat16, fuse=True))
    hf_runner = HFRunner(hf)
    prefix = torch.randint(0, 1000, (ctx,), device="cuda")
    one = torch.randint(0, 1000, (1,), device="cuda")
    many = torch.randint(0, 1000, (gamma + 1,), device="cuda")
    out: dict[str, Any] = {"context_tokens": ctx, "random_weights": random_weights}
    for label, runner in (("hf_eager", hf_runner), ("lean_eager", lean),
                          ("lean_graphs", graph)):
        cache = runner.new_cache(cap)
        runner.forward(prefix, 0, cache, last_only=True)
        out[label] = {"step_ms": _ms(lambda r=runner, c=cache: r.forward(one, ctx, c)),
                      "verify_ms": _ms(lambda r=runner, c=cache: r.forward(many, ctx, c))}
        _log(f"{label}: {out[label]}")
    out["floor_step_ms"] = _ms(_floor_graph(sd, arch.layers, 1))
    out["floor_verify_ms"] = _ms(_floor_graph(sd, arch.layers, gamma + 1))
    g = out["lean_graphs"]
    out["graphs_step_over_floor"] = g["step_ms"] / out["floor_step_ms"]
    out["graphs_verify_over_step"] = g["verify_ms"] / g["step_ms"]
    out["eager_over_graphs_step"] = out["lean_eager"]["step_ms"] / g["step_ms"]
    out["draft"] = draft_costs(pool, graph, lean, ctx)
    out["draft_gamma_over_step"] = gamma * out["draft"]["step_ms"] / g["step_ms"]
    out["decode"] = decode_rates(graph, lean, ctx)
    return out


@torch.inference_mode()
def draft_costs(pool, target, lean, ctx: int) -> dict:
    """The pool's general draft bound in a GPU slot: one draft step, eager and as a CUDA
    graph. A head reads the target's features and runs as the engine runs it: graphs when
    the target replays graphs, eager launches when it does not."""
    spec = pool.general_draft
    size = draft_weights_file(spec.path).stat().st_size
    res: dict[str, Any] = {"draft": spec.name, "kind": spec.kind}
    one = torch.randint(0, 1000, (1,), device="cuda")
    if spec.kind == "head":
        feeder = SpecEngine(lean, (), gamma=pool.gamma, max_context=ctx + 64)
        feeder.add_draft(load_into_slot(spec.name, spec.path, SlotBuffer(size, device="cuda"),
                                        target.vocab, parts=feeder.target_parts))
        ids = torch.randint(0, 1000, (ctx + 1,), device="cuda")
        tcache = lean.new_cache(ctx + 64)  # the target now keeps the features the head reads
        lean.forward(ids[:-1], 0, tcache, last_only=True)
        feats = torch.cat([torch.zeros_like(tcache.feat[:1]), tcache.feat[:ctx - 1]])
        for label, runner in (("eager", lean), ("graphs", target)):
            eng = SpecEngine(runner, (), gamma=pool.gamma, max_context=ctx + 64)
            bound = load_into_slot(spec.name, spec.path, SlotBuffer(size, device="cuda"),
                                   target.vocab, parts=eng.target_parts)
            dcache = bound.runner.new_cache(ctx + 64)
            _, hidden = bound.runner.teacher(ids[:ctx], 0, dcache, feats)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bound.runner.step(one, ctx, dcache, hidden)  # with graphs: the capture
            torch.cuda.synchronize()
            res[f"{label}_first_step_ms"] = 1e3 * (time.perf_counter() - t0)
            res[f"{label}_step_ms"] = _ms(
                lambda r=bound.runner, c=dcache, h=hidden: r.step(one, ctx, c, h))
        res["step_ms"] = res["graphs_step_ms"]
        set_feature_layers(lean, [])
        _log(f"draft {res}")
        return res
    for label, fast in (("eager", False), ("graphs", True)):
        slot = SlotBuffer(size, device="cuda")
        bound = load_into_slot(spec.name, spec.path, slot, target.vocab)
        runner = bound.runner if fast else getattr(bound.runner, "lean", bound.runner)
        cache = runner.new_cache(ctx + 64)
        runner.forward(torch.randint(0, 1000, (ctx,), device="cuda"), 0, cache, last_only=True)
        res[f"{label}_step_ms"] = _ms(lambda r=runner, c=cache, x=one: r.forward(x, ctx, c))
    res["step_ms"] = res["graphs_step_ms"]
    _log(f"draft {res}")
    return res


@torch.inference_mode()
def decode_rates(graph, lean, ctx: int, tokens: int = 128) -> dict:
    """Greedy target-only decoding (no EOS stop), eager against graphs."""
    out = {}
    for label, runner in (("eager", lean), ("graphs", graph)):
        eng = SpecEngine(runner, (), gamma=4, max_context=ctx + tokens + 16)
        prompt = list(range(100, 100 + ctx))
        eng.generate(prompt, 8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ids, stats = eng.generate(prompt, tokens)
        torch.cuda.synchronize()
        out[f"{label}_tok_s"] = len(ids) / (time.perf_counter() - t0 - stats.t_prefill)
    out["graphs_over_eager"] = out["graphs_tok_s"] / out["eager_tok_s"]
    _log(f"decode {out}")
    return out


@torch.inference_mode()
def lossless_tiny() -> dict:
    """Target-only vs speculative on tiny random models, on the GPU, eager and graphs."""
    tests = Path(__file__).resolve().parent.parent / "tests"
    sys.path.insert(0, str(tests))
    from tinymodels import TINY_VOCAB, make_tiny, make_tiny_head, save_model

    root = Path(tempfile.mkdtemp(prefix="memspec-gpu-"))
    save_model(make_tiny(0), root / "target")
    save_model(make_tiny(0), root / "self")
    save_model(make_tiny(1, layers=1), root / "random")
    make_tiny_head(root / "head", seed=3)
    # the last is longer than a graph's rows: an eager prefill, then the first capture
    prompts = [[1, 5, 9, 22], [1, 40, 41, 42, 43, 44, 45], [1, 7], list(range(3, 40))]
    res = {}
    for fast in (False, True):
        eng = SpecEngine(build_target(root / "target", "bfloat16", "cuda", fast=fast), (), gamma=4)
        for n in ("self", "random"):
            eng.add_draft(load_into_slot(n, root / n, SlotBuffer(1 << 20, device="cuda"),
                                         TINY_VOCAB))
        eng.add_draft(load_into_slot("head", root / "head", SlotBuffer(1 << 20, device="cuda"),
                                     TINY_VOCAB, eng.target_parts))
        checks, accepted = 0, 0
        for p in prompts:
            ref, _ = eng.generate(p, 48)
            for sel in ("self", "random", "head", "switch"):
                order = itertools.cycle(["self", "head", None, "random"])
                pick = (lambda s, o=order: next(o)) if sel == "switch" else \
                    (lambda s, n=sel: n)
                out, stats = eng.generate(p, 48, select=pick)
                assert out == ref, (fast, sel, p)
                checks += 1
                if sel == "self":
                    accepted += stats.summary()["num_accepted_tokens"]
        res["graphs" if fast else "eager"] = {"identical_runs": checks,
                                              "self_draft_accepted": accepted}
    _log(f"lossless {res}")
    return res


def main_bench_gpu(args) -> int:
    if not torch.cuda.is_available():
        from memspec.common.errors import MemspecError

        raise MemspecError("no CUDA GPU here", "run `memspec bench gpu` on a machine with one")
    pool = load_pool(args.pool, check=not args.random_weights)
    target_dir = Path(args.target) if args.target else pool.target
    res = {"machine": machine_info(), "gamma": pool.gamma,
           "lossless": lossless_tiny(),
           "costs": costs(pool, target_dir, args.context, args.random_weights, pool.gamma)}
    print(json.dumps(res, indent=2))
    if args.json:
        res = {"provenance": result_provenance(args.pool), **res}  # what it measured
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0
