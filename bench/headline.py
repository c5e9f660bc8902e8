"""`memspec bench headline`: the one figure a round ends on, measured once.

Is memspec faster than what a user would otherwise run, on the user's machine? In one run,
per prompt, under each load in turn (`quiet`, `busy1`: one same-priority spin loop) and on
each kernel path (the CPU's own and, below it, `avx2` forced with ``MEMSPEC_ISA``), back to
back in a rotating order:

- memspec, lookup-only, general-static and target-only through the three processes (one
  `memspec up` per policy and kernel path, so no policy learns from another's requests);
- llama.cpp on the same GGUF (its C API, greedy) and llama-cpp-python with its prompt
  lookup, at the thread count that is its fastest under the load: every core when quiet, one
  fewer beside a busy core (2 threads ran 28-37 tok/s there, 1 thread 72-78; issue 69's
  table). One build for both kernel paths (an AVX2 row's llama.cpp is the CPU's own build;
  the JSON says so).

Every clock runs from the call to the last token (prefill included; an end-of-generation
token not counted). Ratios are geometric means over prompts with 95% intervals (prompts
resampled within domains). ``--split test2`` reads the set that is read once: the run is
entered in ``prompts/test2_reads.jsonl`` before anything is measured, and the JSON counts
the runs that read it. The default split is dev, so a trial run reads nothing held out;
``--split dev2`` (the old test split, read by many runs) is a second dev set.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from memspec.bench import heldout
from memspec.bench.contention import Load, Ours, Peer, timed_run
from memspec.bench.floor import settle
from memspec.bench.peers import LlamaCpp, order, unavailable
from memspec.bench.stats import headline_ratios
from memspec.common import isa as isa_mod
from memspec.common.errors import ConfigError, MemspecError
from memspec.common.plotting import finish_figure, pyplot, save_outputs
from memspec.common.provenance import result_provenance

POLICIES = ("memspec", "lookup-only", "general-static", "target-only")
PLAIN, LOOKUP = "llama.cpp", "llama.cpp+lookup"
LOADS = ("quiet", "busy1")
BUSY_CORES = {"quiet": 0, "busy1": 1}  # what each load takes: llama.cpp leaves it those cores
# memspec over each: the headline's rows, per kernel path and load
RATIOS: dict[str, tuple[str, str]] = {
    "memspec_over_target_only": ("memspec", "target-only"),
    "memspec_over_lookup_only": ("memspec", "lookup-only"),
    "memspec_over_general_static": ("memspec", "general-static"),
    "memspec_over_llama_cpp": ("memspec", PLAIN),
    "memspec_over_llama_cpp_lookup": ("memspec", LOOKUP),
    "target_only_over_llama_cpp": ("target-only", PLAIN),
}


def _log(msg: str) -> None:
    print(f"[bench headline] {msg}", file=sys.stderr, flush=True)


def kernel_paths(asked: str | None) -> list[str]:
    """The CPU's own path, and `avx2` beside it where the CPU has a higher one (forced:
    what an AVX2-only machine runs); or the comma-separated paths asked for."""
    have = isa_mod.supported()
    if asked:
        paths = [p.strip() for p in asked.split(",") if p.strip()]
        bad = [p for p in paths if p not in have]
        if bad:
            raise ConfigError(f"kernel path(s) {', '.join(bad)} not available on this CPU",
                              f"use --isas with some of {', '.join(have)}")
        return paths
    native = isa_mod.native_isa()
    return [native] + (["avx2"] if native != "avx2" and "avx2" in have else [])


class LookupPeer:
    """llama-cpp-python's completion with its prompt lookup (`LlamaPromptLookupDecoding`)."""

    def __init__(self, llama: LlamaCpp) -> None:
        self.llama = llama

    def run(self, ids: Sequence[int], max_new: int, eos: set[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        n = self.llama.completion(ids, max_new, lookup=True)
        return {"tokens": n, "seconds": time.perf_counter() - t0, "ids": None, "timeline": []}


def summarise(rows: Sequence[dict[str, Any]], paths: Sequence[str], loads: Sequence[str]
              ) -> dict[str, Any]:
    """Per kernel path and load: each ratio's GMEAN and interval, tok/s per entry, and how
    many prompts' tokens differ from target-only's (lossless: none)."""
    out: dict[str, Any] = {}
    strata = {r["id"]: r["domain"] for r in rows}
    for path in paths:
        for load in loads:
            names = (*POLICIES, PLAIN, LOOKUP)
            runs = {n: {r["id"]: [(g["tokens"], g["seconds"]) for g in
                                  r["runs"][load][_key(n, path)]] for r in rows}
                    for n in names}
            gm, ci = headline_ratios(runs, strata, RATIOS)
            tok_s = {n: [t / s for r in runs[n].values() for t, s in r if s > 0] for n in names}
            differ = sum(any(g["ids"] != r["runs"][load][_key("target-only", path)][k]["ids"]
                             for pol in POLICIES[:-1]
                             for k, g in enumerate(r["runs"][load][_key(pol, path)]))
                         for r in rows)
            out[f"{path}/{load}"] = {
                "gmean": gm, "ci95": ci, "prompts": len(rows),
                "tok_s": {n: sum(v) / len(v) if v else None for n, v in tok_s.items()},
                "prompts_with_tokens_unlike_target_only": differ}
    return out


def llama_threads(load: str, cores: int | None = None) -> int:
    """llama.cpp's threads under `load`: the cores the load leaves (its fastest setting; a
    thread on a core the spin loop holds waits at every barrier)."""
    return max(1, (cores or os.cpu_count() or 1) - BUSY_CORES[load])


def _key(name: str, path: str) -> str:
    """A run's key in a row: ours per kernel path, llama.cpp's one build for all."""
    return name if name in (PLAIN, LOOKUP) else f"{name}@{path}"


def run(pool: str | None, split: str, per_domain: int | None, max_new: int,
        paths: Sequence[str], loads: Sequence[str], repeats: int,
        log: Callable[[str], None] = _log) -> dict[str, Any]:
    from memspec.common.config import load_pool
    from memspec.procs.decoder.models import encode_prompt, load_tokenizer
    from memspec.zoo.evaluate import pool_domains
    from memspec.zoo.prompts import load_prompts

    prov = result_provenance(pool)  # the code as the run starts: what its figures measure
    cfg = load_pool(pool)
    why = unavailable(Path(cfg.target))
    if why is not None:
        raise MemspecError(f"bench headline runs llama.cpp beside memspec, and {why}")
    reads = heldout.record_read(split, prov)  # before anything is measured
    prompts = load_prompts(split, pool_domains(cfg), per_domain)
    tok = load_tokenizer(Path(cfg.target))
    eos = {int(t) for t in ([tok.eos_token_id] if tok.eos_token_id is not None else [])}
    log(f"{len(prompts)} {split} prompts x loads {', '.join(loads)} x kernel paths "
        f"{', '.join(paths)} x ({', '.join(POLICIES)}; {PLAIN}, {LOOKUP}) x {repeats}"
        + (f"; {split} read by {reads} run(s), this one included" if reads else ""))
    entries = [_key(p, path) for path in paths for p in POLICIES] + [PLAIN, LOOKUP]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="memspec-headline-") as tmp:
        servers: dict[str, Ours] = {}
        try:
            for path in paths:
                for pol in POLICIES:
                    name = _key(pol, path)
                    log(f"starting the {name} server")
                    s = Ours(name.replace("@", "-"), pool, tmp, {"MEMSPEC_ISA": path})
                    s.policy = pol
                    servers[name] = s
            by_threads: dict[int, dict[str, Any]] = {}
            for n in sorted({llama_threads(load) for load in loads}):
                plain = Peer(n, cfg.gamma)  # plain through its C API, and its lookup
                by_threads[n] = {PLAIN: plain, LOOKUP: LookupPeer(plain.llama)}
            peers_of = {load: by_threads[llama_threads(load)] for load in loads}
            llama = next(iter(by_threads.values()))[PLAIN].llama
            warm = prompts[0]["prompt"]
            for s in servers.values():  # each server's first request: its warm-up
                s.run(warm, 8, eos, False)
            for ps in by_threads.values():
                for p in ps.values():
                    p.run(encode_prompt(tok, warm), 8, eos)
            for name, s in servers.items():
                settle(s.rt, f"the {name} server")
            t_start = time.perf_counter()
            for i, r in enumerate(prompts):
                ids = encode_prompt(tok, r["prompt"])
                row: dict[str, Any] = {"id": r["id"], "domain": r["domain"], "runs": {}}
                for load in order(i, loads):
                    peers = peers_of[load]
                    got: dict[str, list[dict[str, Any]]] = {e: [] for e in entries}
                    ld = Load(load)
                    try:
                        for rep in range(repeats):
                            for e in order(i + rep, entries):
                                call = partial(peers[e].run, ids, max_new, eos) if e in peers \
                                    else partial(servers[e].run, r["prompt"], max_new, eos,
                                                 trace=False)
                                one = timed_run(call, ld, False)
                                for k in ("timeline", "decode_tok_s", "threads"):
                                    one.pop(k, None)
                                got[e].append(one)
                    finally:
                        ld.stop()
                    row["runs"][load] = got
                rows.append(row)
                left = (time.perf_counter() - t_start) / (i + 1) * (len(prompts) - i - 1)
                log(f"{i + 1}/{len(prompts)} {r['id']}: " + "; ".join(
                    f"{load} " + " ".join(
                        f"{e} {g[0]['tokens'] / g[0]['seconds']:.0f}"
                        for e, g in row["runs"][load].items() if g and g[0]["seconds"] > 0)
                    for load in loads) + f" tok/s (~{left / 60:.1f} min left)")
        finally:
            for s in servers.values():
                s.stop()
    from memspec.bench.evaluation import split_info

    return {"provenance": prov, "split": split, "held_out_reads": reads,
            "splits": {**split_info(), "measured_on": [split]},  # disjoint by source?
            "prompts": len(rows), "per_domain": per_domain, "max_new_tokens": max_new,
            "kernel_paths": list(paths), "native_kernel_path": isa_mod.native_isa(),
            "loads": list(loads), "repeats": repeats, "policies": list(POLICIES),
            "llama_cpp": {"threads": {load: llama_threads(load) for load in loads},
                          "version": llama.lc.__version__,
                          "gguf": llama.gguf.name, "system_info": llama.system_info(),
                          "note": "one build for every kernel path: an avx2 row compares "
                                  "our forced avx2 path with the CPU's own llama.cpp build"},
            "clock": "call to last token, prefill included; end-of-generation token not "
                     "counted",
            "summary": summarise(rows, paths, loads), "rows": _without_ids(rows)}


def _without_ids(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as the JSON keeps them: token ids dropped (the summary compared them)."""
    return [{**r, "runs": {load: {e: [{k: v for k, v in g.items() if k != "ids"} for g in gs]
                                  for e, gs in by.items()} for load, by in r["runs"].items()}}
            for r in rows]


def _print(res: dict[str, Any]) -> None:
    print(f"memspec bench headline: {res['prompts']} {res['split']} prompts, "
          f"{res['max_new_tokens']} new tokens, {res['repeats']} repeat(s), end to end; "
          f"{res['provenance'].get('machine')} (native {res['native_kernel_path']})"
          + (f"; {res['split']} read by {res['held_out_reads']} run(s)"
             if res.get("held_out_reads") else ""))
    for cond, s in res["summary"].items():
        print(f"  {cond}: " + ", ".join(
            f"{k.replace('_over_', ' / ')} {s['gmean'][k]:.3f} "
            f"[{s['ci95'][k][0]:.3f}, {s['ci95'][k][1]:.3f}]" for k in RATIOS
            if k in s["gmean"]) + f"; tokens unlike target-only on "
            f"{s['prompts_with_tokens_unlike_target_only']} prompts")


def plot(res: dict[str, Any], path: Path) -> Path:
    """Two panels: memspec over our own baselines (near 1), and over llama.cpp (log)."""
    plt = pyplot()
    conds = list(res["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    panels = ([k for k in RATIOS if "llama" not in k], [k for k in RATIOS if "llama" in k])
    for ax, keys in zip(axes, panels):
        w = 0.8 / len(keys)
        for j, key in enumerate(keys):
            gm = [res["summary"][c]["gmean"].get(key, float("nan")) for c in conds]
            lo = [g - res["summary"][c]["ci95"][key][0] for g, c in zip(gm, conds)]
            hi = [res["summary"][c]["ci95"][key][1] - g for g, c in zip(gm, conds)]
            ax.bar([i + j * w for i in range(len(conds))], gm, w, yerr=[lo, hi], capsize=2,
                   label=key.replace("_over_", " / ").replace("_", "-"))
        ax.axhline(1.0, color="k", lw=0.7)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(conds))], conds, fontsize=8)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("tokens/s ratio, end to end (GMEAN, 95% CI)")
    axes[0].set_ylim(0.8, None)
    axes[1].set_yscale("log")
    path.parent.mkdir(parents=True, exist_ok=True)
    return finish_figure(fig, path, f"memspec bench headline: {res['split']}, "
                                    f"{res['provenance'].get('machine')}")


def main_bench_headline(args: Any) -> int:
    split = args.split or "dev"
    if split not in ("dev", "dev2", "test2"):
        raise ConfigError(f"--split {split} is not a set the headline reads",
                          "use dev (a trial), dev2 (the old test split: a second dev set) "
                          "or test2 (read once)")
    loads = [x.strip() for x in (args.loads or ",".join(LOADS)).split(",") if x.strip()]
    bad = [x for x in loads if x not in LOADS]
    if bad:
        raise ConfigError(f"load(s) {', '.join(bad)} not in the headline",
                          f"use --loads with some of {', '.join(LOADS)}")
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats} is below 1", "use --repeats 1")
    res = run(args.pool, split, args.per_domain or None, args.max_new_tokens or 128,
              kernel_paths(args.isas), loads, args.repeats)
    _print(res)
    save_outputs(res, args, lambda r, folder: plot(r, folder / "headline.png"), indent=1)
    return 0
