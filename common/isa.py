"""Which CPU kernel path runs: one choice, made once, from the CPU's own feature flags.

The native forward is built once per path (``procs/decoder/forward/native.py``), each with explicit
compiler flags, so a build only ever runs on a CPU that has every instruction it was
compiled for. The paths, fastest first:

- ``avx512-bf16``: AVX-512 VNNI integer dot products for int4/int8 weights, AVX-512 BF16
  dot products for bf16 weights (draft heads); bf16 activations are native here;
- ``avx512-vnni``: the same integer kernels, bf16 weights widened to fp32;
- ``avx2-vnni``: AVX2 + FMA with the 256-bit VNNI dot product (AVX-VNNI);
- ``avx2``: AVX2 + FMA (x86-64-v3), int8 dot products through ``vpmaddubsw``;
- ``neon-dotprod`` (aarch64 with the dot-product extension: Jetson Orin, Graviton 2+,
  Apple M1+): ``sdot`` on 4 outputs per register;
- ``generic``: portable C++ without intrinsics (any x86-64, aarch64, ...), vectorised by
  the compiler (NEON on aarch64).

The int4/int8 kernels of every path add the same integers in the same float order, so
they agree bit for bit (tests/test_isa.py). ``MEMSPEC_ISA`` forces a lower path on a
higher machine (the suite proves the lower paths on an AVX-512 CI machine that way).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from memspec.common.errors import ConfigError

ENV = "MEMSPEC_ISA"
ISAS = ("avx512-bf16", "avx512-vnni", "avx2-vnni", "avx2", "neon-dotprod", "generic")

# Linux /proc/cpuinfo flag names each path needs. x86-64-v3 (the avx2 builds' -march)
# also lets the compiler use BMI1/2, LZCNT (abm) and MOVBE; x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL.
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
NEEDS: dict[str, frozenset[str]] = {
    "avx512-bf16": _V4 | {"avx512_vnni", "avx512_bf16"},
    "avx512-vnni": _V4 | {"avx512_vnni"},
    "avx2-vnni": _V3 | {"avx_vnni"},
    "avx2": _V3,
    "neon-dotprod": frozenset({"asimd", "asimddp"}),  # aarch64 /proc/cpuinfo Features
    "generic": frozenset(),
}

# compiler flags per path (gcc / clang); generic builds for the baseline of the machine
_X86_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512-bf16": ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
    "avx512-vnni": ("-march=x86-64-v4", "-mavx512vnni"),
    "avx2-vnni": ("-march=x86-64-v3", "-mavxvnni"),
    "avx2": ("-march=x86-64-v3",),
    "generic": ("-march=x86-64",),
}


ARM = frozenset({"neon-dotprod"})


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def is_arm64() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them; elsewhere what torch's probes say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return _flags_from_torch()


def _flags_from_torch() -> frozenset[str]:
    """Not Linux: torch's own CPU probes (coarser, but never claim what is missing)."""
    try:
        import torch
    except ImportError:
        return frozenset()
    cpu = torch.cpu
    flags: set[str] = set()

    def has(name: str) -> bool:
        fn = getattr(cpu, name, None)
        try:
            return bool(fn()) if fn is not None else False
        except Exception:  # a probe that fails says nothing
            return False

    if has("_is_avx2_supported"):
        flags |= _V3
    if has("_is_avx512_supported"):
        flags |= _V4
    if has("_is_avx512_vnni_supported"):
        flags.add("avx512_vnni")
    if has("_is_avx512_bf16_supported"):
        flags.add("avx512_bf16")
    return frozenset(flags)


def supported(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Every path this CPU can run, fastest first (always ends with ``generic``)."""
    flags = cpu_flags() if flags is None else flags
    if is_x86():
        return tuple(isa for isa in ISAS if isa not in ARM and NEEDS[isa] <= flags)
    if is_arm64():
        return tuple(isa for isa in ("neon-dotprod", "generic") if NEEDS[isa] <= flags)
    return ("generic",)


def native_isa() -> str:
    return supported()[0]


def chosen_isa() -> str:
    """``MEMSPEC_ISA`` when set (it may only lower the path), else the fastest path."""
    raw = os.environ.get(ENV, "").strip().lower()
    if not raw:
        return native_isa()
    if raw not in ISAS:
        raise ConfigError(f"{ENV}={raw!r} is not a kernel path",
                          f"use one of {', '.join(ISAS)}, or unset {ENV}")
    have = supported()
    if raw not in have:
        missing = sorted(NEEDS[raw] - cpu_flags()) or [platform.machine()]
        raise ConfigError(f"{ENV}={raw} needs CPU features this machine lacks "
                          f"({', '.join(missing)})",
                          f"use one of {', '.join(have)}, or unset {ENV}")
    return raw


def compile_flags(isa: str) -> tuple[str, ...]:
    """Explicit flags, never ``-march=native``: the build key names exactly what it uses."""
    return compile_flags_for(platform.machine(), isa)


def compile_flags_for(machine: str, isa: str) -> tuple[str, ...]:
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        return _X86_FLAGS.get(isa, _X86_FLAGS["generic"])
    if machine in ("aarch64", "arm64"):  # NEON is part of armv8-a; sdot of armv8.2-a+dotprod
        return ("-march=armv8.2-a+dotprod",) if isa == "neon-dotprod" else ("-march=armv8-a",)
    return ()


def bf16_native(isa: str | None = None) -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16, or AMX when torch has it for the encoder)."""
    return (isa or chosen_isa()) == "avx512-bf16"


def torch_env(isa: str) -> dict[str, str]:
    """What PyTorch's and oneDNN's own kernels (the encoder, the fp32 path, sampling) need
    to follow a forced path too: read once, at their first use, so set before that."""
    if not is_x86():
        return {}
    return {"avx512-bf16": {},
            "avx512-vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
            "avx2-vnni": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
            "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
            }.get(isa, {})
