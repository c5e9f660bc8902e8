"""`memspec bench memory`: what memspec holds, per process and per kind of memory, beside
llama.cpp holding the same GGUF.

A `memspec up` (with its defaults: a standby decoder once idle) is measured at
ready and after `--warm-requests` requests of the dev split (the policies in turn), with psutil
`memory_full_info`: RSS, PSS (shared pages split among the processes mapping them, so the
processes' PSS adds up to what the server holds) and USS, and the peak RSS the kernel
recorded (VmHWM). Each process's PSS is split by where its pages are mapped from
(/proc/PID/smaps): the Python heap, anonymous memory (the decoder's packed weights, KV cache
and scratch live there), model and weight files mapped from disk, the drafts' shared-memory
slots, and libraries (torch's among them). llama.cpp: llama-cpp-python in a fresh process
loading the demo GGUF and answering the README's prompt, measured the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from memspec.bench.floor import README_PROMPT, UpProcess
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs
from memspec.common.provenance import provenance

KINDS = ("heap", "anonymous", "model files", "slots", "libraries", "other")
LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=2048, verbose=False)
llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[3]}],
                           max_tokens=int(sys.argv[4]), temperature=0.0)
sys.stdout.write("done\\n")
sys.stdout.flush()
sys.stdin.readline()
"""


def _log(msg: str) -> None:
    print(f"[bench memory] {msg}", file=sys.stderr, flush=True)


def kind_of(path: str) -> str:
    """The kind of memory a mapping is (KINDS)."""
    if path == "[heap]":
        return "heap"
    if path in ("", "[anon]") or path.startswith("[anon:"):
        return "anonymous"
    if path.startswith("/dev/shm/"):
        return "slots"
    if path.endswith((".safetensors", ".gguf", ".bin")):
        return "model files"
    if ".so" in os.path.basename(path):
        return "libraries"
    return "other"


def measure(pid: int) -> dict[str, Any]:
    """RSS / PSS / USS and peak RSS of one process, and its PSS by kind (MB)."""
    p = psutil.Process(pid)
    full = p.memory_full_info()
    kinds = dict.fromkeys(KINDS, 0.0)
    for m in p.memory_maps(grouped=True):
        kinds[kind_of(m.path)] += m.pss / 2**20
    peak = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return {"rss_mb": round(full.rss / 2**20, 1), "pss_mb": round(full.pss / 2**20, 1),
            "uss_mb": round(full.uss / 2**20, 1), "peak_rss_mb": round(peak, 1),
            "pss_by_kind_mb": {k: round(v, 1) for k, v in kinds.items()}}


def _server(rt: Any, supervisor: int) -> dict[str, Any]:
    """Every process of the server (the standby decoder too, when there is one)."""
    st = rt.status()
    out = {"supervisor": measure(supervisor)}
    for name, p in st.procs.items():
        if p.pid:
            out[name] = measure(p.pid)
        if name == "decoder" and p.standby_pid:
            out["standby decoder"] = measure(p.standby_pid)
    return out


def llama_cpp(max_new: int) -> dict[str, Any] | None:
    from memspec.bench import peers
    from memspec.common.config import load_pool
    from memspec.zoo.target import find_gguf

    why = peers.unavailable(load_pool(None).target)
    if why:
        _log(f"llama.cpp left out: {why}")
        return None
    p = subprocess.Popen([sys.executable, "-c", LLAMA, str(find_gguf()), str(peers.threads()),
                          README_PROMPT, str(max_new)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        if p.stdout.readline().strip() != "done":
            return None
        return measure(p.pid)
    finally:
        p.communicate("\n", timeout=30)


def run(pool: str | None, requests: int, max_new: int) -> dict[str, Any]:
    from memspec.launch.api import Runtime
    from memspec.zoo.prompts import DOMAINS, load_prompts

    prompts = [r["prompt"] for r in load_prompts("dev", DOMAINS, 1)]
    policies = ("memspec", "target-only", "general-static")
    with tempfile.TemporaryDirectory(prefix="msb-") as run_dir:
        ep = f"ipc://{run_dir}/m.sock"
        up = UpProcess(["--endpoint", ep] + (["--pool", pool] if pool else []))
        try:
            with Runtime(ep) as rt:
                time.sleep(3.0)  # idle: the standby decoder starts (STANDBY_IDLE_S), settles
                at_ready = _server(rt, up.p.pid)
                for i in range(requests):
                    rt.generate(prompts[i % len(prompts)], max_new_tokens=max_new,
                                policy=policies[i % len(policies)])
                time.sleep(3.0)
                after = _server(rt, up.p.pid)
                isa = rt.status().procs["decoder"].isa
        finally:
            up.stop()
    peer = llama_cpp(max_new)
    total = {w: round(sum(p["pss_mb"] for p in procs.values()), 1)
             for w, procs in (("at_ready", at_ready), ("after_requests", after))}
    return {"provenance": provenance(), "machine": machine_line(),
            "machine_info": machine_info(), "isa": isa,
            "pool": pool or "pool.toml (default)",
            "requests": requests, "max_new_tokens": max_new, "at_ready": at_ready,
            "after_requests": after, "total_pss_mb": total, "llama_cpp": peer}


def format_table(res: dict[str, Any]) -> str:
    after = res["after_requests"]
    lines = [f"memory after {res['requests']} requests, {res['machine']} (MB; PSS adds up "
             "across processes)",
             f"{'process':<16}{'RSS':>8}{'PSS':>8}{'USS':>8}{'peak RSS':>10}   PSS by kind"]
    rows = list(after.items()) + ([("llama.cpp", res["llama_cpp"])] if res["llama_cpp"] else [])
    for name, m in rows:
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in m["pss_by_kind_mb"].items() if v >= 1)
        lines.append(f"{name:<16}{m['rss_mb']:>8.0f}{m['pss_mb']:>8.0f}{m['uss_mb']:>8.0f}"
                     f"{m['peak_rss_mb']:>10.0f}   {kinds}")
    t = res["total_pss_mb"]
    peer = f"; llama.cpp {res['llama_cpp']['pss_mb']:.0f} MB" if res["llama_cpp"] else ""
    lines.append(f"all of memspec: PSS {t['after_requests']:.0f} MB (at ready "
                 f"{t['at_ready']:.0f}){peer}")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    """One stacked bar per process (and llama.cpp): its PSS by kind."""
    from memspec.common.plotting import finish_figure, pyplot

    path.parent.mkdir(parents=True, exist_ok=True)

    plt = pyplot()
    rows = dict(res["after_requests"])
    if res["llama_cpp"]:
        rows["llama.cpp"] = res["llama_cpp"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    names = list(rows)
    left = [0.0] * len(names)
    for kind in KINDS:
        vals = [rows[n]["pss_by_kind_mb"][kind] for n in names]
        ax.barh(names, vals, left=left, label=kind)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("PSS (MB)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return finish_figure(fig, path, f"memory per process ({res['machine']})")


def main_bench_memory(args) -> int:
    res = run(args.pool, args.warm_requests, args.max_new_tokens)
    print(format_table(res))
    save_outputs(res, args, lambda r, folder: plot(r, folder / "memory.png"), indent=2)
    return 0
