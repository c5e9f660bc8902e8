"""Predictor head trainer: label = the draft with the highest utility over the next interval.

Labels come from the acceptance tables (``memspec trace``): at every scheduling point p of a
target greedy trajectory (p generated tokens committed; p = 0, every, 2*every, ...) the label
is the draft that would commit the most tokens over the next N iterations (tie-breaker: the
next 4 intervals); points where every draft ties exactly teach nothing and are skipped.
Three inputs are compared as in the paper's Table 2 (prompt only, recent tokens only,
prompt + recent), one frozen-encoder head each. Honest data only: every choice (the loss,
the head's width) is made by training on `train` and measuring on `dev`; the final heads
are then fitted on `train` + `dev` and measured on `dev2` (the old test split, a second
dev set now) and on the `mixed` workload (answers that cross domains), sets no choice here
ever looked at. Tables and trajectories are
the engine's, in the runtime's target precision (`memspec trace`). Beside the heads: the
"prompt's domain draft" rule (mixed prompts: their listed domains in order, then the
general draft) and the majority rule. The runtime head (what the predictor process loads)
sees what the runtime sends: the prompt alone at p = 0 and prompt + recent text later.

How prompt and recent text are combined is a choice made on dev like the others: one joint
embedding of ``prompt [SEP] recent`` or the two embedded apart (``split`` views, see
procs/predictor/head.py), each with or without *composite* examples: a trajectory's points
again under a prompt that joins its own prompt with another domain's (its own first; the
other first too once there is recent text), so the head learns that a prompt naming two
domains does not say which one the answer is in now, the recent text does. Composites are
built inside each split (train with train, dev with dev); the dev score is the mean top-1
over dev's points as they are and under dev composites, since the runtime serves both.
Inputs are chosen first, then loss and width, each with its early stop (STEP_GRID) on dev.
The sidecar records the pool's fingerprint; the predictor refuses a head trained for another.

    memspec predictor train [--pool P] [--out DIR] [--json]

Without ``--pool`` the head goes to the committed ``predictor/``; with ``--pool P`` it goes
beside P (``P.head.safetensors`` + ``.json``, where the predictor process looks for P's
head), never over the committed one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from memspec.common.config import load_pool
from memspec.common.errors import ConfigError, MemspecError
from memspec.common.paths import DEFAULT_POOL, PACKAGE_ROOT, memspec_home
from memspec.procs.decoder.models import load_tokenizer
from memspec.procs.decoder.oracle.replay import utility_label
from memspec.procs.predictor import DEFAULT_HEAD, pool_head_path
from memspec.procs.predictor.encoder import (
    ENCODER_NAME,
    MAX_PIECES,
    PROMPT_HEAD_FRACTION,
    RECENT_MAX,
    Encoder,
    recent_text,
)
from memspec.procs.predictor.head import VIEWS, RankHead, save_head, split_input
from memspec.zoo.prompts import READ_ONCE
from memspec.zoo.tablestore import (
    TraceTables,
    load_pool_tables,
    pool_fingerprint,
    trajectories_path,
    trajectory_rows,
)
from memspec.zoo.trajectories import read_prompts

TRAINER = "memspec.zoo.train_predictor (utility labels)"
LABELS = ("draft with the highest utility over the next N-iteration interval, from acceptance "
          "tables; tie-breaker: next 4 intervals")
MODES = ("prompt_only", "recent_only", "prompt_recent")
PAPER = {"prompt_only": (0.319, 0.558), "recent_only": (0.571, 0.793),
         "prompt_recent": (0.716, 0.957)}
LOSSES = ("plain", "balanced")
AUGMENTS = ("none", "composite")
STEP_GRID = (25, 50, 100, 200, 400, 800)  # early stops scored on dev (up to --steps)
JOIN = "\n\n"  # between the two prompts of a composite


def log(msg: str) -> None:
    print(f"[predictor train] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Example:
    prompt_id: str
    label: int
    prompt: str
    recent: str  # "" for a prompt-only example


# --------------------------------------------------------------------------- examples


def scheduling_labels(tables_by_draft: Mapping[str, Sequence[int]], names: Sequence[str],
                      length: int, gamma: int, interval: int, every: int
                      ) -> tuple[list[tuple[int, int]], int]:
    """([(position, label index)], exact ties skipped) for p = 0, every, ... < length."""
    ordered = {n: tables_by_draft[n] for n in names}  # ties resolve in pool order
    out, ties = [], 0
    for p in range(0, length, every):
        best = utility_label(ordered, p, gamma, interval=interval)
        if best is None:
            ties += 1
        else:
            out.append((p, list(names).index(best)))
    return out, ties


@dataclass
class ExampleSet:
    """One prompt set's examples per input mode, and what was left out and why."""

    modes: dict[str, list[Example]] = field(default_factory=lambda: {m: [] for m in MODES})
    trajectories: int = 0
    positions: int = 0  # scheduling points with a label
    ties: int = 0  # scheduling points skipped: every draft ties exactly
    blank_recent: int = 0  # p > 0 with whitespace-only recent text: no recent-only example
    missing: list[str] = field(default_factory=list)  # trajectory ids without tables or prompt
    domains: dict[str, str] = field(default_factory=dict)  # prompt id -> domain

    def label_counts(self, names: Sequence[str]) -> dict[str, int]:
        c = Counter(e.label for e in self.modes["prompt_recent"])
        return {n: c.get(i, 0) for i, n in enumerate(names)}

    def counts(self) -> dict[str, object]:
        return {"trajectories": self.trajectories, "positions": self.positions,
                "skipped_ties": self.ties, "blank_recent": self.blank_recent,
                "missing": len(self.missing),
                "examples": {m: len(v) for m, v in self.modes.items()}}


