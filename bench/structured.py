"""`memspec bench json`: structured output (a JSON schema on every request) through the three
processes, beside constrained target-only and llama.cpp under the same schema.

Per dev prompt (>= 20: every domain), the prompt asks for JSON with its domain's schema
(`SCHEMAS`), and the request carries that schema as its response format. Interleaved per
prompt (order rotated), each on the same `memspec up`: memspec and target-only under the
schema (on a CPU memspec runs as lookup-only there: the decoder says why), memspec without it (free text: what the schema costs or saves), and
llama.cpp (llama-cpp-python, the same GGUF, greedy, its JSON-schema grammar), quiet and
beside one busy core (`--loads`). Reported: whether every output parses and validates
(jsonschema), end-to-end tokens/s, the ratios with 95% intervals (bench/stats.py), the
grammar's own time per token against a target step, and the tokens the grammar forced.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memspec.bench.contention import Load, gmean
from memspec.bench.floor import UpProcess, prompts
from memspec.bench.peers import order, unavailable
from memspec.common.errors import MemspecError
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs
from memspec.common.provenance import provenance

# under a grammar on a CPU memspec is served as lookup-only (procs/decoder/service.py), so
# lookup-only's own run is the same policy: left out; memspec's stats name what ran
OURS = ("memspec", "target-only", "memspec-free")
PEER = "llama.cpp"
SETTLE_S = 0.3  # unmeasured, before each run

def _str(n: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def _list(item: dict[str, Any], n: int) -> dict[str, Any]:
    return {"type": "array", "items": item, "maxItems": n}


# one schema per domain, what a user of that domain would ask a model to fill in; each
# one's longest answer (~500 characters) fits the default 512 new tokens even at a token a
# character (digits are single tokens), so an answer that is not valid JSON is the
# grammar's fault, never the budget's
SCHEMAS: dict[str, dict[str, Any]] = {
    "code": _obj({"function_name": _str(40), "code": _str(300), "explanation": _str(150)}),
    "math": _obj({"steps": _list(_str(100), 4), "final_answer": _str(40)}),
    "general": _obj({"summary": _str(240), "key_points": _list(_str(80), 3)}),
    "law": _obj({"summary": _str(200), "protects": _str(60),
                 "obligations": _list(_str(80), 3)}),
    "medical": _obj({"feature": _str(60), "description": _str(240),
                     "causes": _list(_str(40), 4),
                     "severity": {"enum": ["mild", "moderate", "severe"]}}),
}
# ratios: (numerator, denominator); the bound is memspec over constrained target-only
PAIRS = {"memspec_over_target_only": ("memspec", "target-only"),
         "memspec_over_memspec_free": ("memspec", "memspec-free"),
         "memspec_over_llama_cpp": ("memspec", PEER),
         "target_only_over_llama_cpp": ("target-only", PEER)}
BOUND = ("memspec_over_target_only", 1.3)
GRAMMAR_SHARE_BOUND = 0.10  # the grammar's time per token over a target step


def _log(msg: str) -> None:
    print(f"[bench json] {msg}", file=sys.stderr, flush=True)


def json_prompts(per_domain: int) -> list[dict[str, Any]]:
    """Dev prompts (no README prompt: it is no JSON task), each asking for its domain's
    schema's keys in words too, as a user of a small model does."""
    out = []
    for p in prompts(per_domain)[1:]:
        schema = SCHEMAS[p["domain"]]
        keys = ", ".join(schema["properties"])
        out.append({**p, "prompt": f"{p['prompt']}\n\nAnswer in JSON with the keys: {keys}.",
                    "schema": schema})
    return out


