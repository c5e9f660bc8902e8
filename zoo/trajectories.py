"""The target's greedy trajectories for a prompt set, resumable, cached on disk.

With greedy decoding the output is the target's greedy output whatever the draft, so one
trajectory per prompt serves draft training (distillation), acceptance tables and replay.
Two builders: :func:`engine_trajectories` decodes with the runtime's own engine, in the
precision the decoder runs (batch 1, as a request runs), which is what acceptance tables,
oracles and the simulator must replay; :func:`build_trajectories` is the batched fp32
Hugging Face `generate` that draft distillation reads.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from memspec.common.files import read_jsonl
from memspec.procs.decoder.models import encode_prompt, eos_token_ids


def read_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@torch.inference_mode()
def greedy_batch(model, prompt_ids: list[list[int]], max_new_tokens: int,
                 eos: Iterable[int], pad_id: int) -> list[list[int]]:
    """Left-padded batched greedy decoding; each row stops at its first EOS."""
    eos = set(eos)
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad_id, eos_token_id=sorted(eos))
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@torch.inference_mode()
def consistent_prefix(model, prompt: list[int], traj: list[int]) -> list[int]:
    """Keep the trajectory only as far as a batch-1 full forward agrees with it (near-ties)."""
    if not traj:
        return traj
    logits = model(torch.tensor([prompt + traj])).logits[0, len(prompt) - 1:-1]
    agree = (logits.argmax(-1) == torch.tensor(traj)).tolist()
    n = next((i for i, ok in enumerate(agree) if not ok), len(traj))
    return traj[:n]


class Progress:
    """One stderr line every `every_s` seconds: done/total, tokens/s, time left."""

    def __init__(self, tag: str, total: int, every_s: float = 15.0, enabled: bool = True
                 ) -> None:
        self.tag, self.total, self.every_s, self.enabled = tag, total, every_s, enabled
        self.t0 = self.last = time.perf_counter()
        self.done = self.tokens = 0

    def step(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.every_s or self.done == self.total):
            self.last = now
            el = now - self.t0
            left = el / self.done * (self.total - self.done)
            print(f"[{self.tag}] {self.done}/{self.total} prompts, {self.tokens / el:.1f} tok/s,"
                  f" ~{left / 60:.1f} min left", file=sys.stderr, flush=True)


def engine_trajectories(engine, tokenizer, prompts: list[dict], out: Path, dtype: str,
                        max_new_tokens: int = 128, progress: bool = True,
                        on_row=None) -> list[dict]:
    """Target-only greedy decoding through ``engine`` (a SpecEngine in the runtime dtype),
    one prompt at a time; appends ``{"id","domain","prompt_ids","tokens","dtype"}`` rows to
    ``out`` and skips ids already there. ``on_row(row)`` runs after each new row (the tracer
    builds its tables there, so an interrupted trace keeps complete rows)."""
    done = {k: r for k, r in read_jsonl(out).items() if r.get("dtype") == dtype}
    todo = [p for p in prompts if p["id"] not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = Progress(f"trajectories {out.stem}", len(todo), enabled=progress)
    with out.open("a") as f:
        for p in todo:
            ids = encode_prompt(tokenizer, p["prompt"])
            tokens, _ = engine.generate(ids, max_new_tokens)
            row = {"id": p["id"], "domain": p.get("domain"), "prompt_ids": ids,
                   "tokens": tokens, "dtype": dtype}
            f.write(json.dumps(row) + "\n")
            f.flush()
            done[p["id"]] = row
            if on_row is not None:
                on_row(row)
            bar.step(len(tokens))
    return [done[p["id"]] for p in prompts if p["id"] in done]


def build_trajectories(model, tokenizer, model_dir: Path, prompts: list[dict], out: Path,
                       max_new_tokens: int = 128, batch_size: int = 16,
                       progress: bool = True) -> list[dict]:
    """Append ``{"id","domain","prompt_ids","tokens"}`` rows to ``out``, skipping done ids."""
    done = read_jsonl(out)  # a line cut by an interrupted run: that prompt is redone
    todo = [p for p in prompts if p["id"] not in done]
    eos = eos_token_ids(model_dir, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    todo.sort(key=lambda p: len(p["prompt"]))  # similar lengths batch with little padding
    with out.open("a") as f:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            enc = [encode_prompt(tokenizer, p["prompt"]) for p in chunk]
            trajs = greedy_batch(model, enc, max_new_tokens, eos, pad)
            for p, ids, traj in zip(chunk, enc, trajs):
                row = {"id": p["id"], "domain": p.get("domain"), "prompt_ids": ids,
                       "tokens": consistent_prefix(model, ids, traj)}
                done[p["id"]] = row
                f.write(json.dumps(row) + "\n")
            f.flush()
            if progress:
                n = min(start + batch_size, len(todo))
                rate = n / (time.perf_counter() - t0)
                print(f"[trajectories] {n}/{len(todo)} prompts, {rate:.2f} prompts/s",
                      file=sys.stderr, flush=True)
    return [done[p["id"]] for p in prompts if p["id"] in done]
