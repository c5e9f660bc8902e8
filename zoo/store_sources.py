"""`memspec zoo stores --sources`: what makes a domain datastore worth more than the general one.

MemSpec pays only when the right draft for a domain accepts clearly more than the general
draft there (the paper's drafts differ by ~40%). This measures, on dev, how far our domain
stores are from that and what their worth grows with, each store kind built the same way
and walked by the engine's own proposal chain (context lookup first, gamma as the pool):

- the target's own train responses, at 1/8 .. all of the train prompts (how the gap scales
  with data; a log-linear fit says how much more data a gap of ``TARGET_GAP`` would need);
- all domains' responses in one pooled store (does the domain matter, or only the volume);
- the domain's corpus text alone, and responses with the corpus text added;
- responses with the target's own next token after corpus prefixes added (teacher-forced
  labels: what the target says after domain text, ~3x cheaper per token than generating).

Dev only; dev2 and test2 are never read here. Reads the cached responses `memspec zoo stores` made.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from memspec.common.errors import MemspecError
from memspec.common.metrics import gmean
from memspec.common.paths import memspec_home
from memspec.procs.decoder.drafts.datastore import (
    SEP,
    Datastore,
    StoreParams,
    build_tables,
    next_labels,
    stream,
)
from memspec.zoo.prompts import DOMAINS
from memspec.zoo.stores import N_MIN, RESPONSE_TOKENS, store_walk, walk_figures

FRACTIONS = (0.125, 0.25, 0.5, 1.0)
TARGET_GAP = 1.3  # oracle-static / general-static acceptance the pool would need (gmean)
CORPUS_TOKENS = 3_000_000  # per domain, at most (the corpora hold 1-3M tokens each)
RESPONSE_WEIGHT = 4  # responses repeated beside corpus text, so the target's words lead counts


def log(msg: str) -> None:
    print(f"[zoo:stores:sources] {msg}", file=sys.stderr, flush=True)


def with_labels(tokens: np.ndarray, labels: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    return tokens, next_labels(tokens) if labels is None else labels


def joined(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def window_parts(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced windows as one stream: each window its own document, each position's
    label the target's argmax after it."""
    w = x.shape[0]
    sep = np.full((w, 1), SEP, dtype=np.int64)
    return (np.concatenate([x.astype(np.int64), sep], 1).ravel(),
            np.concatenate([y.astype(np.int64), sep], 1).ravel())


def matrix_figures(sources: dict[str, tuple[np.ndarray, np.ndarray]],
                   walk: Callable[[Datastore | None, str], dict], n_max: int,
                   params: StoreParams) -> dict:
    """Every store on every dev domain: tokens per iteration, own / general, oracle-static /
    general (the best store per domain over the general one), size."""
    stores = {d: Datastore(build_tables(sources[d][0], N_MIN, n_max, params.min_count,
                                        sources[d][1]), params) for d in DOMAINS}
    figs = {d: {e: walk(stores[d], e) for e in DOMAINS} for d in DOMAINS}
    tpi = {d: {e: figs[d][e]["tokens_per_iteration"] for e in DOMAINS} for d in DOMAINS}
    own = {e: tpi[e][e] / tpi["general"][e] for e in DOMAINS}
    ostat = {e: max(tpi[d][e] for d in DOMAINS) / tpi["general"][e] for e in DOMAINS}
    speed = {e: figs[e][e]["speed_over_target"] for e in DOMAINS}
    return {"tokens_per_iteration": tpi, "own_over_general": own,
            "oracle_static_over_general": ostat,
            "oracle_static_over_general_gmean": gmean(list(ostat.values())),
            "own_speed_over_target_gmean": gmean(list(speed.values())),
            "megabytes": {d: stores[d].nbytes / 1e6 for d in DOMAINS}}