def valid(text: str, schema: dict[str, Any]) -> bool:
    """Does `text` parse as JSON that the schema accepts?"""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class _Peer:
    """llama.cpp through llama-cpp-python on the pool's GGUF: greedy chat under the schema
    (its own JSON-schema-to-grammar), every core."""

    def __init__(self, gguf: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                         n_ctx=4096, verbose=False)

    def run(self, prompt: str, schema: dict[str, Any], max_new: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = self.llm.create_chat_completion(
            messages=[{"role": "user", "content": prompt}], max_tokens=max_new,
            temperature=0.0, response_format={"type": "json_object", "schema": schema})
        secs = time.perf_counter() - t0
        text = r["choices"][0]["message"]["content"] or ""
        return {"tokens": r["usage"]["completion_tokens"], "seconds": secs, "text": text}


def _ours(rt: Any, variant: str, p: dict[str, Any], max_new: int) -> dict[str, Any]:
    from memspec.common.metrics import as_json

    policy = variant.removesuffix("-free")
    schema = None if variant.endswith("-free") else p["schema"]
    t0 = time.perf_counter()
    r = rt.generate([{"role": "user", "content": p["prompt"]}], max_new_tokens=max_new,
                    policy=policy, json_schema=schema)
    secs = time.perf_counter() - t0
    st = as_json(r.stats)
    return {"tokens": st["generated_tokens"], "seconds": secs, "text": r.text,
            "e2e_s": st["time"]["e2e"], "grammar_s": st["grammar_s"],
            "forced": st["forced_tokens"], "drafts": st["drafts_used"], "ran": st["policy"],
            "ids": r.token_ids, "finish": r.finish_reason}


def run(pool: str | None, per_domain: int, max_new: int, loads: Sequence[str]
        ) -> dict[str, Any]:
    from memspec.bench import peers
    from memspec.common.config import load_pool
    from memspec.launch.api import Runtime

    cfg = load_pool(pool)
    rows = json_prompts(per_domain)
    why_not = unavailable(cfg.target)
    peer = None
    if why_not is None:
        peer = _Peer(peers.source_gguf(cfg.target), peers.threads())
    else:
        _log(f"llama.cpp left out: {why_not}")
    variants = [*OURS, *([PEER] if peer is not None else [])]
    status: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="msj-") as run_dir:
        ep = f"ipc://{run_dir}/m.sock"
        up = UpProcess(["--endpoint", ep] + (["--pool", pool] if pool else []))
        try:
            with Runtime(ep) as rt:
                # one-off costs off the clock: the grammar's vocabulary (built at the first
                # constrained request), the first request's caches, llama.cpp's grammar
                _ours(rt, "memspec", rows[0], 16)
                if peer is not None:
                    peer.run(rows[0]["prompt"], rows[0]["schema"], 16)
                st = rt.status()
                status = {"isa": st.procs["decoder"].isa, "dtype": st.procs["decoder"].dtype}
                for load_name in loads:
                    load = Load(load_name)
                    try:
                        for i, p in enumerate(rows):
                            runs = p.setdefault("runs", {}).setdefault(load_name, {})
                            for v in order(i, variants):
                                time.sleep(SETTLE_S)
                                runs[v] = peer.run(p["prompt"], p["schema"], max_new) \
                                    if v == PEER else _ours(rt, v, p, max_new)
                                runs[v]["valid"] = valid(runs[v]["text"], p["schema"])
                            _log(f"{load_name} {i + 1}/{len(rows)} {p['id']}: " + ", ".join(
                                f"{v} {r['tokens'] / r['seconds']:.0f} tok/s"
                                f"{'' if r['valid'] else ' (invalid)'}"
                                for v, r in runs.items()))
                    finally:
                        load.stop()
        finally:
            up.stop()
    for p in rows:
        for runs in p["runs"].values():
            for r in runs.values():
                r.pop("ids", None)
    return {"provenance": provenance(), "machine": machine_line(),
            "machine_info": machine_info(), **status, "pool": pool or "pool.toml (default)",
            "max_new_tokens": max_new, "loads": list(loads), "variants": variants,
            "summary": summarise(rows, loads, variants), "prompts": rows}


