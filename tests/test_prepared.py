"""The decoder's cache of quantised target weights (a restart reads them instead of
quantising, in the kernels' packed layout): the same bits and the same logits as quantising, a key that follows the weight
file, and a damaged cache that is rebuilt rather than used."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from memspec.procs.decoder.drafts.head import TargetParts
from memspec.procs.decoder.forward import q8blocks
from memspec.procs.decoder.forward.native import NativeLM
from memspec.procs.decoder.forward.prepared import cache_path
from memspec.procs.decoder.forward.q8blocks import PackedInt8Linear
from memspec.procs.decoder.models import build_target

IDS = torch.tensor([1, 5, 9, 22, 40, 41, 7, 3])


def _logits(runner) -> torch.Tensor:
    cache = runner.new_cache(64)
    return runner.forward(IDS, 0, cache).float()


@pytest.mark.parametrize("dtype", ["int4", "int8", "int4-torch"])
def test_cached_weights_give_the_quantised_model_bit_for_bit(tiny_dir, tmp_path, dtype):
    fmt, _, path = dtype.partition("-")
    target = tmp_path / "target"
    shutil.copytree(tiny_dir / "target", target)
    fast = path != "torch"
    fresh = _logits(build_target(target, fmt, fast=fast))
    first = build_target(target, fmt, fast=fast, prepared=tmp_path / "home")
    file = cache_path(tmp_path / "home", target, fmt)
    assert file.is_file()
    stamp = file.stat().st_mtime_ns
    cached = build_target(target, fmt, fast=fast, prepared=tmp_path / "home")
    assert file.stat().st_mtime_ns == stamp  # read, not written again
    assert torch.equal(_logits(first), fresh) and torch.equal(_logits(cached), fresh)
    # the layers' projections are kept in the kernels' packed layout (read as they are),
    # and so is the int8 LM head, which is also the (tied) embedding
    with safe_open(str(file), framework="pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
    blocks = {"int4": "q4blocks", "int8": "q8blocks"}[fmt]
    assert {k for k, v in kinds.items() if k != "lm_head"} and all(
        v == blocks for k, v in kinds.items() if k != "lm_head")
    assert kinds["lm_head"] == "q8blocks"
    # the weight file changes: the key changes, and the cache is rebuilt from it
    weights = target / "model.safetensors"
    os.utime(weights, ns=(stamp, stamp + 10**9))
    build_target(target, fmt, fast=fast, prepared=tmp_path / "home")
    assert file.stat().st_mtime_ns != stamp


def test_a_damaged_cache_is_rebuilt_not_used(tiny_dir, tmp_path, caplog):
    target = tmp_path / "target"
    shutil.copytree(tiny_dir / "target", target)
    fresh = _logits(build_target(target, "int4"))
    build_target(target, "int4", prepared=tmp_path / "home")
    file = cache_path(tmp_path / "home", target, "int4")
    data = bytearray(file.read_bytes())
    file.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    again = build_target(target, "int4", prepared=tmp_path / "home")
    assert torch.equal(_logits(again), fresh)
    assert "unreadable" in caplog.text and file.stat().st_size == len(data)


def test_the_lm_head_is_held_once_packed(tiny_dir, tmp_path):
    """A prepared target's tied int8 LM head is read packed and never unpacked: the native
    model's embedding and a draft vocabulary's rows come from the one copy its kernels
    read, with the bits of the plain rows."""
    target = tmp_path / "target"
    shutil.copytree(tiny_dir / "target", target)
    fresh = build_target(target, "int4")  # quantised here: the plain int8 rows
    build_target(target, "int4", prepared=tmp_path / "home")
    cached = build_target(target, "int4", prepared=tmp_path / "home")
    plain, lean = getattr(fresh, "lean", fresh).lm_head, getattr(cached, "lean", cached)
    head = lean.lm_head
    assert isinstance(head, PackedInt8Linear) and lean.tied_rows
    ids = torch.tensor([0, 1, 15, 16, 17, 33, lean.vocab - 1])
    q, d = q8blocks.rows(head.parts, ids)
    assert torch.equal(q, plain.q[ids]) and torch.equal(d, plain.d[ids])
    rows = TargetParts(cached).lm_rows(ids)
    assert torch.equal(rows.q, plain.q[ids]) and torch.equal(rows.d, plain.d[ids])
    if isinstance(cached, NativeLM):
        assert head.parts["q8w"].data_ptr() == cached.model.head_parts()[0].data_ptr()
        assert torch.equal(cached.model.embed(ids), fresh.model.embed(ids))
        with pytest.raises(RuntimeError, match="out of range"):
            cached.model.embed(torch.tensor([lean.vocab]))
    assert "q" not in vars(head) and "d" not in vars(head)  # nothing was unpacked


def test_a_block_faulted_in_beforehand_holds_the_weights(tmp_path, monkeypatch):
    """The supervisor sizes the decoder's weight block from its last start (arena.py): the
    block is faulted in beside the imports, the native model writes its weights into it when
    it is exactly the size needed (the same logits), and the size is recorded for the next
    start; a block of another size is left alone and the model allocates its own."""
    import ctypes

    from memspec.procs.decoder.forward import arena
    from tests.tinymodels import make_tiny, save_model

    monkeypatch.setattr(arena, "_record_path", lambda: tmp_path / "arena.json")
    target = save_model(make_tiny(3, layers=2, hidden=512), tmp_path / "target")
    home = tmp_path / "home"
    build_target(target, "int4", prepared=home)  # quantised and written; nothing recorded
    assert not (tmp_path / "arena.json").exists()

    def started(size: int):
        monkeypatch.setenv(arena.ARENA_ENV, f"pool-a:{size}")
        arena.start_from_env()
        return arena._state["pending"]

    assert started(0) is None
    first = build_target(target, "int4", prepared=home)
    if not isinstance(first, NativeLM):
        pytest.skip("no native build")
    size = first.model.block_bytes()
    assert size > 0 and size % arena.HUGE == 0
    assert arena.env_for("pool-a") == {arena.ARENA_ENV: f"pool-a:{size}"}
    assert arena.env_for("pool-b") == {arena.ARENA_ENV: "pool-b:0"}

    def inside(runner, pending) -> bool:
        start = ctypes.addressof(pending._view) + pending.offset
        return start <= runner.model.head_parts()[0].data_ptr() < start + pending.nbytes

    for offered, taken in ((size, True), (size + arena.HUGE, False)):
        pending = started(offered)
        assert _mapping_flags(ctypes.addressof(pending._view)).endswith("p")  # private: a
        # shared anonymous mapping is shmem, which got no huge pages
        again = build_target(target, "int4", prepared=home)
        assert inside(again, pending) is taken
        assert again.model.block_bytes() == size
        assert torch.equal(_logits(again), _logits(first))
    assert arena.env_for("pool-a") == {arena.ARENA_ENV: f"pool-a:{size}"}


def _mapping_flags(addr: int) -> str:
    """The permissions of the mapping holding `addr` (/proc/self/maps: "rw-p" private)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms
    raise AssertionError("no mapping holds the block")
