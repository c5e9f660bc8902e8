"""Every kernel path on every machine: the choice of path, the kernels' bits on each path
(and on aarch64, cross-built; the whole forward on aarch64: test_aarch64.py), and the
engine's losslessness under each path this CPU runs.

An AVX-512 CI machine proves the AVX2 and generic paths through ``MEMSPEC_ISA``; the whole
suite also runs under ``MEMSPEC_ISA=avx2`` (README, Tests)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import test_engine

from memspec.common import isa
from memspec.common.errors import ConfigError
from memspec.common.machine import machine_info
from memspec.procs.decoder.forward import native

CSRC = Path(native.__file__).resolve().parent / "csrc"
PATHS = isa.supported()
AVX2_BOX = isa.NEEDS["avx2"] | {"sse4_2", "popcnt"}  # a laptop / cloud AVX2 CPU's flags


# ---- the choice --------------------------------------------------------------------------
def test_paths_follow_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    assert isa.supported(frozenset()) == ("generic",)
    assert isa.supported(AVX2_BOX) == ("avx2", "generic")
    assert isa.supported(AVX2_BOX | {"avx_vnni"}) == ("avx2-vnni", "avx2", "generic")
    full = isa.NEEDS["avx512-bf16"] | {"avx_vnni", "asimddp"}
    assert isa.supported(full) == tuple(p for p in isa.ISAS if p not in isa.ARM)
    no_bmi = AVX2_BOX - {"bmi2"}  # -march=x86-64-v3 may emit BMI2: not an avx2 box
    assert isa.supported(no_bmi) == ("generic",)
    monkeypatch.setattr(isa, "is_x86", lambda: False)
    monkeypatch.setattr(isa, "is_arm64", lambda: True)  # a Jetson Orin's Features line
    assert isa.supported(frozenset({"fp", "asimd", "asimddp", "sve"})) == ("neon-dotprod",
                                                                           "generic")
    assert isa.supported(frozenset({"fp", "asimd"})) == ("generic",)  # a Cortex-A72
    monkeypatch.setattr(isa, "is_arm64", lambda: False)
    assert isa.supported(full) == ("generic",)


def test_memspec_isa_only_lowers_the_path(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    monkeypatch.setattr(isa, "cpu_flags", lambda: AVX2_BOX)
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.chosen_isa() == "avx2"
    monkeypatch.setenv(isa.ENV, "generic")
    assert isa.chosen_isa() == "generic"
    monkeypatch.setenv(isa.ENV, "avx512-vnni")
    with pytest.raises(ConfigError, match=r"needs CPU features this machine lacks \(avx512"):
        isa.chosen_isa()
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(ConfigError, match="is not a kernel path; use one of avx512-bf16"):
        isa.chosen_isa()


def test_builds_are_keyed_by_path_and_never_native():
    mine = [p for p in isa.ISAS if (p in isa.ARM) == isa.is_arm64()]
    dirs = {native.build_dir(p) for p in mine}
    assert len(dirs) == len(mine)
    for p in mine:
        assert p in native.build_dir(p).name
    for machine in ("x86_64", "aarch64"):
        for p in isa.ISAS:
            if (p in isa.ARM) == (machine == "aarch64"):
                flags = isa.compile_flags_for(machine, p)
                assert flags and not any("native" in f for f in flags)


def test_a_build_for_another_path_is_refused(monkeypatch, capsys):
    """A build whose kernels are not the path asked for (a mis-keyed cache) never runs."""
    import torch.utils.cpp_extension as cpp

    class Fake:
        @staticmethod
        def kernel_path() -> str:
            return "avx512-bf16"

    monkeypatch.setattr(cpp, "load", lambda **kw: Fake)
    monkeypatch.setattr(native, "_EXT", {})
    assert native.extension(isa="generic") is None
    assert "is for avx512-bf16, not generic" in capsys.readouterr().err


def test_machine_info_names_the_path(monkeypatch):
    info = machine_info()
    assert info["isa"] == isa.chosen_isa() and info["isa_native"] == isa.native_isa()
    monkeypatch.setenv(isa.ENV, "generic")
    assert machine_info()["isa"] == "generic"


# ---- the kernels, per path and on aarch64 -------------------------------------------------
def _check_binary(cxx: str, flags: tuple[str, ...], out: Path) -> Path:
    cmd = [cxx, "-std=c++17", "-O2", *flags, str(CSRC / "qkernels_check.cpp"),
           str(CSRC / "qkernels.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


def _run_check(cmd: list[str]) -> dict[str, str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr
    return dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)


@pytest.fixture(scope="module")
def kernel_bits(tmp_path_factory) -> dict[str, dict[str, str]]:
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("qcheck")
    out = {}
    for p in PATHS:
        exe = _check_binary("c++", isa.compile_flags(p), root / f"check-{p}")
        out[p] = _run_check([str(exe)])
    return out


def test_every_path_gives_the_same_bits(kernel_bits):
    """Rows alone = rows together and results near a double reference (inside the check);
    q4 and q8 outputs bit-identical across every path this CPU runs; 16-bit weights
    identical across the 8-lane paths (AVX-512's 16 lanes sum in another order)."""
    for p, bits in kernel_bits.items():
        assert bits["path"] == p
    for fmt in ("q4", "q8"):
        assert len({b[fmt] for b in kernel_bits.values()}) == 1, fmt
    eight = [b for p, b in kernel_bits.items() if p in ("avx2-vnni", "avx2", "generic")]
    for fmt in ("bf16", "fp16"):
        assert len({b[fmt] for b in eight}) == 1, fmt


@pytest.mark.parametrize("arm", ["generic", "neon-dotprod"])
def test_kernels_on_aarch64(kernel_bits, tmp_path, arm):
    """Both aarch64 paths cross-built (run under qemu where installed): the same q4, q8,
    bf16 and fp16 bits as the portable path here. `bash launch/setup.sh --dev` installs the
    cross compiler and qemu from Debian where apt is available."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("no aarch64 cross compiler (apt install g++-aarch64-linux-gnu)")
    exe = _check_binary(cxx, ("-static", *isa.compile_flags_for("aarch64", arm)),
                        tmp_path / f"check-{arm}")
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    if qemu is None:
        pytest.skip("built for aarch64, but no qemu-aarch64 to run it (apt install qemu-user-static)")
    bits = _run_check([qemu, "-cpu", "max", str(exe)])  # max: the dot-product extension
    assert bits["path"] == arm
    for fmt in ("q4", "q8", "bf16", "fp16"):
        assert bits[fmt] == kernel_bits["generic"][fmt], fmt


# ---- the engine under every path ----------------------------------------------------------
@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv(isa.ENV, request.param)
    if native.extension() is None:
        pytest.skip("the native forward cannot be built here")
    return request.param


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_greedy_identical_per_path(tiny_dir, path, dtype):
    eng = test_engine.engine_with(tiny_dir, ["small"], dtype=dtype)
    assert eng.target.isa == path
    test_engine.test_greedy_identical_to_target_only(tiny_dir, "small", dtype)
    test_engine.test_switching_every_iteration_never_changes_a_token(tiny_dir, dtype)


def test_heads_and_chunked_prefill_per_path(tiny_dir, tiny_heads, path, monkeypatch, tmp_path):
    test_engine.test_head_drafts_are_lossless_and_switch_with_model_drafts(tiny_dir, tiny_heads,
                                                                           "int4")
    for stored in (0, 1):  # a packed Q8_0 head, a bf16 one
        test_engine.test_native_head_matches_the_pytorch_reference(tiny_dir, tiny_heads, stored)
    for dtype in ("int4", "bfloat16", "int4-prepared"):  # (prepared: the decoder's target)
        test_engine.test_prefill_in_chunks_leaves_the_same_cache(tiny_dir, dtype, monkeypatch,
                                                                 tmp_path / dtype)


def test_verify_rows_equal_single_steps_per_path(tiny_dir, path):
    """The property the lossless engine stands on, directly: a 5-token forward gives the
    same logits, bit for bit, as five 1-token forwards, on every path."""
    import torch

    from memspec.procs.decoder.models import build_target

    for dtype in ("int4", "int8", "bfloat16"):
        target = build_target(tiny_dir / "target", dtype)
        ids = torch.tensor([1, 5, 9, 22, 40, 41, 7, 3])
        c1, c2 = target.new_cache(64), None
        target.forward(ids[:3], 0, c1)
        together = target.forward(ids[3:], 3, c1)
        c2 = target.new_cache(64)
        target.forward(ids[:3], 0, c2)
        alone = torch.cat([target.forward(ids[i:i + 1], i, c2) for i in range(3, 8)])
        assert torch.equal(together, alone), dtype


@pytest.mark.slow
@pytest.mark.parametrize("which", PATHS)
def test_real_target_and_heads_lossless_per_path(which, monkeypatch):
    """SmolLM2 (int4) with two committed heads and the context lookup, on every path: each
    head's output is the target's own greedy output (tests/test_committed_heads.py runs the
    longer version on the machine's own path)."""
    import torch

    from memspec.common.config import load_pool
    from memspec.common.paths import PACKAGE_ROOT, default_target_dir
    from memspec.procs.decoder.models import encode_prompt, open_engine
    from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

    if not (default_target_dir() / "model.safetensors").is_file():
        pytest.skip("target not converted")
    monkeypatch.setenv(isa.ENV, which)
    pool = load_pool(PACKAGE_ROOT / "pools" / "heads.toml")
    eng, tok, dtype = open_engine(pool)
    assert dtype == "int4" and eng.target.isa == which
    for d in pool.drafts:
        if d.name in ("general", "code"):
            eng.add_draft(load_into_slot(d.name, d.path, SlotBuffer(24 << 20), eng.vocab,
                                         eng.target_parts))
    ids = encode_prompt(tok, "Write a Python function that returns the factorial of n.")
    length = 16 if which == "generic" else 32  # the scalar path is the slow one
    with torch.inference_mode():
        ref, _ = eng.generate(ids, length)
        for name in ("general", "code"):
            out, stats = eng.generate(ids, length, select=lambda s, n=name: n)
            assert out == ref, name
            assert stats.summary()["num_accepted_tokens"] > 0