def summarise(rows: list[dict[str, Any]], loads: Sequence[str], variants: Sequence[str]
              ) -> dict[str, Any]:
    from memspec.bench.stats import headline_ratios

    out: dict[str, Any] = {}
    strata = {r["id"]: r["domain"] for r in rows}
    for load in loads:
        runs = {v: {r["id"]: [(r["runs"][load][v]["tokens"], r["runs"][load][v]["seconds"])]
                    for r in rows if v in r["runs"].get(load, {})} for v in variants}
        gm, ci = headline_ratios(runs, strata, PAIRS)
        rate = {v: gmean([t / s for (t, s), in runs[v].values() if s > 0 and t > 0])
                for v in variants}
        validity = {v: sum(r["runs"][load][v]["valid"] for r in rows) / len(rows)
                    for v in variants if v != "memspec-free"}
        # the grammar's time per emitted token, against what a target step costs here
        # (constrained target-only's seconds per token: one step each)
        grammar_tok = [r["runs"][load][v]["grammar_s"] / r["runs"][load][v]["tokens"]
                       for r in rows for v in ("memspec", "target-only")
                       if r["runs"][load][v]["tokens"]]
        step = [r["runs"][load]["target-only"]["e2e_s"] / r["runs"][load]["target-only"]["tokens"]
                for r in rows if r["runs"][load]["target-only"]["tokens"]]
        forced = sum(r["runs"][load]["memspec"]["forced"] for r in rows)
        tokens = sum(r["runs"][load]["memspec"]["tokens"] for r in rows)
        name, bound = BOUND
        out[load] = {"tok_s_gmean": rate, "ratios": gm, "ci95": ci, "valid": validity,
                     "grammar_ms_per_token": 1e3 * statistics.fmean(grammar_tok),
                     "target_step_ms": 1e3 * statistics.median(step),
                     "grammar_share_of_step": statistics.fmean(grammar_tok)
                     / statistics.median(step),
                     "forced_share": forced / tokens if tokens else 0.0,
                     "bound": {name: bound, "met": bool(ci.get(name, [math.nan])[0] >= bound)}}
    return out


def format_table(res: dict[str, Any]) -> str:
    lines = [f"structured output (JSON schema), {res['machine']} ({res['isa']}), "
             f"{len(res['prompts'])} dev prompts, {res['max_new_tokens']} new tokens at most"]
    for load, s in res["summary"].items():
        lines.append(f"-- {load}: end-to-end tok/s (gmean) " + ", ".join(
            f"{v} {r:.1f}" for v, r in s["tok_s_gmean"].items()))
        for k, g in s["ratios"].items():
            lo, hi = s["ci95"][k]
            lines.append(f"   {k:<32}{g:6.3f}  [{lo:.3f}, {hi:.3f}]")
        lines.append("   valid JSON: " + ", ".join(f"{v} {x:.0%}" for v, x in s["valid"].items()))
        lines.append(f"   grammar {s['grammar_ms_per_token']:.3f} ms a token = "
                     f"{s['grammar_share_of_step']:.1%} of a target step "
                     f"({s['target_step_ms']:.2f} ms); forced {s['forced_share']:.0%} of "
                     "memspec's tokens")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    from memspec.common.plotting import finish_figure, pyplot

    path.parent.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    loads = list(res["summary"])
    variants = res["variants"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(loads)
    for j, load in enumerate(loads):
        rates = [res["summary"][load]["tok_s_gmean"].get(v, 0.0) for v in variants]
        ax.bar([i + j * width for i in range(len(variants))], rates, width, label=load)
    ax.set_xticks([i + width * (len(loads) - 1) / 2 for i in range(len(variants))])
    ax.set_xticklabels(variants, rotation=15)
    ax.set_ylabel("end-to-end tokens/s (gmean)")
    ax.legend()
    return finish_figure(fig, path, f"JSON-schema requests ({res['isa']})")


def main_bench_json(args: Any) -> int:
    loads = [x for x in (args.loads or "quiet,busy1").split(",") if x]
    bad = [x for x in loads if x not in ("quiet", "busy1", "busy2")]
    if bad:
        raise MemspecError(f"unknown load {bad[0]!r}", "use quiet, busy1 or busy2")
    res = run(args.pool, args.per_domain, args.max_new_tokens, loads)
    print(format_table(res))
    save_outputs(res, args, lambda r, folder: plot(r, folder / "json.png"), indent=2)
    return 0
