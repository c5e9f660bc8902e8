"""The target's greedy trajectories as the runtime commits them: the engine, batch 1.

A head reads the target's features, so its acceptance is only exact on the trajectory of
the target it runs with: the pool's dtype resolved for the device (int4 on a VNNI CPU),
not the fp32 model `memspec trace` batches. Greedy decoding through the engine is
deterministic, so one row per prompt is the trajectory every policy commits for it.
Rows are appended per prompt (resumable), tagged with the dtype and the token budget.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from memspec.common.files import read_jsonl
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.models import encode_prompt


def own_name(target_dir: Path) -> str:
    """"" for the demo target, else the target folder's name: what a brought target's
    training caches (responses, target rows, vocabulary) are named by, so no target reads
    another's."""
    from memspec.common.paths import default_target_dir

    same = Path(target_dir).resolve() == default_target_dir().resolve()
    return "" if same else Path(target_dir).name


def responses_tag(target_dir: Path, dtype: str) -> str:
    """The name part of a target's cached responses (the demo's keep their dtype-only name)."""
    name = own_name(target_dir)
    return f"{dtype}-{name}" if name else dtype


def engine_trajectories(engine: SpecEngine, dtype: str, tokenizer, prompts: Sequence[dict],
                        out: Path, max_new_tokens: int, label: str = "trajectories"
                        ) -> list[dict]:
    """``{"id","domain","prompt_ids","tokens"}`` per prompt (rows made for a larger budget
    are cut to this one: greedy output does not depend on the budget)."""
    done = {k: v for k, v in read_jsonl(out).items()
            if v.get("dtype") == dtype and v.get("max_new_tokens", 0) >= max_new_tokens}
    todo = [p for p in prompts if p["id"] not in done]
    if todo:
        out.parent.mkdir(parents=True, exist_ok=True)
        t0, made = time.perf_counter(), 0
        with out.open("a") as f, torch.inference_mode():
            for i, p in enumerate(todo):
                ids = encode_prompt(tokenizer, p["prompt"])
                tokens, _ = engine.generate(ids, max_new_tokens)
                row = {"id": p["id"], "domain": p.get("domain"), "prompt_ids": ids,
                       "tokens": tokens, "dtype": dtype, "max_new_tokens": max_new_tokens}
                done[p["id"]] = row
                f.write(json.dumps(row) + "\n")
                f.flush()
                made += len(tokens)
                if (i + 1) % 10 == 0 or i + 1 == len(todo):
                    print(f"[{label}] {out.name}: {i + 1}/{len(todo)} prompts, "
                          f"{made / (time.perf_counter() - t0):.0f} tokens/s",
                          file=sys.stderr, flush=True)
    return [dict(done[p["id"]], tokens=done[p["id"]]["tokens"][:max_new_tokens])
            for p in prompts if p["id"] in done]