def build_examples(trajectories: Mapping[str, dict], prompts: Mapping[str, str],
                   tables: Mapping[str, dict], names: Sequence[str],
                   recent_of: Callable[[Sequence[int]], str], gamma: int,
                   interval: int, every: int) -> ExampleSet:
    """Examples of all three modes at every scheduling point of every trajectory.

    ``tables`` is ``TraceTables.rows``; ``recent_of`` turns the generated ids so far into a
    snapshot's recent text, as the predictor process does (encoder.recent_text: "" when
    there is none, so recent-only drops those points, and p = 0).
    """
    out = ExampleSet()
    for tid in sorted(trajectories):
        row, prompt = tables.get(tid), prompts.get(tid)
        if row is None or prompt is None:
            out.missing.append(tid)
            continue
        tokens = trajectories[tid]["tokens"]
        length = min(len(tokens), int(row.get("length", len(tokens))))
        points, ties = scheduling_labels(row["tables"], names, length, gamma, interval, every)
        out.trajectories += 1
        out.domains[tid] = row.get("domain", "")
        out.ties += ties
        out.positions += len(points)
        for p, y in points:
            recent = recent_of(tokens[:p])
            out.modes["prompt_only"].append(Example(tid, y, prompt, ""))
            out.modes["prompt_recent"].append(Example(tid, y, prompt, recent))
            if recent:
                out.modes["recent_only"].append(Example(tid, y, "", recent))
            elif p:
                out.blank_recent += 1
    return out


def composite_partners(domains: Mapping[str, str], seed: int) -> dict[str, str]:
    """Each prompt id -> a prompt id of another domain from the same set (seeded, stable
    under adding prompts of other ids); none when the set has one domain."""
    by_domain: dict[str, list[str]] = {}
    for pid in sorted(domains):
        by_domain.setdefault(domains[pid], []).append(pid)
    out = {}
    for pid in sorted(domains):
        others = sorted(d for d in by_domain if d != domains[pid])
        if others:
            rng = random.Random(f"{seed}:{pid}")
            out[pid] = rng.choice(by_domain[rng.choice(others)])
    return out


def composite_examples(examples: Sequence[Example], domains: Mapping[str, str],
                       seed: int = 0) -> list[Example]:
    """The examples again under two-domain prompts: ``own JOIN other`` at every point (the
    answer starts with its own part), ``other JOIN own`` where there is recent text (the
    answer is in its second part). Labels and recent text stay the trajectory's own."""
    prompts = {e.prompt_id: e.prompt for e in examples}
    partners = composite_partners({pid: domains[pid] for pid in prompts}, seed)
    out = []
    for e in examples:
        other = prompts.get(partners.get(e.prompt_id, ""))
        if not e.prompt or other is None:
            continue
        out.append(replace(e, prompt=e.prompt + JOIN + other))
        if e.recent:
            out.append(replace(e, prompt=other + JOIN + e.prompt))
    return out


# --------------------------------------------------------------------------- embeddings


