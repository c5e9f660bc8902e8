"""`memspec bench pipeline`: what the three-process design costs, measured side by side.

1. tokens/s of the multi-process pipeline over the in-process engine, same prompts, same
   policy (general-static, draft already resident, no speculation gate in either: the same
   computation), steady;
2. snapshot -> ranking round trip to the predictor process over ZeroMQ;
3. loader fill bandwidth (file -> slot through the loader process) over the raw cold-read
   bandwidth of the same file in this process;
4. interference: decode iterations with the predictor and loader processes busy (a snapshot
   every scheduling interval, loads streaming back to back at the edge-emulated bandwidth)
   over the same iterations with them idle, interleaved per prompt;
5. target-only end to end through the three processes over the engine in process on every
   core (the fastest target-only the machine has): a fresh process's only request and a
   warm `memspec up`, each with its 95% interval against the bound (>= 0.95, lower end).
"""

from __future__ import annotations

import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from memspec.bench.floor import DOMAINS, Server, generate, interleaved, ratio_summary
from memspec.bench.floor import prompts as floor_prompts
from memspec.common.config import load_pool
from memspec.common.machine import machine_info, machine_line
from memspec.common.messages import (
    LOADER_REPLIES,
    PREDICTOR_REPLIES,
    Codec,
    Done,
    Load,
    Loaded,
    LoadFailed,
    Message,
    Ranking,
    Snapshot,
    Submit,
)
from memspec.common.plotting import save_outputs
from memspec.common.safetensors_layout import read_layout
from memspec.common.slotmem import SlotMemory, choose_transport, new_run_token, shm_name
from memspec.common.sockets import configure, recv, send
from memspec.launch.supervisor import Supervisor
from memspec.procs.decoder.forward.threads import decoder_threads
from memspec.procs.decoder.inprocess import build_local, run_request
from memspec.procs.decoder.models import encode_prompt
from memspec.procs.loader.reader import ColdReader
from memspec.zoo.prompts import load_prompts

