"""INTERIM head trainer: label = the draft whose domain matches the training prompt's domain.

The evaluation issue replaces these labels with per-interval utility from acceptance tables;
until then this gives the predictor process a real, committed head. Inputs are the prompt
alone and ``prompt [SEP] last T generated tokens`` windows, taken every ``--every`` generated
tokens of the target's greedy trajectories (``$MEMSPEC_HOME/traces/train.jsonl``, whatever
part of it exists). Accuracy is measured on held-out *training* prompts (split by prompt id,
stratified by domain); the held-out evaluation prompt sets are never read here.

    python -m memspec.procs.predictor.train_head [--out predictor/]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from memspec.common.config import load_pool
from memspec.common.errors import MemspecError
from memspec.common.paths import PACKAGE_ROOT, memspec_home
from memspec.procs.predictor.encoder import (
    ENCODER_NAME,
    MAX_PIECES,
    PROMPT_HEAD_FRACTION,
    RECENT_MAX,
    Encoder,
    decode_recent,
)
from memspec.procs.predictor.head import RankHead, save_head

TRAINER = "memspec.procs.predictor.train_head (interim: domain labels)"


def log(msg: str) -> None:
    print(f"[train_head] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Example:
    prompt_id: str
    label: int
    prompt: str
    recent: str  # "" for a prompt-only example


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a writer still running) is skipped."""
    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def split_ids(prompts: list[dict], heldout: float, seed: int) -> set[str]:
    """Held-out prompt ids: a seeded, per-domain share so every domain is measured."""
    by_domain: dict[str, list[str]] = defaultdict(list)
    for p in prompts:
        by_domain[p["domain"]].append(p["id"])
    rng = random.Random(seed)
    out: set[str] = set()
    for domain in sorted(by_domain):
        ids = sorted(by_domain[domain])
        rng.shuffle(ids)
        out.update(ids[:max(1, round(heldout * len(ids)))])
    return out


def build_examples(prompts: list[dict], traces: list[dict], labels: dict[str, int],
                   tokenizer, T: int, every: int) -> tuple[list[Example], list[Example]]:
    """(prompt-only examples, prompt+recent window examples)."""
    text = {p["id"]: p for p in prompts}
    only = [Example(p["id"], labels[p["domain"]], p["prompt"], "")
            for p in prompts if p["domain"] in labels]
    windows = []
    for tr in traces:
        p = text.get(tr.get("id"))
        if p is None or p["domain"] not in labels or tokenizer is None:
            continue
        toks = tr.get("tokens") or []
        for t in range(every, len(toks) + 1, every):
            recent = decode_recent(tokenizer, toks[max(0, t - T):t])
            if recent.strip():
                windows.append(Example(p["id"], labels[p["domain"]], p["prompt"], recent))
    return only, windows