class EmbeddingCache:
    """Embeddings keyed by a hash of (input layout, prompt, recent) under predictor_cache/."""

    SAVE_EVERY_S = 120.0  # an interrupted run keeps most of its work

    def __init__(self, root: Path) -> None:
        self.root = root
        self.file = root / f"{ENCODER_NAME}.safetensors"
        self.keys_file = root / f"{ENCODER_NAME}.keys.json"
        self.table: dict[str, torch.Tensor] = {}
        if self.file.is_file() and self.keys_file.is_file():
            try:
                emb = load_file(str(self.file))["emb"]
                keys = json.loads(self.keys_file.read_text())
                if len(keys) == len(emb):
                    self.table = dict(zip(keys, emb))
            except Exception:  # a damaged cache is only a slower run
                self.table = {}

    @staticmethod
    def key(ex: Example) -> str:
        layout = f"{MAX_PIECES}|{RECENT_MAX}|{PROMPT_HEAD_FRACTION}"
        return hashlib.sha1(f"{layout}\0{ex.prompt}\0{ex.recent}".encode()).hexdigest()

    def missing(self, examples: Sequence[Example]) -> list[Example]:
        """One example per uncached input (many examples share a prompt-only input)."""
        todo: dict[str, Example] = {}
        for ex in examples:
            k = self.key(ex)
            if k not in self.table and k not in todo:
                todo[k] = ex
        return list(todo.values())

    def embed(self, encoder: Encoder | None, examples: Sequence[Example], chunk: int = 64
              ) -> torch.Tensor:
        missing = self.missing(examples)
        if missing:
            if encoder is None:
                raise RuntimeError("encoder not loaded")
            # similar lengths batch together: less padding, same vectors
            missing.sort(key=lambda e: (len(e.prompt) + len(e.recent), self.key(e)))
            t0 = last_save = time.perf_counter()
            for i in range(0, len(missing), chunk):
                part = missing[i:i + chunk]
                emb = encoder.embed([e.prompt for e in part], [e.recent for e in part])
                self.table.update({self.key(e): v for e, v in zip(part, emb)})
                done, now = min(i + chunk, len(missing)), time.perf_counter()
                if done == len(missing) or (i // chunk) % 8 == 7:
                    rate = done / (now - t0)
                    log(f"embedding {done}/{len(missing)} new inputs ({rate:.1f}/s, "
                        f"~{(len(missing) - done) / rate:.0f} s left)")
                if now - last_save > self.SAVE_EVERY_S:
                    self.save()
                    last_save = now
            self.save()
        if not examples:
            return torch.zeros((0, 384))
        return torch.stack([self.table[self.key(ex)] for ex in examples])

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        keys = list(self.table)
        save_file({"emb": torch.stack([self.table[k] for k in keys]).contiguous()}, str(self.file))
        self.keys_file.write_text(json.dumps(keys))


def view_examples(examples: Sequence[Example], views: str) -> list[Example]:
    """The encoder inputs a head of these views reads for ``examples``."""
    if views == "joint":
        return list(examples)
    return [*(replace(e, recent="") for e in examples),
            *(replace(e, prompt="") for e in examples if e.recent)]


def head_inputs(cache: EmbeddingCache, examples: Sequence[Example], views: str) -> torch.Tensor:
    """What a head of these views reads, from cached embeddings, exactly as
    ``Ranker.head_input`` builds it at run time."""
    if views == "joint":
        return cache.embed(None, examples)
    has = [bool(e.recent) for e in examples]
    prompt_emb = cache.embed(None, [replace(e, recent="") for e in examples])
    recent_emb = torch.zeros_like(prompt_emb)
    rows = [i for i, h in enumerate(has) if h]
    if rows:
        recent_emb[rows] = cache.embed(None, [replace(examples[i], prompt="") for i in rows])
    return split_input(prompt_emb, recent_emb, has)


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Data:
    """Tensors for one mode of one set; flags: has recent text (the head's one-hot input)."""

    x: torch.Tensor
    flags: torch.Tensor
    y: torch.Tensor
    ids: tuple[str, ...]

    @classmethod
    def build(cls, cache: EmbeddingCache, examples: Sequence[Example], views: str) -> Data:
        return cls.of(examples, head_inputs(cache, examples, views))

    @classmethod
    def of(cls, examples: Sequence[Example], emb: torch.Tensor) -> Data:
        return cls(emb, torch.tensor([bool(e.recent) for e in examples], dtype=torch.long),
                   torch.tensor([e.label for e in examples], dtype=torch.long),
                   tuple(e.prompt_id for e in examples))

    def subset(self, mask: torch.Tensor) -> Data:
        return Data(self.x[mask], self.flags[mask], self.y[mask],
                    tuple(i for i, m in zip(self.ids, mask.tolist()) if m))


@dataclass(frozen=True)
class TrainConfig:
    loss: str = "plain"  # "plain" or "balanced" (class-weighted) cross-entropy
    hidden: int = 0
    views: str = "joint"  # "joint" or "split" (procs/predictor/head.py)
    augment: str = "none"  # "none" or "composite" (composite_examples)
    steps: int = 400
    lr: float = 0.02
    weight_decay: float = 0.01
    seed: int = 0


def train(head: RankHead, x: torch.Tensor, flags: torch.Tensor, y: torch.Tensor,
          steps: int, lr: float, weight_decay: float, balanced: bool = True,
          tag: str = "", probe: Callable[[int], None] | None = None) -> float:
    """Full-batch AdamW (no sampling: the result depends on the seed only through the
    initial weights and dropout); returns the final loss. ``probe(step)`` runs, in eval
    mode, after each step in STEP_GRID: the head then is exactly the one a run of that many
    steps ends with, so one run scores every early stop."""
    weight = None
    if balanced:
        counts = torch.bincount(y, minlength=len(head.names)).clamp_min(1).float()
        weight = counts.sum() / (len(counts) * counts)
    loss_fn = torch.nn.CrossEntropyLoss(weight=weight)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    head.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(head(x, flags), y)
        loss.backward()
        opt.step()
        if tag and (step + 1) % max(1, steps // 2) == 0:
            log(f"{tag}: step {step + 1}/{steps} loss {loss.item():.4f}")
        if probe is not None and step + 1 in STEP_GRID:
            head.eval()
            probe(step + 1)
            head.train()
    head.eval()
    return float(loss.item())


def fit_head(names: Sequence[str], data: Data, cfg: TrainConfig, tag: str = "",
             probe: Callable[[RankHead, int], None] | None = None) -> tuple[RankHead, float]:
    torch.manual_seed(cfg.seed)
    width = 2 if cfg.views == "split" else 1
    head = RankHead(names, embed_dim=data.x.shape[-1] // width, hidden=cfg.hidden,
                    dropout=0.1 if cfg.hidden else 0.0, views=cfg.views)
    loss = train(head, data.x, data.flags, data.y, cfg.steps, cfg.lr, cfg.weight_decay,
                 balanced=cfg.loss == "balanced", tag=tag,
                 probe=None if probe is None else lambda step: probe(head, step))
    return head, loss


def topk_metrics(head: RankHead, data: Data) -> dict[str, object]:
    """Top-1 accuracy, top-2 recall, and per-label counts (thin classes show up as such)."""
    if len(data.y) == 0:
        return {"top1": None, "top2": None, "n": 0, "n_by_draft": {}}
    with torch.inference_mode():
        order = head(data.x, data.flags).argsort(dim=-1, descending=True)
    return _ranked(order, data.y, head.names)


def majority_baseline(names: Sequence[str], y_train: torch.Tensor, data: Data
                      ) -> dict[str, object]:
    """Always rank drafts by their training-label frequency."""
    freq = torch.bincount(y_train, minlength=len(names)).float()
    order = sorted(range(len(names)), key=lambda i: (-freq[i].item(), i))
    out = {"top1": None, "top2": None}
    if len(data.y):
        out = _ranked(torch.tensor(order).expand(len(data.y), -1), data.y, names)
    return {"top1": out["top1"], "top2": out["top2"], "n": int(len(data.y)),
            "ranking": [names[i] for i in order]}


def domain_rule(examples: Sequence[Example], domains: Mapping[str, str | Sequence[str]],
                draft_index: Mapping[str, int], fallback: Sequence[int] = ()
                ) -> dict[str, object]:
    """"The prompt's domain draft": rank the drafts of the prompt's domain(s) first (a mixed
    prompt lists several, in answer order), then `fallback` (e.g. the general draft, then
    the majority order). The ceiling of a head that only learns domains from the prompt."""
    if not examples:
        return {"top1": None, "top2": None, "n": 0}
    rows = []
    for e in examples:
        doms = domains.get(e.prompt_id, "")
        doms = [doms] if isinstance(doms, str) else list(doms)
        order = list(dict.fromkeys([*(draft_index[d] for d in doms if d in draft_index),
                                    *fallback]))
        order += [i for i in range(max(draft_index.values(), default=-1) + 1)
                  if i not in order]
        rows.append(order)
    width = min(len(r) for r in rows)
    got = _ranked(torch.tensor([r[:width] for r in rows]),
                  torch.tensor([e.label for e in examples]), list(draft_index))
    return {"top1": got["top1"], "top2": got["top2"], "n": got["n"]}


def _ranked(order: torch.Tensor, y: torch.Tensor, names: Sequence[str]) -> dict[str, object]:
    top1 = (order[:, 0] == y).float().mean().item()
    top2 = (order[:, :2] == y[:, None]).any(dim=-1).float().mean().item()
    counts = torch.bincount(y, minlength=len(names)).tolist()
    return {"top1": round(top1, 4), "top2": round(top2, 4), "n": int(len(y)),
            "n_by_draft": {n: c for n, c in zip(names, counts) if c}}


# --------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memspec predictor train",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for head.safetensors + head.json (default: predictor/, or "
                         "with --pool P: beside P as P.head.safetensors)")
    ap.add_argument("--pool", type=Path, default=None,
                    help="pool.toml (default: embedded); its head is written beside it")
    ap.add_argument("--every", type=int, default=4,
                    help="generated tokens between scheduling points")
    ap.add_argument("--train-every", type=int, default=None,
                    help="the same for the train set only (larger: less embedding time; "
                         "default: --every)")
    ap.add_argument("--train-set", default="train,dev",
                    help="traced prompt sets the final heads learn from, comma-separated "
                         "(choices are made training on the first and measuring on `dev`)")
    ap.add_argument("--eval-sets", default="dev2,mixed",
                    help="traced sets the final heads are measured on (never tuned on)")
    ap.add_argument("--T", type=int, default=None, help="recent window (default: pool.T)")
    ap.add_argument("--interval", type=int, default=None,
                    help="label interval in iterations (default: pool.N)")
    ap.add_argument("--loss", choices=["auto", *LOSSES], default="auto",
                    help="auto: the better on dev (trained on the train set)")
    ap.add_argument("--hidden", default="auto",
                    help="MLP width (0: linear head); auto: the best of 0 and 256 on dev")
    ap.add_argument("--views", choices=["auto", *VIEWS], default="auto",
                    help="how the runtime head combines prompt and recent text: one joint "
                         "embedding or two apart (split); auto: the better on dev")
    ap.add_argument("--augment", choices=["auto", *AUGMENTS], default="auto",
                    help="composite: also train on two-domain prompts built within the split; "
                         "auto: the better on dev")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    args = ap.parse_args(argv)
    if args.train_every is None:
        args.train_every = args.every
    if min(args.every, args.train_every) < 1:
        log("error: --every and --train-every must be at least 1; pass a positive stride")
        return 2
    try:
        args.head_file = head_file(args.pool, args.out)
        info = _run(args)
    except MemspecError as exc:
        log(f"error: {exc}")
        return 2
    print(json.dumps(info) if args.json else format_table(info))
    return 0


def head_file(pool: Path | None, out: Path | None) -> Path:
    """Where the trained head goes. A pool's own head lives beside the pool file (the
    predictor finds it there); only the embedded pool's training replaces the committed one."""
    path = (out / "head.safetensors" if out is not None
            else pool_head_path(pool) if pool is not None else DEFAULT_HEAD)
    own_pool = pool is not None and Path(pool).resolve() != DEFAULT_POOL.resolve()
    if own_pool and path.resolve() == DEFAULT_HEAD.resolve():
        raise ConfigError(f"the head for {pool} would replace the committed {DEFAULT_HEAD}",
                          "drop --out (it goes beside the pool) or pick another folder")
    return path


def prompt_texts() -> dict[str, str]:
    """Prompt text by id: the train set and every held-out domain file."""
    out = {}
    for path in sorted((PACKAGE_ROOT / "prompts").glob("*.jsonl")):
        out.update({p["id"]: p["prompt"] for p in read_prompts(path)})
    return out


def _read_set(pool, which: str, names: Sequence[str]) -> tuple[TraceTables, dict[str, dict]]:
    """Tables and trajectories of one prompt set, or a one-line error naming the fix."""
    tables = load_pool_tables(pool, which)  # the engine's, in the runtime's precision
    if tables.drafts != list(names):
        raise ConfigError(f"{which} tables cover drafts {tables.drafts}, the pool has "
                          f"{list(names)}", "run `memspec trace` again")
    path = trajectories_path(pool, which, tables.dtype)
    trajs = trajectory_rows(path, list(tables.rows))
    if not trajs:
        raise ConfigError(f"no {which} trajectories at {path}",
                          f"run `memspec trace --sets {which}` first")
    return tables, trajs


def _examples(which: str, tables: TraceTables, trajs: Mapping[str, dict], names: Sequence[str],
              prompts: Mapping[str, str], tokenizer, T: int, interval: int, every: int
              ) -> ExampleSet:
    got = build_examples(trajs, prompts, tables.rows, names,
                         lambda ids: recent_text(tokenizer, ids, T), tables.gamma,
                         interval, every)
    if got.missing:
        log(f"{which}: {len(got.missing)} trajectories without tables or prompt text skipped "
            f"(e.g. {got.missing[0]})")
    if not got.positions:
        raise ConfigError(f"no labelled scheduling points in the {which} set",
                          "run `memspec trace` again")
    log(f"{which}: {got.trajectories} trajectories, {got.positions} labelled points "
        f"(every {every}), {got.ties} exact ties skipped; "
        + ", ".join(f"{m} {len(v)}" for m, v in got.modes.items()))
    return got


def _prompt_domains() -> dict[str, str | list[str]]:
    """Prompt id -> its domain, or a mixed prompt's domains in answer order."""
    out: dict[str, str | list[str]] = {}
    for path in sorted((PACKAGE_ROOT / "prompts").glob("*.jsonl")):
        for p in read_prompts(path):
            out[p["id"]] = p.get("domains") or p.get("domain", "")
    return out


def _concat(parts: Sequence[Data]) -> Data:
    return Data(torch.cat([d.x for d in parts]), torch.cat([d.flags for d in parts]),
                torch.cat([d.y for d in parts]), tuple(i for d in parts for i in d.ids))


JOINT_ROW = "prompt_recent_joint"  # the old combination, for comparison (never loaded)


def row_mode(row: str) -> str:
    """The input mode a Table 2 row's head reads."""
    return "prompt_recent" if row == JOINT_ROW else row


def cfg_name(cfg: TrainConfig) -> str:
    return f"{cfg.views}/{cfg.augment}/{cfg.loss}/{cfg.hidden}/{cfg.steps}"


@dataclass
class Workspace:
    """Every set's examples, the fit sets' and dev's composites, and the embedding cache."""

    cache: EmbeddingCache
    sets: dict[str, ExampleSet]
    composites: dict[tuple[str, str], list[Example]]  # (set, mode) -> composite examples

    def examples(self, which: str, mode: str, augment: str = "none",
                 natural: bool = True) -> list[Example]:
        extra = self.composites.get((which, mode), []) if augment == "composite" else []
        return [*(self.sets[which].modes[mode] if natural else ()), *extra]

    def data(self, sets: Iterable[str], mode: str, cfg: TrainConfig,
             natural: bool = True) -> Data:
        ex = [e for w in sets for e in self.examples(w, mode, cfg.augment, natural)]
        return Data.build(self.cache, ex, cfg.views)


def candidates(mode: str, base: TrainConfig, losses: Sequence[str], widths: Sequence[int],
               views: Sequence[str], augments: Sequence[str]) -> list[TrainConfig]:
    """The grid one mode chooses from: views only matter with both inputs, composites only
    with a prompt, and with both inputs only split ones (a joint composite re-encodes every
    point's long input twice more; split ones add two prompt embeddings per trajectory)."""
    views = views if mode == "prompt_recent" else ("joint",)
    augments = augments if mode != "recent_only" else ("none",)
    return [replace(base, views=v, augment=a, loss=loss, hidden=w)
            for v in views for a in augments for loss in losses for w in widths
            if not (mode == "prompt_recent" and v == "joint" and a == "composite")]


def dev_score(head: RankHead, ws: Workspace, mode: str, cfg: TrainConfig) -> dict[str, float]:
    """Top-1 on dev as it is and, where the mode has a prompt, under dev composites; the
    score is their mean (the runtime serves one-domain and cross-domain answers alike)."""
    natural = ws.data(["dev"], mode, replace(cfg, augment="none"))
    got = {"dev": topk_metrics(head, natural)["top1"] or 0.0}
    if ws.composites.get(("dev", mode)):
        comp = ws.data(["dev"], mode, replace(cfg, augment="composite"), natural=False)
        got["dev_composite"] = topk_metrics(head, comp)["top1"] or 0.0
    got["score"] = round(sum(got.values()) / len(got), 4)
    return got


def choose_config(names: Sequence[str], ws: Workspace, mode: str, grid: Sequence[TrainConfig],
                  choose_on: Sequence[str]) -> tuple[TrainConfig, dict[str, dict[str, float]]]:
    """The candidate and early stop (STEP_GRID up to its steps) with the best dev score,
    each trained on ``choose_on`` (train) only; ties go to the earlier (simpler, shorter)."""
    scores: dict[str, dict[str, float]] = {}
    best, best_score = grid[0], -1.0
    for cfg in grid:
        stops = [replace(cfg, steps=s) for s in STEP_GRID if s < cfg.steps] + [cfg]

        def probe(head: RankHead, step: int, stops=stops) -> None:
            for stop in stops:
                if stop.steps == step:
                    scores[cfg_name(stop)] = dev_score(head, ws, mode, stop)

        head, _ = fit_head(names, ws.data(choose_on, mode, cfg), cfg, probe=probe)
        if cfg_name(cfg) not in scores:  # --steps outside STEP_GRID
            scores[cfg_name(cfg)] = dev_score(head, ws, mode, cfg)
        for stop in stops:
            got = scores[cfg_name(stop)]
            if got["score"] > best_score + 1e-9:
                best, best_score = stop, got["score"]
    log(f"{mode}: dev scores " + ", ".join(f"{k} {v['score']}" for k, v in scores.items())
        + f"; using {cfg_name(best)}")
    return best, scores


def choose_staged(names: Sequence[str], ws: Workspace, row: str, base: TrainConfig,
                  grid: Mapping[str, Sequence], choose_on: Sequence[str]
                  ) -> tuple[TrainConfig, dict[str, dict[str, float]]]:
    """Inputs first (views, composites) with the first loss and width, then loss and width
    for the chosen inputs: each MLP is fitted once per row, not once per input choice."""
    mode = row_mode(row)
    first = {**grid, "losses": grid["losses"][:1], "widths": grid["widths"][:1]}
    if row == JOINT_ROW:
        first = {**first, "views": ("joint",), "augments": ("none",)}
    inputs, scores = choose_config(names, ws, mode, candidates(mode, base, **first), choose_on)
    second = {**grid, "views": (inputs.views,), "augments": (inputs.augment,)}
    best, more = choose_config(names, ws, mode, candidates(mode, base, **second), choose_on)
    return best, {**scores, **more}


def _grid_args(args: argparse.Namespace) -> dict[str, Sequence]:
    return {"losses": LOSSES if args.loss == "auto" else (args.loss,),
            "widths": (0, 256) if args.hidden == "auto" else (int(args.hidden),),
            "views": VIEWS if args.views == "auto" else (args.views,),
            "augments": AUGMENTS if args.augment == "auto" else (args.augment,)}


def _load_sets(args: argparse.Namespace, pool, names: Sequence[str], fit_sets: Sequence[str],
               eval_sets: Sequence[str]) -> dict[str, ExampleSet]:
    T = args.T if args.T is not None else pool.T
    interval = args.interval or pool.N
    every = {w: args.train_every if w == "train" else args.every
             for w in dict.fromkeys([*fit_sets, "dev", *eval_sets])}
    raw = {w: _read_set(pool, w, names) for w in every}  # first: the likeliest to be missing
    tokenizer = load_tokenizer(pool.target)
    prompts = prompt_texts()
    return {w: _examples(w, *raw[w], names, prompts, tokenizer, T, interval, every[w])
            for w in every}


def build_workspace(sets: dict[str, ExampleSet], fit_sets: Sequence[str],
                    grids: Mapping[str, Sequence[TrainConfig]], seed: int,
                    cache: EmbeddingCache, make_encoder: Callable[[], object] = Encoder
                    ) -> Workspace:
    """Composites of the fit sets and dev, then every input any candidate reads, embedded."""
    comp = {(w, m): composite_examples(sets[w].modes[m], sets[w].domains, seed)
            for w in dict.fromkeys([*fit_sets, "dev"]) for m in MODES if m != "recent_only"}
    ws = Workspace(cache, sets, comp)
    needed = []
    for row, grid in grids.items():
        mode = row_mode(row)
        for cfg in {(c.views, c.augment): c for c in grid}.values():
            for w in sets:
                needed += view_examples(ws.examples(w, mode, cfg.augment), cfg.views)
            # every candidate is scored on dev composites too (dev_score)
            needed += view_examples(ws.examples("dev", mode, "composite", natural=False),
                                    cfg.views)
    todo = ws.cache.missing(needed)
    log(f"{len(todo)} of {len(set(map(ws.cache.key, needed)))} distinct inputs to embed "
        f"({len(ws.cache.table)} cached)")
    ws.cache.embed(make_encoder() if todo else None, todo)
    return ws


def _evaluate(names: Sequence[str], ws: Workspace, heads: Mapping[str, RankHead],
              chosen: Mapping[str, TrainConfig], fit_sets: Sequence[str],
              eval_sets: Sequence[str], pool) -> dict[str, dict[str, object]]:
    """Table 2 per eval set: the three input modes, the runtime head (what the process
    loads: prompt alone at p = 0, prompt + recent later), the old joint combination and
    the two rules."""
    y_fit = ws.data(fit_sets, "prompt_recent", TrainConfig()).y
    majority = majority_baseline(names, y_fit, ws.data(eval_sets[:1], "prompt_recent",
                                                       TrainConfig()))
    fallback = [names.index(pool.general)] + [names.index(n) for n in majority["ranking"]]
    draft_index = {d.domain: i for i, d in enumerate(pool.drafts)}
    domains = _prompt_domains()
    as_is = {r: replace(c, augment="none") for r, c in chosen.items()}  # no composites
    out: dict[str, dict[str, object]] = {}
    for w in eval_sets:
        ev: dict[str, object] = {r: topk_metrics(heads[r], ws.data([w], row_mode(r), as_is[r]))
                                 for r in heads}
        pr = ws.data([w], "prompt_recent", as_is["prompt_recent"])
        runtime = heads["prompt_recent"]
        ev["runtime_head"] = {**ev["prompt_recent"],
                              "at_start": topk_metrics(runtime, pr.subset(pr.flags == 0)),
                              "with_recent": topk_metrics(runtime, pr.subset(pr.flags == 1))}
        ev["domain_rule"] = domain_rule(ws.sets[w].modes["prompt_recent"], domains,
                                        draft_index, fallback)
        ev["majority"] = majority_baseline(names, y_fit, pr)
        for k in (*heads, "domain_rule", "majority"):
            log(f"{w} {k}: top-1 {ev[k]['top1']} top-2 {ev[k]['top2']}")
        out[w] = ev
    return out


def _run(args: argparse.Namespace) -> dict[str, object]:
    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    pool = load_pool(args.pool, check=False)
    names = [d.name for d in pool.drafts]
    if len(names) < 2:
        raise ConfigError("the pool has fewer than two drafts: nothing to rank",
                          "add drafts to pool.toml")
    fit_sets = [w for w in args.train_set.split(",") if w]
    if {"dev2", "mixed", *READ_ONCE} & set(fit_sets):
        raise ConfigError("the predictor must not train on the sets it is measured on "
                          "(dev2, mixed) or on test2", "use --train-set train,dev")
    eval_sets = [w for w in args.eval_sets.split(",") if w]
    if not eval_sets:
        raise ConfigError("no evaluation set", "use --eval-sets dev2,mixed")
    sets = _load_sets(args, pool, names, fit_sets, eval_sets)
    base = TrainConfig(steps=args.steps, lr=args.lr, weight_decay=args.weight_decay,
                       seed=args.seed)
    grid = _grid_args(args)
    grids = {m: candidates(m, base, **grid) for m in MODES}
    grids[JOINT_ROW] = candidates("prompt_only", base, grid["losses"], grid["widths"],
                                  ("joint",), ("none",))
    ws = build_workspace(sets, fit_sets, grids, args.seed,
                         EmbeddingCache(memspec_home() / "predictor_cache"))
    t_embed = time.perf_counter() - t0

    choose_on = [w for w in fit_sets if w != "dev"] or fit_sets[:1]
    chosen, dev_scores, heads, final = {}, {}, {}, {}
    for row in grids:
        mode = row_mode(row)
        chosen[row], dev_scores[row] = choose_staged(names, ws, row, base, grid, choose_on)
        heads[row], final[row] = fit_head(names, ws.data(fit_sets, mode, chosen[row]),
                                          chosen[row], row)
    evaluation = _evaluate(names, ws, heads, chosen, fit_sets, eval_sets, pool)
    info = _info(args, pool, sets, names, fit_sets, eval_sets, chosen, dev_scores, final,
                 evaluation)
    side = save_head(heads["prompt_recent"], args.head_file, info)  # same seed, same files
    wall = {"embed": round(t_embed, 1), "total": round(time.perf_counter() - t0, 1)}
    log(f"wrote {args.head_file} and {side} ({wall['total']} s)")
    return {**info, "wall_s": wall}


def _info(args: argparse.Namespace, pool, sets: Mapping[str, ExampleSet], names: Sequence[str],
          fit_sets: Sequence[str], eval_sets: Sequence[str], chosen: Mapping[str, TrainConfig],
          dev_scores: Mapping, final: Mapping[str, float], evaluation: Mapping) -> dict:
    """The sidecar's training record: data, choices with their dev scores, Table 2."""
    return {
        "trainer": TRAINER, "labels": LABELS, "encoder": ENCODER_NAME,
        "pool": str(pool.source or DEFAULT_POOL), "pool_fingerprint": pool_fingerprint(pool),
        "max_pieces": MAX_PIECES, "T": args.T if args.T is not None else pool.T,
        "N": args.interval or pool.N, "gamma": pool.gamma,
        "train_set": ",".join(fit_sets), "chosen_on": "dev (mean top-1: as is, composites); inputs, then loss and width",
        "eval_sets": list(eval_sets),
        "every": {w: args.train_every if w == "train" else args.every for w in sets},
        "runtime_inputs": "prompt only at p=0 (flag 0), prompt + last T tokens at p>0 (flag 1)",
        "composites": "own prompt + another domain's (both orders once there is recent text), "
                      "within each split; seeded",
        "seed": args.seed, "steps": args.steps, "lr": args.lr,
        "weight_decay": args.weight_decay,
        "config": {m: {"views": c.views, "augment": c.augment, "loss": c.loss,
                       "hidden": c.hidden, "steps": c.steps} for m, c in chosen.items()},
        "dev_top1": dev_scores,
        "final_loss": {m: round(v, 5) for m, v in final.items()},
        "data": {w: s.counts() for w, s in sets.items()},
        "label_distribution": {w: s.label_counts(names) for w, s in sets.items()},
        "evaluation": evaluation,
        "paper": {m: {"top1": a, "top2": b} for m, (a, b) in PAPER.items()},
    }


def _pct(v: object) -> str:
    return "-" if v is None else f"{100 * float(v):5.1f}"


def format_table(info: Mapping) -> str:
    ev, paper = info["evaluation"], info["paper"]
    lines = []
    for w, rows in ev.items():
        lines.append(f"{w:<13} {'top-1':>5} {'top-2':>5} {'n':>6}   {'paper 1/2':>11}")
        for k in (*MODES, JOINT_ROW, "runtime_head", "domain_rule", "majority"):
            if k not in rows:
                continue
            a, p = rows[k], paper.get(k)
            ref = f"{_pct(p['top1'])} {_pct(p['top2'])}" if p else ""
            lines.append(f"{k:<13} {_pct(a['top1'])} {_pct(a['top2'])} "
                         f"{a.get('n', 0) or 0:6d}   {ref}")
    for w, dist in info["label_distribution"].items():
        total = sum(dist.values()) or 1
        lines.append(f"labels {w:<8} " + "  ".join(f"{n} {100 * c / total:.1f}%"
                                                    for n, c in dist.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
