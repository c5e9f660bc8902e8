"""Heads stored as packed Q8_0 and Q4_1 blocks: the file's arrays are the kernels' own
bytes, a bf16 or Q8_0 head converts to the pool's formats without changing what they stand
for, and a damaged one is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import TINY_VOCAB, make_tiny_head

from memspec.common.errors import ModelError
from memspec.common.manifest import read_manifest, verify, write_manifest
from memspec.procs.decoder.drafts.head import (
    PACKED,
    Q4_MATRICES,
    dense_weights,
    is_packed,
    matrix_format,
    pack_head,
    read_head_config,
)
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.forward import q4blocks, q8blocks
from memspec.procs.decoder.forward.linear import Int4Linear, Int8Linear
from memspec.procs.decoder.forward.native import extension
from memspec.procs.decoder.models import build_target
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot
from memspec.zoo.heads import pack_stored, read_head_weights


@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (960, 1152)])
@pytest.mark.parametrize("blocks, linear", [(q8blocks, Int8Linear), (q4blocks, Int4Linear)],
                         ids=["q8", "q4"])
def test_packed_blocks_stand_for_the_linears_blocks(shape, blocks, linear):
    w = torch.randn(*shape).to(torch.bfloat16)
    parts = blocks.pack(w)
    assert blocks.check("w", parts, shape) is None
    assert blocks.shape_of(parts) == shape
    assert torch.equal(blocks.unpack(parts), linear(w.float(), torch.float32).dequantize())


def test_only_tiled_shapes_pack():
    assert not q8blocks.packable((24, 32)) and not q8blocks.packable((16, 40))
    with pytest.raises(ValueError, match="N % 16"):
        q8blocks.pack(torch.randn(24, 32))


def test_the_kernels_run_the_files_bytes_as_their_own_packing():
    """Arrays packed here (what a head file holds) and the C++ packing of the same blocks
    give the same output bits, 1 row and a verify's 5."""
    ext = extension()
    if ext is None:
        pytest.skip("the native forward cannot be built here")
    w = torch.randn(96, 160).to(torch.bfloat16)
    blocks = Int8Linear(w, torch.float32)
    theirs = ext.Linear((4, blocks.q, blocks.d, None, None))
    p = q8blocks.pack(w)
    ours = ext.Linear((6, p["q8w"], p["q8d"], (p["q8c"], p["q8s"]), None))
    for rows in (1, 5):
        x = torch.randn(rows, 160)
        assert torch.equal(ours(x), theirs(x))
    with pytest.raises(RuntimeError, match="packed q8 scales"):
        ext.Linear((6, p["q8w"], p["q8d"].float(), (p["q8c"], p["q8s"]), None))


def test_the_kernels_run_a_files_q4_bytes_as_their_own_packing():
    ext = extension()
    if ext is None:
        pytest.skip("the native forward cannot be built here")
    w = torch.randn(96, 160).to(torch.bfloat16)
    blocks = Int4Linear(w.float(), torch.float32)
    theirs = ext.Linear((3, blocks.q, blocks.d, blocks.m, None))
    p = q4blocks.pack(w)
    ours = ext.Linear((7, p["q4n"], p["q4d"], p["q4m"], None))
    for rows in (1, 5):
        x = torch.randn(rows, 160)
        assert torch.equal(ours(x), theirs(x))
    with pytest.raises(RuntimeError, match="packed q4 scales"):
        ext.Linear((7, p["q4n"], p["q4d"].float(), p["q4m"], None))


def _blocks_values(name: str, w: torch.Tensor) -> torch.Tensor:
    """What a matrix of the 16-bit name ``name`` stands for once packed in its pool format."""
    joined = next(j for j, members in PACKED.items() if name in members)
    lin = Int4Linear if joined in Q4_MATRICES else Int8Linear
    return lin(w.float(), torch.float32).dequantize()