def study(distill_windows: int = 100) -> dict:
    """The dev figures of every store source (see the module's docstring)."""
    from memspec.common.config import load_pool
    from memspec.common.files import read_jsonl
    from memspec.zoo.heads_data import work_dir
    from memspec.zoo.prompts import load_prompts

    t0 = time.perf_counter()
    root = memspec_home() / "stores"
    try:
        chosen = json.loads((root / "dev.json").read_text())
    except (OSError, ValueError):
        raise MemspecError(f"no built stores in {root}",
                           "run `memspec zoo stores` first (it makes the responses this reads)"
                           ) from None
    verify, gamma = chosen["verify_over_one_row"], load_pool(None).gamma
    n_max = chosen["chosen"]["n_max"]
    params = StoreParams(chosen["chosen"]["min_count"], chosen["chosen"]["min_conf"])
    dtype = chosen["dtype"]

    def rows(split: str) -> list[dict]:  # the newest row per prompt, in prompt order
        done = read_jsonl(work_dir() / f"responses-{split}-{dtype}.jsonl")
        return [done[p["id"]] for p in load_prompts(split) if p["id"] in done]

    train, dev = rows("train"), rows("dev")
    by = {d: [r for r in dev if r["domain"] == d] for d in DOMAINS}
    if len(dev) < len(load_prompts("dev")) or not all(by.values()) or not train:
        raise MemspecError(f"the train and dev responses in {work_dir()} are not all cached "
                           "(the study reads the dev set the stores were chosen on)",
                           "run `memspec zoo stores --force` (it makes them)")
    dev_tokens = {d: sum(len(r["tokens"][:RESPONSE_TOKENS]) for r in by[d]) for d in DOMAINS}

    def walk(store: Datastore | None, e: str) -> dict:
        return walk_figures([store_walk(r["prompt_ids"], r["tokens"][:RESPONSE_TOKENS], store,
                                        gamma) for r in by[e]], dev_tokens[e], verify)

    resp = {d: [r["prompt_ids"] + r["tokens"][:RESPONSE_TOKENS] for r in train
                if r["domain"] == d] for d in DOMAINS}
    out: dict = {"dtype": dtype, "n_max": n_max, "min_count": params.min_count,
                 "min_conf": params.min_conf, "gamma": gamma,
                 "train_prompts": {d: len(resp[d]) for d in DOMAINS},
                 "dev_prompts": {d: len(by[d]) for d in DOMAINS},
                 "lookup_only": {e: walk(None, e)["tokens_per_iteration"] for e in DOMAINS}}

    scaling = []
    for f in FRACTIONS:
        src = {d: with_labels(stream(resp[d][:max(1, round(len(resp[d]) * f))]))
               for d in DOMAINS}
        fig = matrix_figures(src, walk, n_max, params)
        scaling.append({"fraction": f, **fig})
        log(f"responses x{f:g}: oracle-static / general "
            f"{fig['oracle_static_over_general_gmean']:.3f}")
    out["responses"] = scaling
    xs = [math.log2(r["fraction"]) for r in scaling]
    ys = [r["oracle_static_over_general_gmean"] for r in scaling]
    slope, icpt = np.polyfit(xs, ys, 1)
    out["fit"] = {"per_doubling": float(slope), "at_all": float(icpt),
                  "target": TARGET_GAP,
                  "data_multiple_for_target": (float(2 ** ((TARGET_GAP - icpt) / slope))
                                               if slope > 0 else None)}
    log(f"fit: +{slope:.4f} per doubling of the responses; {TARGET_GAP} would need "
        f"{out['fit']['data_multiple_for_target'] or float('inf'):.3g}x the data")

    full = scaling[-1]["tokens_per_iteration"]
    pooled = Datastore(build_tables(stream([x for d in DOMAINS for x in resp[d]]), N_MIN,
                                    n_max, params.min_count), params)
    out["pooled"] = {e: {"own": full[e][e], "general": full["general"][e],
                         "pooled": walk(pooled, e)["tokens_per_iteration"]} for e in DOMAINS}
    log("own / pooled store: " + ", ".join(
        f"{e} {v['own'] / v['pooled']:.3f}" for e, v in out["pooled"].items()))

    corpus = {d: corpus_stream(d)[:CORPUS_TOKENS] for d in DOMAINS}
    out["corpus_only"] = matrix_figures({d: with_labels(corpus[d]) for d in DOMAINS}, walk,
                                        n_max, params)
    out["responses_and_corpus"] = matrix_figures(
        {d: joined([with_labels(stream(resp[d] * RESPONSE_WEIGHT)), with_labels(corpus[d])])
         for d in DOMAINS}, walk, n_max, params)
    if distill_windows:
        labels = distilled(distill_windows)
        out["distill_windows"] = distill_windows
        out["responses_and_target_labels"] = matrix_figures(
            {d: joined([with_labels(stream(resp[d])), window_parts(*labels[d])])
             for d in DOMAINS}, walk, n_max, params)
    for k in ("corpus_only", "responses_and_corpus", "responses_and_target_labels"):
        if k in out:
            log(f"{k}: oracle-static / general {out[k]['oracle_static_over_general_gmean']:.3f}")
    out["seconds"] = time.perf_counter() - t0
    return out


def corpus_stream(domain: str) -> np.ndarray:
    """The domain's train corpus as target ids (cached by `memspec zoo drafts`' tokeniser)."""
    from memspec.common.config import load_pool
    from memspec.procs.decoder.models import load_tokenizer
    from memspec.zoo.drafts import corpus_tokens

    try:
        return corpus_tokens(domain, load_tokenizer(load_pool(None).target)).astype(np.int64)
    except FileNotFoundError as e:
        raise MemspecError(f"corpus missing: {e}", "run `memspec zoo corpora` first") from None


