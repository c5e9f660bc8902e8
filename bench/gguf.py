"""`memspec bench gguf`: a brought GGUF, per quant type, as faithful and as fast as llama.cpp?

For each type the demo GGUF is requantised by llama.cpp's own quantiser (llama-cpp-python's
``llama_model_quantize``; cached under ``$MEMSPEC_HOME/gguf/``), converted as a user's file
is (`memspec zoo target --gguf`), and measured side by side in one run:
- fidelity, llama.cpp's method (its ``--kl-divergence``): over >= 3,000 tokens of dev
  prompts in 512-token chunks, the KL divergence of each forward's next-token distribution
  from the reference (the fp32 forward of the file's dequantised weights) and how often its
  top-1 token is the reference's, for memspec's engine in the dtype ``auto`` picks for the
  file and for llama.cpp on the file itself;
- speed, target-only greedy decode (tokens/s over ``--max-new-tokens`` after the README's
  prompt, 2 threads each, median of ``--repeats``, interleaved): memspec's engine and
  llama.cpp's C API on the same file.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from memspec.bench.peers import LlamaCpp
from memspec.common.errors import ConfigError
from memspec.common.machine import machine_info, machine_line
from memspec.common.paths import memspec_home
from memspec.common.plotting import finish_figure, pyplot, save_outputs
from memspec.common.provenance import result_provenance

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "F16")
CHUNK = 512
SCORED_FROM = CHUNK // 2  # as llama.cpp's tool: each row's first half is context only
THREADS = 2


def _log(msg: str) -> None:
    print(f"[bench gguf] {msg}", file=sys.stderr, flush=True)


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError("llama-cpp-python is not installed",
                          "pip install 'memspec[bench]'") from None
    return llama_cpp


def requantised(kind: str) -> Path:
    """The demo GGUF in ``kind``, made once by llama.cpp's quantiser (Q4_1: the file)."""
    from memspec.zoo.target import find_gguf

    src = find_gguf()
    if kind == "Q4_1":
        return src
    out = memspec_home() / "gguf" / src.name.replace(".Q4_1.", f".{kind}.")
    if out.is_file():
        return out
    lc = _llama_cpp()
    out.parent.mkdir(parents=True, exist_ok=True)
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True  # the only source is the Q4_1 file
    params.nthread = THREADS
    tmp = out.with_name(f".{out.name}.tmp")
    _log(f"quantising {src.name} to {kind} with llama.cpp (its log: {out}.log)")
    with open(f"{out}.log", "w") as log:  # its per-tensor lines go to the log, not the screen
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                         ctypes.byref(params))
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    if rc != 0:
        raise ConfigError(f"llama.cpp could not quantise to {kind} (code {rc})",
                          "check the llama-cpp-python version")
    tmp.replace(out)
    return out


