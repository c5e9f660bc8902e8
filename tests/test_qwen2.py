"""A Qwen2 target (q/k/v bias) runs the lean forward in every low/half precision, the eager
HF path in float32, and speculative decoding with Qwen2 drafts stays token-identical."""

from __future__ import annotations

import itertools

import pytest
import torch
from tinymodels import byte_tokenizer_json, make_tiny_qwen2, save_model

from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward.lean import LeanLM
from memspec.procs.decoder.forward.runners import HFRunner
from memspec.procs.decoder.models import build_target, load_causal_lm
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

PROMPTS = [[72, 101, 108, 108, 111], [40, 41, 42, 43, 44, 45, 46], [1, 7]]
DTYPES = ["float32", "bfloat16", "int8", "int4", "bfloat16-torch", "int4-torch"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2")
    tok = byte_tokenizer_json()
    save_model(make_tiny_qwen2(0), root / "target", tok)
    save_model(make_tiny_qwen2(0), root / "self", tok)
    save_model(make_tiny_qwen2(1, layers=1), root / "random", tok)
    return root


def _engine(root, dtype: str, names=("self", "random")) -> SpecEngine:
    fmt, _, path = dtype.partition("-")
    target = build_target(root / "target", fmt, fast=path != "torch")
    eng = SpecEngine(target, [], gamma=3)
    for name in names:
        eng.add_draft(load_into_slot(name, root / name, SlotBuffer(1 << 20), eng.vocab))
    return eng


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen2_runs_lean_with_qkv_bias_and_stays_lossless(qwen_dir, dtype):
    eng = _engine(qwen_dir, dtype)
    if dtype == "float32":
        assert isinstance(eng.target, HFRunner)
    else:
        lean = getattr(eng.target, "lean", eng.target)
        assert isinstance(lean, LeanLM) and lean.arch.qkv_bias
        assert (type(eng.target).__name__ == "NativeLM") == (not dtype.endswith("-torch"))
    for draft in eng.drafts.values():  # bf16-free drafts bind as lean forwards too
        assert draft.runner.arch.qkv_bias
    hf = load_causal_lm(qwen_dir / "target") if dtype == "float32" else None
    for prompt in PROMPTS:
        ref, _ = eng.generate(prompt, 30)
        order = itertools.cycle(["self", None, "random", "random"])
        out, stats = eng.generate(prompt, 30, select=lambda s, o=order: next(o))
        assert out == ref
        assert {r.draft for r in stats.records} >= {"self", "random"}
        if hf is not None:
            got = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
            assert ref == got