def distilled(windows: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The target's argmax after every prefix of ``windows`` x 256-token corpus windows per
    domain (the heads' distillation labels, cached and shared with `memspec zoo drafts`).
    They come from the fp32 target, as the heads' do, not the runtime's int4 one: where the
    two argmaxes differ (rarely) a label is not the runtime's token, so this source's figure
    is, if anything, a little low."""
    import torch

    from memspec.common.config import load_pool
    from memspec.procs.decoder.models import load_causal_lm
    from memspec.zoo.drafts import cached_labels, device, target_labels

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    target = None
    for d in DOMAINS:
        got = cached_labels(d, windows)
        if got is not None:
            out[d] = got
            continue
        if target is None:  # loaded only when some domain's labels are not cached
            torch.set_num_threads(max(1, torch.get_num_threads()))
            target = load_causal_lm(load_pool(None).target, device=device())
        out[d] = target_labels(d, corpus_stream(d), target, windows)
    return out


def main_sources(args) -> int:  # noqa: ANN001
    """`memspec zoo stores --sources`: the study, written beside the stores (and drawn)."""
    import contextlib

    if args.distill_windows < 0:
        raise MemspecError(f"--distill-windows {args.distill_windows} is negative",
                           "give 0 (skip the target's labels) or more")
    res = study(args.distill_windows)
    root = memspec_home() / "stores"
    (root / "sources.json").write_text(json.dumps(res, indent=1))
    with contextlib.suppress(MemspecError):  # (matplotlib is an optional extra)
        log(f"plot: {plot(res, root / 'sources.png')}")
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    last = res["responses"][-1]
    print("own store / general store on dev: " + ", ".join(
        f"{e} {last['own_over_general'][e]:.3f}" for e in DOMAINS))
    for k in ("corpus_only", "responses_and_corpus", "responses_and_target_labels"):
        if k in res:
            print(f"{k}: oracle-static / general {res[k]['oracle_static_over_general_gmean']:.3f}"
                  f", own store x target-only (gmean) {res[k]['own_speed_over_target_gmean']:.3f}")
    fit = res["fit"]
    print(f"responses: oracle-static / general {last['oracle_static_over_general_gmean']:.3f}, "
          f"+{fit['per_doubling']:.4f} per doubling of the data; {fit['target']} would need "
          f"{fit['data_multiple_for_target'] or float('inf'):.3g}x the responses")
    return 0


def plot(res: dict, path: Path) -> Path:
    """Left: oracle-static / general against the responses in the stores (the fit drawn on to
    the gap the pool needs). Right: own / general per domain for every source."""
    from memspec.common.plotting import pyplot

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    fr = [r["fraction"] for r in res["responses"]]
    ys = [r["oracle_static_over_general_gmean"] for r in res["responses"]]
    n = res["train_prompts"]["general"]
    a.plot([f * n for f in fr], ys, "o-", label="dev (measured)")
    fit = res["fit"]
    if fit.get("data_multiple_for_target"):
        xs = np.geomspace(fr[0] * n, fit["data_multiple_for_target"] * n, 50)
        a.plot(xs, fit["at_all"] + fit["per_doubling"] * np.log2(xs / n), "--",
               label=f"log-linear fit (+{fit['per_doubling']:.3f} per doubling)")
    a.axhline(fit["target"], color="r", lw=0.8, label=f"needed gap {fit['target']}")
    a.set_xscale("log")
    a.set_xlabel("train prompts per domain in each store (target responses)")
    a.set_ylabel("oracle-static / general store (gmean)")
    a.legend(fontsize=8)
    kinds = [("responses", res["responses"][-1]), ("corpus only", res["corpus_only"]),
             ("responses + corpus", res["responses_and_corpus"])]
    if "responses_and_target_labels" in res:
        kinds.append(("responses + target labels", res["responses_and_target_labels"]))
    w = 0.8 / len(kinds)
    for i, (name, fig_) in enumerate(kinds):
        b.bar(np.arange(len(DOMAINS)) + i * w, [fig_["own_over_general"][e] for e in DOMAINS],
              w, label=name)
    b.axhline(1.25, color="r", lw=0.8)
    b.set_xticks(np.arange(len(DOMAINS)) + 0.4 - w / 2, DOMAINS)
    b.set_ylim(0.9, max(1.35, b.get_ylim()[1]))
    b.set_ylabel("own store / general store on own domain")
    b.legend(fontsize=8)
    fig.suptitle(f"Datastore sources on dev ({res['dtype']} target, gamma {res['gamma']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
