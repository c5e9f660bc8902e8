"""Slot memory: shm segments are private, validated, and leave nothing behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from memspec.common import slotmem
from memspec.common.slotmem import (
    SHM_DIR,
    SlotMemory,
    SlotMemoryError,
    SlotWriter,
    choose_transport,
    cleanup_shm,
    new_run_token,
    parse_cuda_handle,
    shm_name,
)


@pytest.fixture
def token():
    tok = new_run_token()
    yield tok
    cleanup_shm(f"memspec-{tok}-")


def mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()


def test_shm_slot_is_private_shared_and_gone_after_close_unlink(token):
    name = shm_name(token, 0)
    mem = SlotMemory.create(name, 1 << 16, "shm")
    path = SHM_DIR / name
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 16
    assert mem.handle == name and mem.tensor.dtype == torch.uint8 and mem.capacity == 1 << 16
    with SlotWriter.open("shm", mem.handle, 1 << 16) as w:  # the loader's view of it
        w.write(100, b"\x01\x02\x03")
        w.write(0, memoryview(bytearray(b"\xff" * 4)))
    assert mem.tensor[100:103].tolist() == [1, 2, 3] and mem.tensor[:4].tolist() == [255] * 4
    mem.close()
    mem.unlink()
    assert not path.exists() and not mapped(name)
    mem.unlink()  # idempotent


def test_create_is_exclusive(token):
    with SlotMemory.create(shm_name(token, 1), 4096, "shm"), \
            pytest.raises(SlotMemoryError, match="already exists"):
        SlotMemory.create(shm_name(token, 1), 4096, "shm")
    assert not (SHM_DIR / shm_name(token, 1)).exists()


@pytest.mark.parametrize("handle", ["../etc/passwd", "/etc/passwd", "memspec-a/b", "slot0",
                                    "memspec-", "memspec-x\x00", "memspec-" + "x" * 300, ""])
def test_malformed_shm_handles_are_refused(handle):
    with pytest.raises(SlotMemoryError, match="bad shm handle"):
        SlotWriter.open("shm", handle, 16)


def test_writer_refuses_missing_small_symlinked_segments_and_out_of_bounds(token, tmp_path):
    with pytest.raises(SlotMemoryError, match="cannot open"):
        SlotWriter.open("shm", shm_name(token, 9), 16)
    with SlotMemory.create(shm_name(token, 2), 4096, "shm") as mem:
        with pytest.raises(SlotMemoryError, match="holds 4096 bytes"):
            SlotWriter.open("shm", mem.handle, 8192)
        with SlotWriter.open("shm", mem.handle, 4096) as w, \
                pytest.raises(SlotMemoryError, match="outside slot"):
            w.write(4090, b"x" * 10)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep" * 1024)
    link = SHM_DIR / shm_name(token, 3)
    os.symlink(victim, link)
    with pytest.raises(SlotMemoryError, match="cannot open"):
        SlotWriter.open("shm", link.name, 16)
    assert victim.read_bytes() == b"keep" * 1024
    with pytest.raises(SlotMemoryError, match="unknown slot transport"):
        SlotWriter.open("carrier-pigeon", "memspec-x", 16)


def test_cleanup_shm_removes_leftovers_by_prefix_only(token):
    a = SlotMemory.create(shm_name(token, 0), 4096, "shm")
    b = SlotMemory.create(shm_name(token, 1), 4096, "shm")
    other = new_run_token()
    c = SlotMemory.create(shm_name(other, 0), 4096, "shm")
    a.close()
    b.close()  # a crashed decoder never unlinks: cleanup does
    assert cleanup_shm(f"memspec-{token}-") == [shm_name(token, 0), shm_name(token, 1)]
    assert not list(SHM_DIR.glob(f"memspec-{token}-*"))
    assert (SHM_DIR / shm_name(other, 0)).exists()
    c.close()
    cleanup_shm(f"memspec-{other}-")
    with pytest.raises(SlotMemoryError, match="refusing"):
        cleanup_shm("")
    with pytest.raises(SlotMemoryError, match="refusing"):
        cleanup_shm("memspec-../")


def test_choose_transport(monkeypatch, tmp_path):
    monkeypatch.delenv(slotmem.ENV_TRANSPORT, raising=False)
    monkeypatch.setattr(slotmem, "TEGRA_RELEASE", tmp_path / "absent")
    assert choose_transport("cpu") == "shm"
    props = SimpleNamespace(is_integrated=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert choose_transport("cuda") == "cuda-ipc"
    props.is_integrated = True  # Jetson: one DRAM, no CUDA IPC
    assert choose_transport("cuda:0") == "shm"
    props.is_integrated = False
    (tmp_path / "tegra").write_text("# R36")
    monkeypatch.setattr(slotmem, "TEGRA_RELEASE", tmp_path / "tegra")
    assert choose_transport("cuda") == "shm"
    monkeypatch.setenv(slotmem.ENV_TRANSPORT, "cuda-ipc")
    assert choose_transport("cpu") == "cuda-ipc"
    monkeypatch.setenv(slotmem.ENV_TRANSPORT, "nfs")
    with pytest.raises(SlotMemoryError, match="not a slot transport"):
        choose_transport("cpu")


def good_ipc_handle(**over) -> dict:
    h = {"device": 0, "handle": "AAEC", "size": 4096, "offset": 0, "ref_handle": "L3Q=",
         "ref_offset": 3, "event_handle": None, "event_sync": True}
    h.update(over)
    return h


def test_cuda_handles_are_json_and_strictly_validated():
    args = parse_cuda_handle(json.dumps(good_ipc_handle()))
    assert args == (0, b"\x00\x01\x02", 4096, 0, b"/t", 3, None, True)
    bad = ["not json", json.dumps([1]), json.dumps(good_ipc_handle(size="1")),
           json.dumps(good_ipc_handle(device=-1)), json.dumps(good_ipc_handle(handle="@@")),
           json.dumps(good_ipc_handle(event_sync=1)), json.dumps(good_ipc_handle(handle=None)),
           json.dumps({**good_ipc_handle(), "extra": 1})]
    for text in bad:
        with pytest.raises(SlotMemoryError):
            parse_cuda_handle(text)
    with pytest.raises(SlotMemoryError, match="CUDA device"):
        SlotMemory.create("memspec-x", 16, "cuda-ipc", device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_slot_filled_by_another_process():
    mem = SlotMemory.create("gpu-slot", 8 << 20, "cuda-ipc", device="cuda")
    mem.tensor.zero_()
    torch.cuda.synchronize()
    code = textwrap.dedent("""
        import sys, numpy as np
        from memspec.common.slotmem import SlotWriter
        data = (np.arange(6 << 20) % 251).astype(np.uint8)
        w = SlotWriter.open("cuda-ipc", sys.argv[1], 8 << 20)
        w.write(12345, memoryview(data))
        w.flush()
        w.close()
    """)
    subprocess.run([sys.executable, "-c", code, mem.handle], check=True, timeout=120)
    want = (torch.arange(6 << 20) % 251).to(torch.uint8)
    got = mem.tensor[12345:12345 + (6 << 20)].cpu()
    assert torch.equal(got, want)
    assert int(mem.tensor[:12345].sum()) == 0
    mem.close()
