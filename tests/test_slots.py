"""Drafts bound to slot memory compute exactly what a normally loaded draft computes."""

from __future__ import annotations

import pytest
import torch

from memspec.common.errors import ModelError
from memspec.common.safetensors_layout import read_layout
from memspec.procs.decoder.models import load_causal_lm
from memspec.procs.decoder.slots import SlotBuffer, bind_draft, load_into_slot

X = torch.tensor([[1, 3, 5, 7, 11, 13, 17]])


def logits(model):
    with torch.inference_mode():
        return model(X).logits


def test_slot_bound_logits_identical_to_normal_load(tiny_dir):
    for name in ("self", "random", "small"):
        bound = load_into_slot(name, tiny_dir / name, SlotBuffer(1 << 20))
        normal = load_causal_lm(tiny_dir / name, "draft")
        assert torch.equal(logits(bound.model), logits(normal))
        for p in bound.model.parameters():  # every parameter lives inside the slot
            ptr = p.untyped_storage().data_ptr()
            assert ptr == bound.slot.data.untyped_storage().data_ptr()


def test_rewriting_slot_bytes_swaps_the_draft_in_place(tiny_dir):
    slot = SlotBuffer(1 << 20)
    bound = load_into_slot("self", tiny_dir / "self", slot)
    base = slot.data.data_ptr()
    before = logits(bound.model)
    other = load_causal_lm(tiny_dir / "random", "draft")
    # 'random' has one layer, 'self' two: rebind with the new config over the same bytes
    rebound = load_into_slot("random", tiny_dir / "random", slot)
    assert slot.data.data_ptr() == base  # no reallocation
    assert rebound.generation == bound.generation + 1
    assert torch.equal(logits(rebound.model), logits(other))
    assert not torch.equal(logits(rebound.model), before)


def test_same_architecture_rewrite_changes_existing_module(tiny_dir, tmp_path):
    from tinymodels import make_tiny, save_model

    twin = save_model(make_tiny(7), tmp_path / "twin")  # same shapes as 'self', other weights
    slot = SlotBuffer(1 << 20)
    bound = load_into_slot("self", tiny_dir / "self", slot)
    slot.fill_from_file(read_layout(twin / "model.safetensors"))
    assert torch.equal(logits(bound.model), logits(load_causal_lm(twin, "draft")))


def test_slot_too_small_is_a_clear_error(tiny_dir):
    with pytest.raises(ModelError, match="raise the slot capacity"):
        load_into_slot("self", tiny_dir / "self", SlotBuffer(1024))


@pytest.mark.parametrize("damage", ["truncate", "header", "empty"])
def test_corrupt_weights_are_model_errors(tiny_dir, tmp_path, damage):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(tiny_dir / "self", d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        f.write_bytes(data[:8] + b"{not json" + data[17:])
    else:
        f.write_bytes(b"")
    with pytest.raises(ModelError):
        load_into_slot("bad", d, SlotBuffer(1 << 20))


def test_wrong_shape_file_is_rejected(tiny_dir, tmp_path):
    import shutil

    d = tmp_path / "mixed"
    shutil.copytree(tiny_dir / "self", d)
    shutil.copy(tiny_dir / "random" / "config.json", d / "config.json")  # 1-layer config
    slot = SlotBuffer(1 << 20)
    layout = read_layout(d / "model.safetensors")
    slot.fill_from_file(layout)
    with pytest.raises(ModelError, match="do not match its config"):
        bind_draft("mixed", d, slot, layout)
