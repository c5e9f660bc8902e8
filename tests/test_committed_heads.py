"""The committed draft heads (drafts/heads): within the caps, loadable through an engine,
documented, and lossless on the real target with the context lookup on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memspec.common.paths import PACKAGE_ROOT, default_target_dir
from memspec.zoo.heads import HEAD_NAMES, MAX_HEAD_BYTES, MAX_POOL_BYTES

HEADS = [PACKAGE_ROOT / "drafts" / "heads" / n for n in HEAD_NAMES
         if (PACKAGE_ROOT / "drafts" / "heads" / n / "model.safetensors").is_file()]
LONG = PACKAGE_ROOT / "drafts" / "heads" / "general-long"  # pools/heads-long.toml's general
needs_heads = pytest.mark.skipif(not HEADS, reason="no committed heads")


@needs_heads
def test_sizes_within_caps() -> None:
    sizes = {p.name: (p / "model.safetensors").stat().st_size for p in HEADS}
    assert all(s <= MAX_HEAD_BYTES for s in sizes.values()), sizes
    assert sum(sizes.values()) <= MAX_POOL_BYTES, sizes
    assert {p.name for p in HEADS} == set(HEAD_NAMES)


@needs_heads
def test_the_long_head_is_within_its_cap_and_checked() -> None:
    """The longer-trained general head: its manifest matches, and its record holds the
    run it went on from."""
    from memspec.common.manifest import read_manifest, verify

    assert (LONG / "model.safetensors").stat().st_size <= MAX_HEAD_BYTES
    verify(read_manifest(LONG), docs=True)
    rec = json.loads((LONG / "training.json").read_text())
    assert rec["plan"]["init_from"] == "general@previous" and rec["continues"]["steps"] > 0
    assert rec["best_dev"] > rec["evals"][0]["dev"]


@pytest.mark.parametrize("path", [*HEADS, LONG], ids=lambda p: p.name)
def test_card_and_config(path: Path) -> None:
    card = (path / "README.md").read_text().lower()
    for word in ("seed", "steps", "wall time", "machine", "dev"):
        assert word in card, word
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["memspec_kind"] == "head"


@needs_heads
@pytest.mark.parametrize("pool_file, names", [("heads.toml", ("general", "code", "medical")),
                                              ("heads-long.toml", ("general",))])
def test_heads_are_lossless_on_the_real_target_with_lookup(pool_file: str,
                                                          names: tuple[str, ...]) -> None:
    from memspec.common.config import load_pool
    from memspec.procs.decoder.models import encode_prompt, open_engine
    from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

    if not (default_target_dir() / "model.safetensors").is_file():
        pytest.skip("target not converted")
    pool = load_pool(PACKAGE_ROOT / "pools" / pool_file)
    assert pool.lookup >= 1
    eng, tok, _ = open_engine(pool)
    for d in pool.drafts:
        eng.add_draft(load_into_slot(d.name, d.path, SlotBuffer(2 * MAX_HEAD_BYTES), eng.vocab,
                                     eng.target_parts))
    prompts = ["Write a Python function that returns the factorial of n.",
               "List three symptoms of the flu and what to do about each."]
    with torch.inference_mode():
        for prompt in prompts:
            ids = encode_prompt(tok, prompt)
            ref, _ = eng.generate(ids, 48)
            for name in names:
                out, stats = eng.generate(ids, 48, select=lambda s, n=name: n)
                assert out == ref, (name, prompt)
                assert stats.summary()["num_accepted_tokens"] > 0
