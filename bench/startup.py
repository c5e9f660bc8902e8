"""`memspec bench startup`: how long a user waits for the first answer, and where it goes.

Side by side in one run, the ways interleaved per repeat (order rotated), the README's
prompt, each timed by this process from the command's spawn to its first printed text and
to its exit (what a user at a terminal waits):
- `fresh`: `memspec generate --fresh` (three processes started for the one request);
- `reused`: `memspec generate` answered by a running `memspec up` with the same pool;
- `llama.cpp`: llama-cpp-python in a fresh process, importing, loading the same GGUF and
  streaming the same chat (its template from the file), greedy, every core.
Then the running server's start-up per process (spawn -> Ready) and the decoder's own
phases (`memspec status --json`). Every command runs with a private XDG_RUNTIME_DIR, so a
server the user runs on the default endpoint is neither used nor disturbed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memspec.bench.floor import README_PROMPT, UpProcess
from memspec.common.errors import MemspecError
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs
from memspec.common.provenance import provenance

MEMSPEC = [sys.executable, "-m", "memspec"]
WAYS = ("fresh", "reused", "llama.cpp")
# llama.cpp's whole path in one fresh process: import, load, the chat streamed
LLAMA = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]),
            n_threads_batch=int(sys.argv[2]), n_ctx=2048, verbose=False)
for c in llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[3]}],
                                    max_tokens=int(sys.argv[4]), temperature=0.0, stream=True):
    piece = c["choices"][0]["delta"].get("content")
    if piece:
        sys.stdout.write(piece)
        sys.stdout.flush()
"""


def _log(msg: str) -> None:
    print(f"[bench startup] {msg}", file=sys.stderr, flush=True)


def timed(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """`cmd` from its spawn to its first byte on stdout and to its exit."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = p.stdout.read1(1)
    ttft = time.monotonic() - t0
    rest = p.stdout.read()
    err = p.stderr.read()
    p.wait()
    total = time.monotonic() - t0
    if p.returncode:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise MemspecError(f"{' '.join(cmd[2:4])} failed (exit {p.returncode}): {tail[0][:300]}",
                           "run it alone to see why")
    return {"first_text_s": round(ttft, 4), "total_s": round(total, 4),
            "text": (first + rest).decode(errors="replace").strip(),
            "reused": b"using the server at" in err}


def _status(env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([*MEMSPEC, "status", "--json"], capture_output=True, text=True,
                         env=env, timeout=60)
    if out.returncode:
        raise MemspecError(f"memspec status failed: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def run(pool: str | None, repeats: int, max_new: int) -> dict[str, Any]:
    from memspec.bench import peers
    from memspec.common.config import load_pool
    from memspec.zoo.target import find_gguf

    pool_args = ["--pool", pool] if pool else []
    gen = [*MEMSPEC, "generate", "--max-new-tokens", str(max_new), *pool_args, README_PROMPT]
    cmds = {"fresh": gen[:4] + ["--fresh"] + gen[4:], "reused": gen}
    why_not = peers.unavailable(load_pool(pool).target)
    if why_not is None:
        cmds["llama.cpp"] = [sys.executable, "-c", LLAMA, str(find_gguf()),
                             str(peers.threads()), README_PROMPT, str(max_new)]
    else:
        _log(f"llama.cpp left out: {why_not}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="msb-") as rt:
        env = {**os.environ, "XDG_RUNTIME_DIR": rt}
        _log("starting a memspec up for the reused runs")
        t0 = time.monotonic()
        up = UpProcess(pool_args, env={"XDG_RUNTIME_DIR": rt})
        up_ready_s = time.monotonic() - t0
        try:
            status = _status(env)
            ways = list(cmds)
            for i in range(repeats):
                for way in ways[i % len(ways):] + ways[:i % len(ways)]:
                    r = timed(cmds[way], env)
                    if way == "reused" and not r["reused"]:
                        raise MemspecError("memspec generate did not use the running server",
                                           "see `memspec status` for its pool")
                    rows.append({"way": way, "repeat": i, **r})
                    _log(f"{i + 1}/{repeats} {way}: first text {r['first_text_s']:.2f} s, "
                         f"exit {r['total_s']:.2f} s")
        finally:
            up.stop()
    med = {w: {k: round(statistics.median(r[k] for r in rows if r["way"] == w), 4)
               for k in ("first_text_s", "total_s")} for w in cmds}
    procs = {n: {"ready_s": p.get("ready_s", 0.0), "startup": p.get("startup", {})}
             for n, p in status["procs"].items()}
    texts = {w: {r["text"] for r in rows if r["way"] == w} for w in ("fresh", "reused")}
    return {"provenance": provenance(), "machine": machine_line(),
            "machine_info": machine_info(), "isa": status["procs"]["decoder"].get("isa", ""),
            "pool": pool or "pool.toml (default)", "max_new_tokens": max_new,
            "repeats": repeats, "prompt": README_PROMPT, "median": med,
            "same_text_fresh_reused": texts["fresh"] == texts["reused"]
            and len(texts["fresh"]) == 1,
            "up_ready_s": round(up_ready_s, 3), "procs": procs, "rows": rows}


def format_table(res: dict[str, Any]) -> str:
    lines = [f"start-up, {res['machine']} ({res['isa']}), median of {res['repeats']}, "
             f"README prompt, {res['max_new_tokens']} new tokens",
             f"{'way':<12}{'first text s':>14}{'exit s':>10}"]
    for way, m in res["median"].items():
        lines.append(f"{way:<12}{m['first_text_s']:>14.2f}{m['total_s']:>10.2f}")
    lines.append("a running server's processes, spawn -> Ready: " + ", ".join(
        f"{n} {p['ready_s']:.2f} s" for n, p in res["procs"].items()))
    split = res["procs"].get("decoder", {}).get("startup", {})
    if split:
        lines.append("the decoder's phases: " + ", ".join(
            f"{k} {v:.2f}" for k, v in split.items() if v >= 0.01))
    lines.append(f"fresh and reused gave the same text: {res['same_text_fresh_reused']}")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> Path:
    from memspec.common.plotting import finish_figure, pyplot

    path.parent.mkdir(parents=True, exist_ok=True)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ways = list(res["median"])
    first = [res["median"][w]["first_text_s"] for w in ways]
    rest = [res["median"][w]["total_s"] - f for w, f in zip(ways, first)]
    ax.barh(ways, first, label="to the first text")
    ax.barh(ways, rest, left=first, label="to the exit")
    ax.set_xlabel("seconds from the command's start")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    return finish_figure(fig, path, f"start-up ({res['isa']}, {res['max_new_tokens']} tokens)")


def main_bench_startup(args) -> int:
    res = run(args.pool, args.repeats, args.max_new_tokens)
    print(format_table(res))
    save_outputs(res, args, lambda r, folder: plot(r, folder / "startup.png"), indent=2)
    return 0
