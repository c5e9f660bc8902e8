"""Training one draft head: batches of target rows, the unrolled loss, a wall-clock loop.

Labels are the target's distribution over the draft vocabulary (its logits restricted to
the draft ids, i.e. renormalised), recomputed from the final-layer stream of each row.
Step s of the training-time test is scored only where the runtime could reach it: rows at
or after the prompt's end, a chain start whose next s tokens are the target's own greedy
choices (always true in responses; checked in corpus text), and a target argmax inside the
draft vocabulary (a proposal can only be an in-vocabulary token). Step weights decay
(EAGLE-3: 0.8^s). Checkpoints are scored on dev by the caller (mean acceptance length
through the engine's runners) and the best one is kept.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from memspec.common.isa import cpu_flags
from memspec.common.machine import machine_line
from memspec.zoo.head_model import TrainableHead
from memspec.zoo.heads_data import Shard

ALL = "*"  # a source spec's domain wildcard


@dataclass(frozen=True)
class HeadPlan:
    """One head's recipe. ``mix``: (source, domain, weight) with source ``responses`` or
    ``corpus`` and domain a name or ``*`` (every domain)."""

    name: str
    minutes: float
    lr: float
    mix: tuple[tuple[str, str, float], ...]
    init_from: str | None = None
    unroll: int = 4  # training-time test steps (gamma)
    step_decay: float = 0.8
    batch_rows: int = 2048  # rows (positions) per batch, sequences padded to the longest
    max_len: int = 384  # sequences longer than this are cut (keeping their response)
    warmup_steps: int = 30
    weight_decay: float = 0.0
    eval_every_s: float = 240.0
    patience: int = 3  # dev evaluations without a new best before stopping
    seed: int = 20261
    max_steps: int | None = None  # a step budget instead of the clock (tests, reruns)
    eval_every_steps: int | None = None
    bf16: bool = True  # matmuls under bf16 autocast (fp32 master weights) where the CPU has
    # bf16 dot products: ~1.8x on AVX-512 BF16; emulated elsewhere, 6-8x slower (AVX2 Zen 3)
    feat_weight: float = 1.0  # output vs the target's last-layer state (normed), as EAGLE
    # softmax over the batch's candidates (the union of every row's target top-k, plus
    # random negatives) instead of the whole draft vocabulary: the LM-head rows are most
    # of the compute, and the target's top-16 hold ~91% of its mass. None: full vocabulary
    candidates: int | None = 16
    negatives: int = 512


@dataclass
class TrainLog:
    name: str
    steps: int = 0
    rows_seen: int = 0
    scored_rows: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time of the training steps (all threads)
    best_step: int = 0
    best_s: float = 0.0
    best_dev: float = 0.0
    evals: list[dict] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    machine: str = ""
    stopped: str = ""


class Batches:
    """Samples padded batches of whole sequences from named row shards."""

    def __init__(self, shards: dict[str, Shard], plan: HeadPlan, layers: Sequence[int],
                 extract_layers: Sequence[int], hidden: int, seed: int) -> None:
        self.plan = plan
        self.rng = np.random.default_rng(seed)
        cols = [np.arange(hidden) + extract_layers.index(li) * hidden for li in layers]
        self.cols = np.concatenate(cols)
        self.last_cols = np.arange(hidden) + extract_layers.index(max(extract_layers)) * hidden
        self.sources: list[tuple[Shard, np.ndarray, float]] = []
        for src, dom, w in plan.mix:
            shard = shards.get(src)
            if shard is None or w <= 0:
                continue
            seqs = np.arange(shard.sequences) if dom == ALL else \
                np.flatnonzero(shard.domain == dom)
            if seqs.size:
                self.sources.append((shard, seqs, w))
        if not self.sources:
            raise ValueError(f"plan {plan.name}: no training rows for {plan.mix}")
        total = sum(w for *_, w in self.sources)
        self.weights = np.asarray([w / total for *_, w in self.sources])

    def draw(self) -> dict[str, torch.Tensor]:
        shard, seqs, _ = self.sources[int(self.rng.choice(len(self.sources), p=self.weights))]
        picks: list[tuple[int, int, int, bool]] = []  # rows a:b, response start, cut
        width = 0
        while True:
            i = int(seqs[self.rng.integers(seqs.size)])
            a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
            st, cut = int(shard.start[i]), max(b - a - self.plan.max_len, 0)
            a, st = a + cut, max(st - cut, 0)  # a long one keeps its end (the response)
            width = max(width, b - a)
            if picks and (len(picks) + 1) * width > self.plan.batch_rows:
                break
            picks.append((a, b, st, cut > 0))
        B, T = len(picks), max(b - a for a, b, *_ in picks)
        inp = np.zeros((B, T), dtype=np.int64)
        nxt = np.zeros((B, T), dtype=np.int64)
        arg = np.full((B, T), -1, dtype=np.int64)
        feat = np.zeros((B, T, self.cols.size), dtype=np.float32)
        last = np.zeros((B, T, self.last_cols.size), dtype=np.float32)
        start = np.zeros(B, dtype=np.int64)
        length = np.zeros(B, dtype=np.int64)
        for k, (a, b, st, cut) in enumerate(picks):
            n = b - a
            inp[k, :n], nxt[k, :n], arg[k, :n] = shard.inp[a:b], shard.nxt[a:b], shard.argmax[a:b]
            block = shard.feat[a:b]
            # position j reads the feature of j-1; the first row of a cut sequence reads the
            # row before the cut, the first of a whole one reads zeros
            if cut:
                feat[k, 0] = shard.feat[a - 1][self.cols]
            feat[k, 1:n] = block[:-1][:, self.cols]
            last[k, :n] = block[:, self.last_cols]
            start[k], length[k] = st, n
        return {"inp": torch.from_numpy(inp), "nxt": torch.from_numpy(nxt),
                "argmax": torch.from_numpy(arg), "feat": torch.from_numpy(feat),
                "last": torch.from_numpy(last), "start": torch.from_numpy(start),
                "length": torch.from_numpy(length)}


def bf16_pays() -> bool:
    """bf16 autocast only where the CPU multiplies bf16 natively (AVX-512 BF16); a
    2048x576 @ 576x1536 linear with its backward: fp32 45-58 ms, bf16 346-360 ms on an AVX2
    Zen 3."""
    return "avx512_bf16" in cpu_flags()


def chain_ok(nxt: torch.Tensor, argmax: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """ok[s][b, p]: the s tokens after row p-s are the target's greedy choices (so a chain
    started at p-s reaches row p at step s with the right inputs)."""
    agree = (nxt == argmax).to(torch.int64)
    run = torch.zeros_like(agree)  # consecutive agreements ending at row q
    run[:, 0] = agree[:, 0]
    for q in range(1, agree.shape[1]):
        run[:, q] = (run[:, q - 1] + 1) * agree[:, q]
    out = [torch.ones_like(agree, dtype=torch.bool)]
    for s in range(1, steps):
        out.append(shift_rows(run, 1) >= s)
    return out


def shift_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], 1)


def head_loss(model: TrainableHead, batch: dict[str, torch.Tensor], to_draft: torch.Tensor,
              plan: HeadPlan) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted soft-label cross-entropy over the unrolled steps; plus per-step top-1
    agreement with the target's argmax (a cheap acceptance proxy)."""
    inp, nxt, arg = batch["inp"], batch["nxt"], batch["argmax"]
    B, T = inp.shape
    rows = torch.arange(T)[None, :]
    real = rows < batch["length"][:, None]
    in_vocab = (arg >= 0) & (to_draft[arg.clamp(min=0)] >= 0)
    base = real & in_vocab
    oks = chain_ok(nxt, arg, plan.unroll)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.bf16 and bf16_pays())
    with autocast:
        outs = model(inp, batch["feat"], plan.unroll)
    valid0 = base & (rows >= batch["start"][:, None])
    with torch.no_grad():
        with autocast:
            tl = model.target_logits(batch["last"][valid0]).float()
        rows_c, cand = model.lm_rows, None
        if plan.candidates and tl.shape[0]:
            cand = torch.cat([tl.topk(min(plan.candidates, tl.shape[1]), -1).indices.flatten(),
                              torch.randint(0, tl.shape[1], (plan.negatives,))]).unique()
            tl, rows_c = tl[:, cand], model.lm_rows[cand]
        lab_full = torch.zeros(B, T, tl.shape[-1])
        lab_full[valid0] = torch.softmax(tl, -1)
        state = model.normed(batch["last"])  # the state the chain should reach at row p
        scale = float((state[valid0] ** 2).mean()) if bool(valid0.any()) else 1.0
    total = torch.zeros(())
    stats: dict[str, float] = {}
    norm = sum(plan.step_decay ** s for s in range(plan.unroll))
    for s, out in enumerate(outs):
        valid = base & (rows - s >= batch["start"][:, None]) & oks[s] & (rows >= s)
        if not bool(valid.any()):
            continue
        hn = model.normed(out[valid])
        with autocast:
            logits = (hn @ rows_c.t()).float()
        target = lab_full[valid]
        ce = -(target * torch.log_softmax(logits, -1)).sum(-1).mean()
        loss = ce
        if plan.feat_weight:
            loss = loss + plan.feat_weight * ((hn - state[valid]) ** 2).mean() / scale
        total = total + (plan.step_decay ** s / norm) * loss
        with torch.no_grad():
            pick = logits.argmax(-1) if cand is None else cand[logits.argmax(-1)]
            hit = (pick == to_draft[arg[valid]]).float().mean()
        stats[f"acc{s}"] = float(hit)
        stats[f"n{s}"] = int(valid.sum())
    return total, stats