class EmbeddingCache:
    """Embeddings keyed by a hash of (input layout, prompt, recent) under predictor_cache/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.file = root / f"{ENCODER_NAME}.safetensors"
        self.keys_file = root / f"{ENCODER_NAME}.keys.json"
        self.table: dict[str, torch.Tensor] = {}
        if self.file.is_file() and self.keys_file.is_file():
            from safetensors.torch import load_file

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

    def embed(self, encoder: Encoder | None, examples: list[Example], chunk: int = 64
              ) -> torch.Tensor:
        missing = [ex for ex in dict.fromkeys(examples) if self.key(ex) not in self.table]
        if missing:
            if encoder is None:
                raise RuntimeError("encoder not loaded")
            t0 = time.perf_counter()
            for i in range(0, len(missing), chunk):
                part = missing[i:i + chunk]
                emb = encoder.embed([e.prompt for e in part], [e.recent for e in part])
                self.table.update({self.key(e): v for e, v in zip(part, emb)})
                done = min(i + chunk, len(missing))
                log(f"embedded {done}/{len(missing)} new inputs "
                    f"({done / (time.perf_counter() - t0):.1f}/s)")
            self.save()
        return torch.stack([self.table[self.key(ex)] for ex in examples])

    def save(self) -> None:
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        keys = list(self.table)
        save_file({"emb": torch.stack([self.table[k] for k in keys]).contiguous()}, str(self.file))
        self.keys_file.write_text(json.dumps(keys))


def train(head: RankHead, x: torch.Tensor, flags: torch.Tensor, y: torch.Tensor,
          steps: int, lr: float, weight_decay: float) -> float:
    """Full-batch AdamW with class-balanced cross-entropy; returns the final loss."""
    counts = torch.bincount(y, minlength=len(head.names)).clamp_min(1).float()
    loss_fn = torch.nn.CrossEntropyLoss(weight=counts.sum() / (len(counts) * counts))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    head.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        opt.zero_grad()
        loss = loss_fn(head(x, flags), y)
        loss.backward()
        opt.step()
        if (step + 1) % max(1, steps // 4) == 0:
            log(f"step {step + 1}/{steps} loss {loss.item():.4f}")
    head.eval()
    return float(loss.item())


def topk_metrics(head: RankHead, x: torch.Tensor, flags: torch.Tensor, y: torch.Tensor
                 ) -> dict[str, object]:
    """Top-1 accuracy, top-2 recall, and per-label counts (thin domains show up as such)."""
    if len(y) == 0:
        return {"top1": None, "top2": None, "n": 0, "n_by_draft": {}}
    with torch.inference_mode():
        order = head(x, flags).argsort(dim=-1, descending=True)
    top1 = (order[:, 0] == y).float().mean().item()
    top2 = (order[:, :2] == y[:, None]).any(dim=-1).float().mean().item()
    counts = torch.bincount(y, minlength=len(head.names)).tolist()
    return {"top1": round(top1, 4), "top2": round(top2, 4), "n": int(len(y)),
            "n_by_draft": {n: c for n, c in zip(head.names, counts) if c}}


def _tensors(examples: list[Example], emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    flags = torch.tensor([bool(e.recent) for e in examples], dtype=torch.long)
    return emb, flags, torch.tensor([e.label for e in examples], dtype=torch.long)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=PACKAGE_ROOT / "predictor",
                    help="folder for head.safetensors + head.json (default: predictor/)")
    ap.add_argument("--pool", type=Path, default=None, help="pool.toml (default: embedded)")
    ap.add_argument("--prompts", type=Path, default=PACKAGE_ROOT / "prompts" / "train.jsonl")
    ap.add_argument("--traces", type=Path, default=None,
                    help="greedy trajectories (default: $MEMSPEC_HOME/traces/train.jsonl)")
    ap.add_argument("--every", type=int, default=16, help="generated tokens between windows")
    ap.add_argument("--T", type=int, default=None, help="recent window (default: pool.T)")
    ap.add_argument("--heldout", type=float, default=0.2, help="share of prompts held out")
    ap.add_argument("--hidden", type=int, default=0, help="MLP width (0: linear head)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except MemspecError as exc:
        log(f"error: {exc}")
        return 2


def _run(args: argparse.Namespace) -> int:
    from memspec.procs.decoder.models import load_tokenizer

    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    pool = load_pool(args.pool, check=False)
    names = [d.name for d in pool.drafts]
    labels = {d.domain: i for i, d in enumerate(pool.drafts)}
    T = args.T if args.T is not None else pool.T
    prompts = [p for p in read_jsonl(args.prompts) if p.get("domain") in labels]
    traces_path = args.traces or memspec_home() / "traces" / "train.jsonl"
    traces = read_jsonl(traces_path)
    log(f"{len(prompts)} training prompts, {len(traces)} trajectories from {traces_path}")
    tokenizer = None
    if traces:
        try:
            tokenizer = load_tokenizer(pool.target)
        except MemspecError as exc:
            log(f"no target tokenizer ({exc}); training on prompt-only inputs")
    held = split_ids(prompts, args.heldout, args.seed)
    only, windows = build_examples(prompts, traces, labels, tokenizer, T, args.every)
    log(f"{len(only)} prompt-only inputs, {len(windows)} prompt+recent windows "
        f"(T={T}, every {args.every}); {len(held)} prompts held out")

    cache = EmbeddingCache(memspec_home() / "predictor_cache")
    examples = only + windows
    need = any(EmbeddingCache.key(e) not in cache.table for e in examples)
    encoder = Encoder() if need else None
    emb = cache.embed(encoder, examples)
    is_held = torch.tensor([e.prompt_id in held for e in examples])
    x, flags, y = _tensors(examples, emb)

    head = RankHead(names, hidden=args.hidden, dropout=0.1 if args.hidden else 0.0)
    final_loss = train(head, x[~is_held], flags[~is_held], y[~is_held],
                       args.steps, args.lr, args.weight_decay)
    accuracy = {}
    for kind, sel in (("prompt_only", flags == 0), ("prompt_recent", flags == 1)):
        m = is_held & sel
        accuracy[kind] = topk_metrics(head, x[m], flags[m], y[m])
        log(f"held-out {kind}: top-1 {accuracy[kind]['top1']} top-2 {accuracy[kind]['top2']} "
            f"(n={accuracy[kind]['n']}: {accuracy[kind]['n_by_draft']})")
    info = {
        "trainer": TRAINER, "labels": "domain of the training prompt",
        "encoder": ENCODER_NAME, "max_pieces": MAX_PIECES, "T": T, "every": args.every,
        "seed": args.seed, "steps": args.steps, "lr": args.lr,
        "weight_decay": args.weight_decay, "final_loss": round(final_loss, 5),
        "data": {"prompts": len(prompts), "heldout_prompts": len(held),
                 "trajectories": len(traces), "windows": len(windows)},
        "heldout_accuracy": accuracy,
    }
    side = save_head(head, args.out / "head.safetensors", info)
    log(f"wrote {args.out / 'head.safetensors'} and {side}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
