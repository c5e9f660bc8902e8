"""The `memspec` command. Errors a user can fix print as one line, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from memspec.common.errors import MemspecError


def _add_pool(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", default=None, help="pool.toml (default: the embedded pool)")


def cmd_generate(args: argparse.Namespace) -> int:
    from memspec.common.config import load_pool
    from memspec.procs.decoder.acceptance import SamplingParams
    from memspec.procs.decoder.inprocess import build_local, run_request

    pool = load_pool(args.pool)
    policy = args.policy or pool.policy
    params = SamplingParams(args.temperature, args.top_p, args.seed)
    rt = build_local(pool, with_drafts=policy != "target-only")
    stream = None
    if not args.json:
        def stream(ids: list[int]) -> None:
            sys.stdout.write(rt.tokenizer.decode(ids, skip_special_tokens=True))
            sys.stdout.flush()
    out = run_request(rt, args.prompt, policy, args.max_new_tokens or pool.max_new_tokens,
                      params, stream)
    if args.json:
        print(json.dumps(out))
    else:
        s = out["stats"]
        print(f"\n[{policy}] {s['generated_tokens']} tokens, {s['tokens_per_s_steady']:.1f} tok/s "
              f"steady, {s['tokens_per_s_e2e']:.1f} tok/s e2e, mean acceptance length "
              f"{s['mean_acceptance_length']:.2f}", file=sys.stderr)
    return 0


def cmd_zoo(args: argparse.Namespace) -> int:
    if args.what == "target":
        from memspec.zoo.target import convert_target

        convert_target(force=args.force)
        return 0
    if args.what == "corpora":
        import subprocess

        from memspec.common.paths import PACKAGE_ROOT, memspec_home
        from memspec.zoo.corpora import build_corpora, build_prompts

        subprocess.run(["bash", str(PACKAGE_ROOT / "launch" / "install_corpus_sources.sh")],
                       check=True)
        corpus = memspec_home() / "corpora"
        build_corpora(corpus)
        if args.prompts:
            build_prompts(corpus, PACKAGE_ROOT / "prompts")
        return 0
    if args.what == "drafts":
        from memspec.zoo.drafts import main_drafts

        return main_drafts(args)
    if args.what == "eval":
        from memspec.zoo.evaluate import main_eval

        return main_eval(args)
    raise MemspecError(f"unknown zoo command '{args.what}'", "use target, corpora, drafts or eval")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from memspec.bench.engine import main_bench_engine

        return main_bench_engine(args)
    raise MemspecError(f"unknown benchmark '{args.what}'", "use: memspec bench engine")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="memspec", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="speculative decoding of one prompt")
    _add_pool(g)
    g.add_argument("--policy", default=None, help="target-only | general-static")
    g.add_argument("--max-new-tokens", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    z = sub.add_parser("zoo", help="build models and corpora")
    z.add_argument("what", choices=["target", "corpora", "drafts", "eval"])
    _add_pool(z)
    z.add_argument("--force", action="store_true", help="rebuild even if present")
    z.add_argument("--prompts-per-domain", type=int, default=20)
    z.add_argument("--only", default=None, help="comma-separated draft names (drafts)")
    z.add_argument("--minutes", type=float, default=None, help="training budget per draft")
    z.add_argument("--json", action="store_true")
    z.add_argument("--prompts", action="store_true",
                   help="corpora: also regenerate the committed prompt sets")
    z.set_defaults(func=cmd_zoo)

    b = sub.add_parser("bench", help="benchmarks printed side by side")
    b.add_argument("what", choices=["engine"])
    _add_pool(b)
    b.add_argument("--prompts", type=int, default=3)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--json", default=None, help="also write results to this file")
    b.add_argument("--plots", default=None, help="folder for PNG plots")
    b.set_defaults(func=cmd_bench)
    return ap


def main(argv: list[str] | None = None, run: Callable | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from disk, never a hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        return (run or args.func)(args)
    except MemspecError as exc:
        print(f"memspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
