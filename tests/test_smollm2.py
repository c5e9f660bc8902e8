"""The real SmolLM2-135M-Instruct target: speculative output equals target-only greedy."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from memspec.common.paths import PACKAGE_ROOT, default_target_dir
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward.checkpoint import load_state_dict
from memspec.procs.decoder.models import (
    build_target,
    encode_prompt,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
)
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

pytestmark = pytest.mark.slow
TARGET = default_target_dir()
PROMPTS = {
    "code": "Write a Python function that returns the factorial of n.",
    "math": "Solve step by step: a farmer has 17 sheep and buys 5 more each week. "
            "How many sheep after 6 weeks?",
    "law": "Explain what the warranty disclaimer in the MIT licence means.",
}


@pytest.fixture(scope="module")
def target():
    if not (TARGET / "config.json").is_file():
        pytest.skip("target not converted: run `memspec zoo target`")
    tok = load_tokenizer(TARGET)
    return load_causal_lm(TARGET), tok, eos_token_ids(TARGET, tok)


@pytest.fixture(scope="module")
def shallow_draft(tmp_path_factory, target):
    """A real small draft: the target's first 3 layers (self-speculation style), in bf16."""
    out = tmp_path_factory.mktemp("shallow")
    cfg = AutoConfig.from_pretrained(TARGET)
    cfg.num_hidden_layers = 3
    cfg.save_pretrained(out)
    sd = load_state_dict(TARGET)  # the target's blocks dequantised
    keep = {k: v.to(torch.bfloat16) for k, v in sd.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < 3}
    keep.pop("lm_head.weight", None)
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TARGET / f, out / f)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_speculative_equals_target_only_on_three_domains(target, shallow_draft, dtype):
    """Lossless in every target precision: each dtype's own greedy output, token for token,
    also when drafts switch every iteration with target-only steps in between."""
    _, tok, eos = target
    eng = SpecEngine(build_target(TARGET, dtype), eos, gamma=4)
    length = 20 if dtype == "float32" else 32  # eager float32 is ~10x slower: same checks
    slot = SlotBuffer(96 << 20)
    eng.add_draft(load_into_slot("shallow", shallow_draft, slot, eng.vocab))
    drafts = ["shallow"]
    general = PACKAGE_ROOT / "drafts" / "general"
    if (general / "model.safetensors").is_file():
        eng.add_draft(load_into_slot("general", general, SlotBuffer(16 << 20), eng.vocab))
        drafts.append("general")
    accepted = dict.fromkeys(drafts, 0)
    for prompt in PROMPTS.values():
        ids = encode_prompt(tok, prompt)
        ref, _ = eng.generate(ids, length)
        for name in drafts:
            out, stats = eng.generate(ids, length, select=lambda s, n=name: n)
            assert out == ref, (name, prompt)
            accepted[name] += stats.summary()["num_accepted_tokens"]
        order = itertools.cycle(drafts + [None])
        out, _ = eng.generate(ids, length, select=lambda s, o=order: next(o))
        assert out == ref, ("switching", prompt)
    assert all(n > 0 for n in accepted.values()), accepted  # the drafts really proposed


def test_generate_json_cli(target, tmp_path):
    pool = tmp_path / "pool.toml"
    pool.write_text(f'[pool]\ntarget = "{TARGET}"\n')
    res = subprocess.run([sys.executable, "-m", "memspec.launch.cli", "generate", "--pool",
                          str(pool), "--policy", "target-only", "--max-new-tokens", "16",
                          "--json", PROMPTS["code"]], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) == {"text", "token_ids", "stats"}
    assert len(out["token_ids"]) == 16 and out["text"]
    for key in ("tokens_per_s_steady", "tokens_per_s_e2e", "num_drafts", "num_draft_tokens",
                "num_accepted_tokens", "mean_acceptance_length", "acceptance_rate", "time",
                "loads", "evictions", "switches", "bytes_loaded", "drafts_used"):
        assert key in out["stats"]
    _, tok, _ = target
    assert tok.decode(out["token_ids"], skip_special_tokens=True) == out["text"]