BOUND = 0.95  # target-only through the pipeline over in process, end to end: the 95%
# interval's lower end must clear it, fresh and warm


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def dev_prompts(n: int) -> list[str]:
    rows = load_prompts("dev", DOMAINS, per_domain=-(-n // len(DOMAINS)))
    by = {d: [r["prompt"] for r in rows if r["domain"] == d] for d in DOMAINS}
    return [by[DOMAINS[i % 5]][i // 5] for i in range(n)]


def _request(sup: Supervisor, prompt: str, policy: str, max_new: int,
             gate: bool | None = None) -> Done:
    msg = sup.run(Submit(req_id=secrets.token_hex(4), prompt=prompt, policy=policy,
                         max_new_tokens=max_new, gate=gate))
    if not isinstance(msg, Done):
        raise RuntimeError(getattr(msg, "message", "no reply"))
    return msg


def _dealer(sup: Supervisor, name: str) -> zmq.Socket:
    sock = configure(sup.ctx.socket(zmq.DEALER))
    sock.connect(sup.ep[name])
    return sock


def _await(sup: Supervisor, sock: zmq.Socket, codec: Codec, kinds: tuple[type, ...]
           ) -> Message:
    while True:
        sup.tick(1)
        if sock.poll(1):
            _, msg = recv(sock, codec)
            if isinstance(msg, kinds):
                return msg


def ranking_round_trip(sup: Supervisor, pool, prompts: list[str], n: int = 20) -> dict:
    sock = _dealer(sup, "predictor")
    rtt, reported = [], []
    for i in range(n):
        t0 = time.perf_counter()
        send(sock, Snapshot(req_id=f"bench{i}", seq=0, prompt=prompts[i % len(prompts)],
                            recent_ids=list(range(100, 100 + pool.T))), flags=0)
        msg = _await(sup, sock, PREDICTOR_REPLIES, (Ranking,))
        rtt.append(time.perf_counter() - t0)
        reported.append(msg.latency_s)  # type: ignore[attr-defined]
    sock.close()
    return {"round_trip_ms": 1e3 * statistics.median(rtt),
            "predictor_compute_ms": 1e3 * statistics.median(reported)}


def fill_vs_cold_read(sup: Supervisor, path: Path, reps: int = 3) -> dict:
    layout = read_layout(path)
    mem = SlotMemory.create(shm_name(new_run_token(), 0), layout.data_size,
                            choose_transport("cpu"))
    sock = _dealer(sup, "loader")
    fills, raws = [], []
    try:
        for r in range(reps):
            t0 = time.perf_counter()
            reader = ColdReader(path, layout.data_offset, layout.data_size)
            for _ in reader:
                pass
            reader.close()
            raws.append(layout.data_size / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            send(sock, Load(slot=0, generation=r + 1, draft="bench", path=str(path),
                            transport=mem.transport, handle=mem.handle, capacity=mem.capacity),
                 flags=0)
            msg = _await(sup, sock, LOADER_REPLIES, (Loaded, LoadFailed))
            if isinstance(msg, LoadFailed):
                raise RuntimeError(msg.reason)
            fills.append(layout.data_size / (time.perf_counter() - t0))
    finally:
        sock.close()
        mem.close()
        mem.unlink()
    return {"file": str(path), "bytes": layout.data_size,
            "fill_MB_s": statistics.median(fills) / 1e6,
            "raw_cold_read_MB_s": statistics.median(raws) / 1e6,
            "fill_over_raw": statistics.median(fills) / statistics.median(raws)}


def _background(endpoints: dict[str, str], draft: str, prompt: str, T: int, interval_s: float,
                bandwidth: float, on: Any, stop: Any) -> None:
    """A stand-in decoder's chatter (own process): one snapshot per scheduling interval to
    the predictor and back-to-back paced loads to the loader, while `on` is set."""
    ctx = zmq.Context()
    pred = configure(ctx.socket(zmq.DEALER))
    pred.connect(endpoints["predictor"])
    load = configure(ctx.socket(zmq.DEALER))
    load.connect(endpoints["loader"])
    layout = read_layout(Path(draft))
    mem = SlotMemory.create(shm_name(new_run_token(), 0), layout.data_size,
                            choose_transport("cpu"))
    gen, seq, loading, next_snap = 0, 0, False, 0.0
    try:
        while not stop.is_set():
            if not on.wait(0.05):
                continue
            now = time.monotonic()
            if now >= next_snap:
                seq += 1
                send(pred, Snapshot(req_id="background", seq=seq, prompt=prompt,
                                    recent_ids=list(range(100 + seq % 7, 100 + seq % 7 + T))))
                next_snap = now + interval_s
            if not loading:
                gen += 1
                send(load, Load(slot=0, generation=gen, draft="background", path=str(draft),
                                transport=mem.transport, handle=mem.handle,
                                capacity=mem.capacity, storage="edge-emulated",
                                bandwidth_bytes_s=bandwidth))
                loading = True
            for sock, codec in ((pred, PREDICTOR_REPLIES), (load, LOADER_REPLIES)):
                while sock.poll(0):
                    _, msg = recv(sock, codec)
                    if isinstance(msg, (Loaded, LoadFailed)):
                        loading = False
            time.sleep(0.002)
    finally:
        mem.close()
        mem.unlink()
        ctx.destroy(linger=0)


def interference(sup: Supervisor, rt, pool, prompts: list[str], max_new: int
                 ) -> dict[str, Any]:
    """Median SD iteration time (general-static, in this process) with the predictor and
    loader busy over the same with them idle, each on the thread count the decoder's loop
    uses then (every core while the helpers rest, one fewer while one works: on all cores
    a busy helper stalls every kernel's barrier, ~4x on 2 cores)."""
    import multiprocessing as mp

    name = pool.general
    rt.ensure_resident(name)

    def iterations(prompt: str) -> list[float]:
        _, stats = rt.engine.generate(encode_prompt(rt.tokenizer, prompt), max_new,
                                      select=lambda s: name)
        return [r.duration for r in stats.records if r.draft]

    probe = statistics.median(iterations(prompts[0]))
    general = pool.draft(pool.general).path / "model.safetensors"
    size = read_layout(general).data_size
    ctx = mp.get_context("spawn")
    on, stop = ctx.Event(), ctx.Event()
    bg = ctx.Process(target=_background, daemon=True, args=(
        {k: sup.ep[k] for k in ("predictor", "loader")}, str(general), prompts[0], pool.T,
        pool.N * probe, size / (pool.load_iter_ratio * probe), on, stop))
    bg.start()
    quiet, busy = [], []
    try:
        for i, p in enumerate(prompts):
            for state in ((False, True) if i % 2 == 0 else (True, False)):
                (on.set if state else on.clear)()
                torch.set_num_threads(decoder_threads()[1 if state else 0])
                time.sleep(0.2)
                (busy if state else quiet).append(statistics.median(iterations(p)))
            _log(f"interference {i + 1}/{len(prompts)}: {busy[-1] / quiet[-1]:.3f}")
    finally:
        torch.set_num_threads(decoder_threads()[0])
        stop.set()
        on.set()
        bg.join(10)
    ratios = [b / q for b, q in zip(busy, quiet)]
    return {"iteration_ms_idle": [1e3 * x for x in quiet],
            "iteration_ms_busy": [1e3 * x for x in busy],
            "busy_over_idle": statistics.geometric_mean(ratios),
            "snapshot_interval_ms": 1e3 * pool.N * probe,
            "load_bandwidth_MB_s": size / (pool.load_iter_ratio * probe) / 1e6}


def run(pool_path: str | None, n_prompts: int, max_new: int, reps: int = 2) -> dict[str, Any]:
    pool = load_pool(pool_path)
    prompts = dev_prompts(n_prompts)
    sup = Supervisor(pool_path)
    try:
        _log("starting the pipeline and an in-process engine")
        sup.start()
        torch.set_num_threads(decoder_threads()[0])  # the decoder's count, helpers idle
        rt = build_local(pool)
        _request(sup, prompts[0], "general-static", 8)  # warm: the general draft resident
        run_request(rt, prompts[0], "general-static", 8)
        inproc, multi = [], []
        for i, p in enumerate(prompts):  # interleaved, so load drift hits both alike
            a = [run_request(rt, p, "general-static", max_new)["stats"]["tokens_per_s_steady"]
                 for _ in range(reps)]
            b = [_request(sup, p, "general-static", max_new, gate=False  # as in process
                          ).stats.tokens_per_s_steady
                 for _ in range(reps)]
            inproc.append(statistics.median(a))
            multi.append(statistics.median(b))
            _log(f"prompt {i + 1}/{len(prompts)}: {multi[-1] / inproc[-1]:.3f}")
        _log("interference of a busy predictor and loader with decode iterations")
        inter = interference(sup, rt, pool, prompts, max_new)
        del rt
        _log("predictor round trip")
        rank = ranking_round_trip(sup, pool, prompts)
        _log("loader fill vs cold read")
        fill = fill_vs_cold_read(sup, pool.target / "model.safetensors")
    finally:
        sup.shutdown()
    ratios = [m / i for m, i in zip(multi, inproc)]
    return {"machine": machine_line(), "machine_info": machine_info(),
            "prompts": n_prompts, "max_new_tokens": max_new,
            "in_process_tok_s": inproc, "pipeline_tok_s": multi,
            "pipeline_over_in_process": statistics.geometric_mean(ratios),
            "target_only_e2e": target_only_e2e(pool_path, n_prompts, max_new, reps),
            "ranking": rank, "fill": fill, "interference": inter}


def target_only_e2e(pool_path: str | None, n_prompts: int, max_new: int, reps: int
                    ) -> dict[str, Any]:
    """target-only end to end through the three processes over the engine in process on
    every core (the fastest target-only this machine has), on the README's prompt and dev
    prompts across the domains, interleaved per prompt as `bench floor` does: as a fresh
    process's only request (`memspec generate` against `--in-process`) and warm (a
    `memspec up` serving only target-only, reached as users reach it, against an engine
    in this process). Each with its 95% interval: the bound is met when its lower end
    clears BOUND."""
    rows = floor_prompts(-(-n_prompts // len(DOMAINS)))[:n_prompts + 1]
    _log(f"target-only end to end, fresh processes: {len(rows)} prompts x {reps}")
    fresh = interleaved(rows, ("target-only", "in-process"), reps,
                        lambda p, policy: generate(p, "target-only", max_new, pool_path,
                                                   in_process=policy == "in-process"),
                        "fresh")
    _log("target-only end to end, warm: a `memspec up` against an in-process engine")
    torch.set_num_threads(decoder_threads()[0])
    local = build_local(load_pool(pool_path), with_drafts=False)
    with tempfile.TemporaryDirectory(prefix="memspec-pipeline-") as tmp:
        server = Server("target-only", pool_path, tmp)
        try:
            server.generate(rows[0]["prompt"], 8)  # its first request is its own warm-up
            server.settle()
            run_request(local, rows[0]["prompt"], "target-only", 8)
            warm = interleaved(
                rows, ("target-only", "in-process"), reps,
                lambda p, policy: server.generate(p, max_new) if policy == "target-only"
                else run_request(local, p, "target-only", max_new), "warm")
        finally:
            server.stop()
    out: dict[str, Any] = {"threads_in_process": decoder_threads()[0], "bound": BOUND,
                           "repeats": reps}
    for phase, runs in (("fresh_process", fresh), ("warm", warm)):
        s = ratio_summary(runs, "target-only", "in-process")
        out[phase] = {"prompts": [r["id"] for r in runs],
                      "pipeline_tok_s": [r["target-only"]["e2e_tok_s"] for r in runs],
                      "in_process_tok_s": [r["in-process"]["e2e_tok_s"] for r in runs],
                      "pipeline_over_in_process": s, "met": s["ci95"][0] >= BOUND,
                      "identical_tokens": all(r["target-only"]["ids"] == r["in-process"]["ids"]
                                              for r in runs)}
    return out


def _plot(res: dict[str, Any], folder: Path) -> Path:
    """Per prompt, target-only through the pipeline over in process, fresh and warm, with
    each phase's geometric mean, 95% interval and the bound."""
    from memspec.common.plotting import pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    t = res["target_only_e2e"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, phase in zip(axes, ("fresh_process", "warm")):
        s = t[phase]["pipeline_over_in_process"]
        ax.bar(range(len(s["per_prompt"])), s["per_prompt"], 0.7, color="tab:blue",
               label="per prompt (median repeat)")
        ax.axhspan(*s["ci95"], color="tab:green", alpha=0.2,
                   label=f"gmean {s['gmean']:.3f}, 95% [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]")
        ax.axhline(s["gmean"], color="tab:green", lw=1)
        ax.axhline(t["bound"], color="r", ls="--", lw=0.8, label=f"bound {t['bound']}")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_xticks(range(len(s["per_prompt"])), [p[-8:] for p in t[phase]["prompts"]],
                      rotation=90, fontsize=6)
        ax.set_ylim(0.6, 1.2)
        ax.set_title(f"{phase.replace('_', ' ')}: target-only e2e, pipeline / in process "
                     f"({t['threads_in_process']} threads)", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(res["machine"], fontsize=9)
    fig.tight_layout()
    out = folder / "bench_pipeline.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main_bench_pipeline(args) -> int:
    res = run(args.pool, args.prompts, args.max_new_tokens, max(1, args.repeats))
    print(f"machine: {res['machine']}")
    print(f"pipeline / in-process tokens/s: {res['pipeline_over_in_process']:.3f} "
          f"(gmean over {res['prompts']} prompts, {res['max_new_tokens']} new tokens)")
    for i, (a, b) in enumerate(zip(res["in_process_tok_s"], res["pipeline_tok_s"])):
        print(f"  prompt {i}: in-process {a:6.1f} tok/s   pipeline {b:6.1f} tok/s   {b / a:.3f}")
    to = res["target_only_e2e"]
    for k, label in (("fresh_process", "fresh process"), ("warm", "warm server")):
        t = to[k]["pipeline_over_in_process"]
        print(f"target-only end to end, pipeline / in-process on {to['threads_in_process']} "
              f"threads ({label}, {len(t['per_prompt'])} prompts x {to['repeats']}): gmean "
              f"{t['gmean']:.3f} [{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}], worst "
              f"{t['min']:.3f}; paired {t['paired_gmean']:.3f}; >= {to['bound']}: "
              f"{'met' if to[k]['met'] else 'NOT met'}; identical tokens "
              f"{to[k]['identical_tokens']}")
    r = res["ranking"]
    print(f"snapshot->ranking round trip: {r['round_trip_ms']:.1f} ms "
          f"(predictor compute {r['predictor_compute_ms']:.1f} ms)")
    f = res["fill"]
    print(f"loader fill {f['fill_MB_s']:.0f} MB/s vs raw cold read {f['raw_cold_read_MB_s']:.0f} "
          f"MB/s of {Path(f['file']).name} ({f['bytes'] / 2**20:.0f} MB): {f['fill_over_raw']:.3f}")
    x = res["interference"]
    print(f"decode iteration with predictor + loader busy / idle: {x['busy_over_idle']:.3f} "
          f"(snapshot every {x['snapshot_interval_ms']:.0f} ms, loads at "
          f"{x['load_bandwidth_MB_s']:.0f} MB/s)")
    save_outputs(res, args, _plot, indent=2)
    return 0