def _chunks(tokenizer: Any, n_tokens: int) -> list[list[int]]:
    """Dev prompts, concatenated and cut into CHUNK-token rows (a BOS first)."""
    from memspec.zoo.prompts import load_prompts

    rows = load_prompts("dev", ("general", "code", "math", "law", "medical"), per_domain=40)
    ids: list[int] = []
    for r in rows:
        ids += tokenizer(r["prompt"] + "\n\n")["input_ids"]
        if len(ids) >= 2 * n_tokens + CHUNK:
            break
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else ids[0]
    need = -(-n_tokens // (CHUNK - SCORED_FROM))
    return [[bos, *ids[i * (CHUNK - 1):(i + 1) * (CHUNK - 1)]] for i in range(need)]


def _kld(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, int]:
    """(sum of KL(ref || got), count of same top-1, positions) over a chunk's second half."""
    ref, got = ref[SCORED_FROM:], got[SCORED_FROM:]
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    same = (ref.argmax(-1) == got.argmax(-1)).sum()
    return float(kl.sum()), int(same), ref.shape[0]


class _LlamaLogits:
    """llama.cpp on one file: every row's logits of a chunk, and a greedy decode."""

    def __init__(self, path: Path) -> None:
        lc = _llama_cpp()
        self.llm = lc.Llama(model_path=str(path), n_threads=THREADS, n_threads_batch=THREADS,
                            n_ctx=CHUNK * 2, n_batch=CHUNK, logits_all=True, verbose=False)

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        return torch.from_numpy(self.llm.scores[:len(ids)].copy())



def measure(kind: str, n_tokens: int, max_new: int, repeats: int) -> dict[str, Any]:
    from memspec.procs.decoder.engine import SpecEngine
    from memspec.procs.decoder.forward.precision import resolve_dtype
    from memspec.procs.decoder.forward.threads import apply_threads
    from memspec.procs.decoder.models import build_target, load_causal_lm, load_tokenizer
    from memspec.zoo.target import converted_gguf

    path = requantised(kind)
    folder = converted_gguf(path, progress=False)
    tok = load_tokenizer(folder)
    dtype = resolve_dtype("auto", folder, "cpu")
    apply_threads(THREADS)
    ref_model = load_causal_lm(folder)
    ours = build_target(folder, dtype, prepared=memspec_home())
    peer = _LlamaLogits(path)
    plain = LlamaCpp(THREADS, 4, gguf=path)  # the C API, one row's logits a step
    acc = {"memspec": [0.0, 0, 0], "llama.cpp": [0.0, 0, 0]}
    for chunk in _chunks(tok, n_tokens):
        x = torch.tensor([chunk])
        with torch.inference_mode():
            ref = ref_model(x).logits[0].float()
            mine = ours.forward(x[0], 0, ours.new_cache(CHUNK + 8)).float()
        for name, got in (("memspec", mine), ("llama.cpp", peer.logits(chunk))):
            kl, same, rows = _kld(ref, got)
            acc[name][0] += kl
            acc[name][1] += same
            acc[name][2] += rows
    del ref_model
    fid = {k: {"kld": v[0] / v[2], "same_top1": v[1] / v[2], "tokens": v[2]}
           for k, v in acc.items()}

    from memspec.bench.floor import README_PROMPT
    from memspec.procs.decoder.models import encode_prompt

    prompt = encode_prompt(tok, README_PROMPT)
    engine = SpecEngine(ours, (), gamma=4, max_context=2048)
    speeds: dict[str, list[float]] = {"memspec": [], "llama.cpp": []}
    prefill: dict[str, list[float]] = {"memspec": [], "llama.cpp": []}  # ms, the prompt's
    same_tokens = True
    for _ in range(repeats + 1):  # the first round warms both up and is not counted
        with torch.inference_mode():
            mine_ids, stats = engine.generate(prompt, max_new)
        times: list[float] = []
        peer_ids = plain.greedy(prompt, max_new, set(), times)
        peer_tps = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        same_tokens &= mine_ids[:16] == peer_ids[:16]
        speeds["memspec"].append(stats.report().tokens_per_s_steady)
        speeds["llama.cpp"].append(peer_tps)
        prefill["memspec"].append(1e3 * stats.t_prefill)
        prefill["llama.cpp"].append(plain.perf()["prefill_ms"])  # llama.cpp's own clock
    speed = {k: statistics.median(v[1:]) for k, v in speeds.items()}
    prefill_ms = {k: statistics.median(v[1:]) for k, v in prefill.items()}
    return {"type": kind, "file": path.name, "file_mb": round(path.stat().st_size / 2**20, 1),
            "folder_mb": round(sum(f.stat().st_size for f in folder.iterdir()
                                   if f.is_file()) / 2**20, 1),
            "dtype": dtype, "fidelity": fid,
            # (None where both are below 1e-6: the F16 file, no rounding on either side)
            "kld_ratio": fid["memspec"]["kld"] / fid["llama.cpp"]["kld"]
            if max(fid["memspec"]["kld"], fid["llama.cpp"]["kld"]) >= 1e-6 else None,
            "tokens_per_s": speed,
            "speed_ratio": speed["memspec"] / speed["llama.cpp"],
            # the README prompt's prefill (llama.cpp: llama_perf_context's prompt time):
            # llama.cpp's batched kernels differ by type (tiled for Q4_0 and Q8_0, a dot
            # product per row and column for Q4_1), so its prefill gap is per type too
            "prefill_ms": prefill_ms, "prompt_tokens": len(prompt),
            "llama_cpp_prefill_over_ours": prefill_ms["llama.cpp"] / prefill_ms["memspec"]
            if prefill_ms["memspec"] > 0 else None,
            "first_16_tokens_agree": same_tokens}


def run(types: list[str], n_tokens: int, max_new: int, repeats: int) -> dict[str, Any]:
    from memspec.procs.decoder.forward.native import extension

    ext = extension()
    res: dict[str, Any] = {"machine": machine_line(), "machine_info": machine_info(),
                           "isa": str(ext.kernel_path()) if ext is not None else "pytorch",
                           "threads": THREADS, "tokens": n_tokens,
                           "max_new_tokens": max_new, "repeats": repeats,
                           "llama_cpp": _llama_cpp().__version__, "types": []}
    for i, kind in enumerate(types):
        _log(f"{kind} ({i + 1}/{len(types)})")
        res["types"].append(measure(kind, n_tokens, max_new, repeats))
        r = res["types"][-1]
        _log(f"  {r['dtype']}: KLD {r['fidelity']['memspec']['kld']:.5f} vs llama.cpp "
             f"{r['fidelity']['llama.cpp']['kld']:.5f}; {r['tokens_per_s']['memspec']:.0f} vs "
             f"{r['tokens_per_s']['llama.cpp']:.0f} tok/s")
    res["provenance"] = result_provenance(uses_pool=False)
    return res


def _ratio(x: float | None) -> str:
    return f"{x:6.2f}" if x is not None else f"{'-':>6}"


def format_table(res: dict[str, Any]) -> str:
    lines = [f"brought GGUFs, {res['machine']} ({res['isa']}), {res['threads']} threads, "
             f"KLD over {res['types'][0]['fidelity']['memspec']['tokens'] if res['types'] else 0}"
             " dev tokens against the fp32 forward of each file's weights",
             f"{'type':8} {'MB':>6} {'dtype':6} {'KLD ours':>10} {'llama.cpp':>10} {'ratio':>6} "
             f"{'top-1 ours':>10} {'llama.cpp':>9} {'tok/s ours':>10} {'llama.cpp':>9} "
             f"{'ratio':>6} {'prefill ms ours':>15} {'llama.cpp':>9}"]
    for r in res["types"]:
        f, s = r["fidelity"], r["tokens_per_s"]
        lines.append(f"{r['type']:8} {r['file_mb']:6.1f} {r['dtype']:6} "
                     f"{f['memspec']['kld']:10.5f} {f['llama.cpp']['kld']:10.5f} "
                     f"{_ratio(r['kld_ratio'])} {f['memspec']['same_top1']:10.3f} "
                     f"{f['llama.cpp']['same_top1']:9.3f} {s['memspec']:10.1f} "
                     f"{s['llama.cpp']:9.1f} {r['speed_ratio']:6.2f}"
                     + (f" {r['prefill_ms']['memspec']:15.1f} {r['prefill_ms']['llama.cpp']:9.1f}"
                        if "prefill_ms" in r else ""))  # (results older than the column)
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["type"] for r in res["types"]]
    xs = range(len(names))
    for off, who, color in ((-0.2, "memspec", "C0"), (0.2, "llama.cpp", "C1")):
        a.bar([x + off for x in xs], [r["fidelity"][who]["kld"] for r in res["types"]],
              0.4, label=who, color=color)
        b.bar([x + off for x in xs], [r["tokens_per_s"][who] for r in res["types"]],
              0.4, label=who, color=color)
    for ax, title in ((a, "KL divergence from fp32 (lower is better)"),
                      (b, "target-only decode, tokens/s")):
        ax.set_xticks(list(xs), names, rotation=45, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    a.set_yscale("log")
    path.parent.mkdir(parents=True, exist_ok=True)
    return finish_figure(fig, path, f"brought GGUFs ({res['isa']}, {res['threads']} threads)")


def main_bench_gguf(args: Any) -> int:
    types = [t.strip().upper() for t in (args.types or ",".join(TYPES)).split(",") if t.strip()]
    bad = [t for t in types if t not in TYPES]
    if bad:
        raise ConfigError(f"unknown type {bad[0]}", f"use some of: {', '.join(TYPES)}")
    res = run(types, args.tokens, args.max_new_tokens, args.repeats)
    print(format_table(res))
    save_outputs(res, args, lambda r, folder: plot(r, folder / "gguf.png"), indent=2)
    return 0