def test_a_bf16_head_converts_in_place(tmp_path):
    """`pack_stored`: the file becomes packed, its manifest verifies, the trainer reads the
    blocks' values back, and a second call finds nothing to do."""
    head = make_tiny_head(tmp_path / "h", seed=7, q8=False)
    before = load_file(str(head / "model.safetensors"))
    (head / "training.json").write_text(json.dumps({"size_bytes": 1}))
    write_manifest(head)
    assert pack_stored(head)
    after = load_file(str(head / "model.safetensors"))
    assert is_packed(after) and not is_packed(before)
    assert torch.equal(after["memspec.draft_to_target"], before["memspec.draft_to_target"])
    verify(read_manifest(head))
    rec = json.loads((head / "training.json").read_text())
    assert rec["size_bytes"] == (head / "model.safetensors").stat().st_size
    state, _ = read_head_weights(head)
    arch, _ = read_head_config(head)
    want = dense_weights(before, arch, torch.float32)
    for name, w in want.items():
        got = state[f"{name}.weight"]
        if name.endswith("proj") or name == "fc":
            assert torch.equal(got, _blocks_values(name, w))
        else:
            assert torch.equal(got, w.float())
    assert not pack_stored(head)


def test_a_q8_head_converts_to_the_pools_formats(tmp_path):
    """A head stored all Q8_0 (the pool before Q4_1 layers) is requantised from its blocks'
    values; fc, kept Q8_0, keeps its very bytes; the card and record name the new format."""
    head = make_tiny_head(tmp_path / "h", seed=9, q8=False)
    bf16 = load_file(str(head / "model.safetensors"))
    save_file(pack_head(bf16, q4=()), str(head / "model.safetensors"))
    before = load_file(str(head / "model.safetensors"))
    (head / "training.json").write_text(json.dumps({"size_bytes": 1}))
    (head / "README.md").write_text("ids, Q8_0 blocks (packed for the CPU kernels), bf16 "
                                    "norms.\nFile size: 1 bytes (0.00 MB).\n")
    assert pack_stored(head)
    after = load_file(str(head / "model.safetensors"))
    assert {j: matrix_format(after, j) for j in PACKED} == {
        j: "q4" if j in Q4_MATRICES else "q8" for j in PACKED}
    for p in q8blocks.PARTS:
        assert torch.equal(after[f"fc.{p}"], before[f"fc.{p}"])
    arch, _ = read_head_config(head)
    was = dense_weights(before, arch, torch.float32)
    now = dense_weights(after, arch, torch.float32)
    for j in Q4_MATRICES:
        for m in PACKED[j]:
            assert torch.equal(now[m], Int4Linear(was[m], torch.float32).dequantize())
    assert "Q4_1 blocks for the layer" in (head / "README.md").read_text()
    assert (head / "model.safetensors").stat().st_size < 0.6 * (
        sum(t.nbytes for t in before.values()))
    assert not pack_stored(head)


@pytest.mark.parametrize("damage", ["drop", "dtype", "shape", "drop4", "dtype4"])
def test_a_damaged_packed_head_is_a_one_line_error(tmp_path, tiny_dir, damage):
    head = make_tiny_head(tmp_path / "h", seed=8)
    t = load_file(str(head / "model.safetensors"))
    if damage == "drop":
        del t["fc.q8c"]
    elif damage == "dtype":
        t["fc.q8d"] = t["fc.q8d"].float()
    elif damage == "drop4":
        del t["gate_up_proj.q4m"]
    elif damage == "dtype4":
        t["qkv_proj.q4n"] = t["qkv_proj.q4n"].to(torch.int8)
    else:
        t["fc.q8w"] = t["fc.q8w"][:-1].contiguous()
    save_file(t, str(head / "model.safetensors"))
    eng = SpecEngine(build_target(tiny_dir / "target", "float32"), ())
    with pytest.raises(ModelError, match="rebuild the head") as err:
        load_into_slot("h", head, SlotBuffer(1 << 20), TINY_VOCAB, eng.target_parts)
    assert "\n" not in str(err.value)
