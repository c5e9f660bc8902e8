"""The committed demo drafts: loadable into a slot, within the size caps, same tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from memspec.common.paths import default_target_dir
from memspec.common.safetensors_layout import read_layout
from memspec.procs.decoder.slots import ID_MAP_KEY, SlotBuffer, load_into_slot
from memspec.zoo.drafts import (
    DRAFT_NAMES,
    MAX_DRAFT_BYTES,
    MAX_POOL_BYTES,
    TARGET_VOCAB,
    drafts_dir,
)

DRAFTS = [drafts_dir() / n for n in DRAFT_NAMES if (drafts_dir() / n).is_dir()]
needs_drafts = pytest.mark.skipif(not DRAFTS, reason="no committed drafts")


def _weights(path: Path) -> Path:
    return path / "model.safetensors"


@pytest.mark.parametrize("path", DRAFTS, ids=lambda p: p.name)
def test_draft_loads_into_a_slot(path: Path) -> None:
    bound = load_into_slot(path.name, path, SlotBuffer(2 * MAX_DRAFT_BYTES),
                           target_vocab=TARGET_VOCAB)
    with torch.inference_mode():
        logits = bound.model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == bound.to_target.numel()
    assert torch.isfinite(logits).all()


@needs_drafts
def test_sizes_within_caps() -> None:
    sizes = {p.name: _weights(p).stat().st_size for p in DRAFTS}
    assert all(s <= MAX_DRAFT_BYTES for s in sizes.values()), sizes
    assert sum(sizes.values()) <= MAX_POOL_BYTES, sizes


@pytest.mark.parametrize("path", DRAFTS, ids=lambda p: p.name)
def test_id_map_is_injective_into_target_vocab(path: Path) -> None:
    layout = read_layout(_weights(path))
    slot = SlotBuffer(layout.data_size)
    bound = load_into_slot(path.name, path, slot, target_vocab=TARGET_VOCAB)
    ids = bound.to_target
    assert ids.dtype == torch.long and ids.dim() == 1
    assert int(ids.min()) >= 0 and int(ids.max()) < TARGET_VOCAB
    assert torch.unique(ids).numel() == ids.numel()
    assert json.loads((path / "config.json").read_text())["vocab_size"] == ids.numel()
    assert ID_MAP_KEY in {e.name for e in layout.tensors}


@pytest.mark.parametrize("path", DRAFTS, ids=lambda p: p.name)
def test_tokenizer_identical_to_target(path: Path) -> None:
    from memspec.common.config import tokenizer_fingerprint

    recorded = json.loads((path / "config.json").read_text())["memspec_tokenizer_sha256"]
    if not (default_target_dir() / "tokenizer.json").is_file():
        pytest.skip("target not converted")
    assert recorded == tokenizer_fingerprint(default_target_dir())


@pytest.mark.parametrize("path", DRAFTS, ids=lambda p: p.name)
def test_model_card_names_seed_steps_wall_time(path: Path) -> None:
    card = (path / "README.md").read_text().lower()
    for word in ("seed", "steps", "wall time", "machine"):
        assert word in card, word


@pytest.mark.slow
@needs_drafts
def test_general_draft_output_equals_target_only() -> None:
    """The trained draft against the runtime's own int4 target (its prepared weights): the
    eager float32 path is checked for losslessness in test_smollm2, at a fraction of the
    tokens, so this one can afford every domain."""
    from memspec.common.paths import memspec_home
    from memspec.procs.decoder.engine import SpecEngine
    from memspec.procs.decoder.models import (
        build_target,
        encode_prompt,
        eos_token_ids,
        load_tokenizer,
    )
    from memspec.zoo.drafts import dev_prompts

    target_dir = default_target_dir()
    if not (target_dir / "model.safetensors").is_file():
        pytest.skip("target not converted")
    if not (drafts_dir() / "general").is_dir():
        pytest.skip("no general draft")
    torch.set_num_threads(2)
    target = build_target(target_dir, "int4", prepared=memspec_home())
    tok = load_tokenizer(target_dir)
    engine = SpecEngine(target, eos_token_ids(target_dir, tok), gamma=4)
    engine.add_draft(load_into_slot("general", drafts_dir() / "general",
                                    SlotBuffer(2 * MAX_DRAFT_BYTES), target_vocab=TARGET_VOCAB))
    seen = set()
    for p in dev_prompts(1):
        ids = encode_prompt(tok, p["prompt"])
        plain, _ = engine.generate(ids, 32)
        spec, _ = engine.generate(ids, 32, select=lambda s: "general")
        assert spec == plain, p["id"]
        seen.add(p["domain"])
    assert len(seen) == 5


def test_response_batches_put_loss_on_response_tokens_only() -> None:
    from memspec.zoo.drafts import Batches, inverse_map

    inv = inverse_map(np.arange(20))
    trajs = {"code": [{"prompt_ids": [1, 2, 3], "tokens": [4, 5, 30]}]}
    b = Batches(inv, {}, trajs, np.random.default_rng(0), 8, 512)
    x, y = b.responses(["code"], 1)
    assert x.tolist() == [[1, 2, 3, 4, 5]]
    assert y.tolist() == [[-100, -100, 4, 5, -100]]  # 30 is outside the draft vocabulary


def test_vocabulary_keeps_forced_tokens_and_reserves_index_zero() -> None:
    from memspec.zoo.drafts import rank_vocabulary

    corpora = {"code": np.array([5, 5, 5, 6, 6, 7], dtype=np.uint16)}
    trajs = [{"prompt_ids": [8], "tokens": [9, 9]}]
    vocab = rank_vocabulary(corpora, trajs, forced=[1, 2], size=5)
    assert vocab[0] == 0 and set(vocab[1:3]) == {1, 2}
    assert len(set(vocab.tolist())) == 5 and 9 in vocab
