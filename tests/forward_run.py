"""Greedy tokens and last logits of the native forward, for one prebuilt extension.

Run as a script, on this machine or on another architecture (tests/test_aarch64.py runs it
under qemu-aarch64 with an aarch64 Python and PyTorch): the same HF folder, the same
weight formats, the same prompt, so two runs compare token for token. It imports only the
forward and its weights (no tokenizer, no transformers)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

PROMPT = (1, 5, 9, 17, 33, 65, 4, 8)


def _load(so: Path):
    spec = importlib.util.spec_from_file_location(so.stem, so)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {so}")
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    return ext


def run(model: Path, ext, fmt: str, prompt: list[int] | tuple[int, ...], steps: int) -> dict:
    """Prefill ``prompt`` in one call, then ``steps`` single-token greedy steps."""
    from memspec.procs.decoder.forward.lean import Arch, LeanLM
    from memspec.procs.decoder.forward.native import NativeLM

    arch = Arch.from_config(json.loads((model / "config.json").read_text()))
    weights = load_file(str(model / "model.safetensors"))
    lm = NativeLM(LeanLM.from_weights(arch, weights, fmt, torch.float32), ext)
    cache = lm.new_cache(len(prompt) + steps + 1)
    with torch.inference_mode():
        logits = lm.forward(torch.tensor(list(prompt)), 0, cache, last_only=True)
        tokens: list[int] = []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            logits = lm.forward(torch.tensor(tokens[-1:]), len(prompt) + len(tokens) - 1, cache)
    return {"tokens": tokens, "logits": [float(x) for x in logits[-1]]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", type=Path)
    p.add_argument("extension", type=Path)
    p.add_argument("--formats", default="int4,int8,float32")
    p.add_argument("--prompt", default=",".join(map(str, PROMPT)))
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args(argv)
    ext = _load(a.extension)
    prompt = [int(t) for t in a.prompt.split(",")]
    out = {"machine": platform.machine(), "path": str(ext.kernel_path()),
           "runs": {f: run(a.model, ext, f, prompt, a.steps) for f in a.formats.split(",")}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