def lr_at(plan: HeadPlan, step: int, frac: float) -> float:
    """Linear warm-up, then cosine to 10% over the wall-clock budget."""
    warm = min(1.0, (step + 1) / plan.warmup_steps)
    return plan.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_head(model: TrainableHead, batches: Batches, to_draft: torch.Tensor, plan: HeadPlan,
               evaluate: Callable[[TrainableHead], float],
               on_log: Callable[[str], None]) -> tuple[TrainLog, dict[str, torch.Tensor]]:
    """AdamW on a wall-clock budget with dev checkpoints; returns the best weights.

    ``evaluate`` scores the current weights on dev (mean acceptance length, higher is
    better); it runs every ``eval_every_s`` seconds of training and at the end, and its
    time does not count against the budget (it is reported apart)."""
    torch.manual_seed(plan.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=plan.lr, betas=(0.9, 0.95),
                            weight_decay=plan.weight_decay)
    rec = TrainLog(plan.name, plan=asdict(plan) | {"bf16": plan.bf16 and bf16_pays()},
                   machine=f"{machine_line()}, 1-min load average {os.getloadavg()[0]:.1f} at start")
    best = {k: v.clone() for k, v in model.head_state().items()}
    rec.best_dev = evaluate(model) if plan.init_from else 0.0
    rec.evals.append({"step": 0, "train_s": 0.0, "dev": rec.best_dev})
    on_log(f"start: dev {rec.best_dev:.4f}")
    budget, spent, since_eval, bad = plan.minutes * 60.0, 0.0, 0.0, 0
    ema: dict[str, float] = {}

    def frac() -> float:
        return rec.steps / plan.max_steps if plan.max_steps else spent / budget

    def due() -> bool:
        if frac() >= 1.0:
            return True
        if plan.eval_every_steps:
            return rec.steps % plan.eval_every_steps == 0
        return since_eval >= plan.eval_every_s

    model.train()
    while frac() < 1.0:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = batches.draw()
        for g in opt.param_groups:
            g["lr"] = lr_at(plan, rec.steps, frac())
        loss, stats = head_loss(model, batch, to_draft, plan)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        rec.steps += 1
        rec.rows_seen += int(batch["length"].sum())
        rec.scored_rows += int(stats.get("n0", 0))
        for k, v in {"loss": float(loss.detach()), **stats}.items():
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        dt = time.perf_counter() - t0
        rec.cpu_s += time.process_time() - c0
        spent += dt
        since_eval += dt
        if rec.steps % 20 == 0:
            accs = " ".join(f"{ema[f'acc{s}']:.3f}" for s in range(plan.unroll)
                            if f"acc{s}" in ema)
            on_log(f"step {rec.steps} {spent:.0f}s ({rec.cpu_s:.0f} CPU-s) loss "
                   f"{ema['loss']:.3f} top-1 by step [{accs}] {rec.rows_seen / spent:.0f} rows/s")
        if due():
            since_eval = 0.0
            model.eval()
            score = evaluate(model)
            model.train()
            rec.evals.append({"step": rec.steps, "train_s": round(spent, 1), "dev": score})
            if score > rec.best_dev:
                rec.best_dev, rec.best_step, rec.best_s, bad = score, rec.steps, spent, 0
                best = {k: v.clone() for k, v in model.head_state().items()}
            else:
                bad += 1
            on_log(f"dev at step {rec.steps}: {score:.4f} (best {rec.best_dev:.4f} at "
                   f"step {rec.best_step})")
            if bad >= plan.patience:
                rec.stopped = f"early stop: {bad} dev evaluations without a new best"
                break
    rec.wall_s = spent
    rec.stopped = rec.stopped or "budget"
    model.eval()
    return rec, best


def draft_index(to_target: np.ndarray, target_vocab: int) -> torch.Tensor:
    """Target id -> draft index, -1 outside the draft vocabulary."""
    inv = torch.full((target_vocab,), -1, dtype=torch.long)
    inv[torch.from_numpy(np.asarray(to_target, dtype=np.int64))] = torch.arange(len(to_target))
    return inv
