"""The lean forward's CPU fast path: one C++ call per forward (csrc/lean_cpu.cpp).

Built once per kernel path (``memspec.common.isa``: avx512-bf16, avx512-vnni, avx2-vnni,
avx2, neon-dotprod, generic) with PyTorch's extension builder (g++ and ninja; `bash launch/setup.sh` builds
the machine's own path) into ``$MEMSPEC_HOME/build``; later processes load the cached build
in well under a second. Each path is its own module with explicit ``-m`` flags, keyed by
path, flags, compiler, torch and source text, and is only loaded on a CPU that has every
instruction it was compiled for, so a ``$MEMSPEC_HOME`` moved to an older CPU builds its own
path instead of dying of SIGILL. Where nothing can be built (no compiler), the pure-PyTorch
lean forward runs instead: same results up to rounding, more Python overhead per step.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from memspec.common import isa as isa_mod
from memspec.common.errors import ConfigError
from memspec.common.paths import memspec_home
from memspec.procs.decoder.forward import arena, q8blocks
from memspec.procs.decoder.forward.lean import KVCache, LeanLM, alloc_cache
from memspec.procs.decoder.forward.linear import GROUP, DenseLinear, Int4Linear, Int8Linear, Linear
from memspec.procs.decoder.forward.q4blocks import PackedInt4Linear
from memspec.procs.decoder.forward.q8blocks import PackedInt8Linear

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "lean_cpu.cpp", CSRC / "qgemm.cpp", CSRC / "qkernels.cpp", CSRC / "pool.cpp"]
HEADERS = [CSRC / "qgemm.h", CSRC / "qkernels.h", CSRC / "pool.h",
           *sorted((CSRC / "arch").glob("*.inc"))]  # one kernel source per ISA family
_EXT: dict[str, Any] = {}
DENSE_PAD_ROWS = 8  # decode calls (a step, a verify of up to 8 tokens) as 8 rows: lossless
# kinds whose rows are computed each on its own (qgemm.cpp): a prompt prefilled in chunks
# leaves the same cache bit for bit; BLAS (0) and PyTorch's int4 kernel (2) do not promise it.
# 6 and 7 (a prepared target's packed blocks) run as 4 and 3; without them the decoder's own
# target prefilled whole and left PyTorch its threads (apply_threads), whose OpenMP workers
# spun beside the pool's: its prefill took 8-10% longer than with MEMSPEC_POOL=openmp
ROW_EXACT_KINDS = frozenset({3, 4, 5, 6, 7})


@functools.lru_cache(maxsize=1)
def _compiler_id() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=20)
        return (out.stdout.splitlines() or [cxx])[0].strip()
    except (OSError, subprocess.SubprocessError):
        return cxx


# -fno-trapping-math: the loops over exp (softmax, SiLU) vectorise only when the compiler
# may run floating-point ops no trap could observe (an exact max, a floor, a select); no
# value changes (no reassociation, no contraction beyond -O3's own)
CFLAGS = ("-O3", "-fopenmp", "-fno-trapping-math")


def build_dir(isa: str) -> Path:
    """Where the build for ``isa`` lives: the key names everything that shapes the binary."""
    digest = hashlib.sha256(str(CSRC).encode())
    for part in (isa, " ".join(CFLAGS + isa_mod.compile_flags(isa)), _compiler_id(),
                 torch.__version__,
                 sysconfig.get_config_var("EXT_SUFFIX") or sys.version):  # the interpreter's ABI
        digest.update(part.encode())
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    tag = f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:10]}"
    return memspec_home() / "build" / f"lean_cpu-{isa}-{tag}"


def extension(build: bool = True, verbose: bool = False, isa: str | None = None) -> Any:
    """The compiled module for ``isa`` (default: the chosen path, ``MEMSPEC_ISA`` or the
    fastest this CPU runs), or None when disabled (MEMSPEC_NATIVE=0) or not buildable."""
    if os.environ.get("MEMSPEC_NATIVE", "1") == "0":
        return None
    isa = isa or isa_mod.chosen_isa()
    if isa in _EXT:
        return _EXT[isa]
    if isa not in isa_mod.supported():  # never load instructions the CPU does not have
        raise ConfigError(f"kernel path {isa} is not supported by this CPU",
                                  f"use one of {', '.join(isa_mod.supported())}")
    out = build_dir(isa)
    name = f"memspec_lean_cpu_{isa.replace('-', '_')}"
    t0 = time.perf_counter()
    # The build directory's key names the sources, flags, compiler and torch, so a module
    # built there is this one: load it as it is (a restarted decoder skips importing the
    # builder and its ninja run, ~0.2 s); one that does not load is rebuilt below. Where
    # the builder is imported already, it checks the build instead (it costs nothing more).
    ext = None
    built = out / f"{name}.so"
    if built.is_file() and "torch.utils.cpp_extension" not in sys.modules:
        import importlib.util

        try:
            spec = importlib.util.spec_from_file_location(name, built)
            if spec is not None and spec.loader is not None:
                ext = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(ext)
        except (ImportError, OSError):  # an interrupted build: the builder makes it again
            ext = None
    if ext is None and not build and not any(out.glob("*.so")):
        return None
    if ext is None:
        from torch.utils.cpp_extension import load

        out.mkdir(parents=True, exist_ok=True)
        try:
            ext = load(name=name,
                       sources=[str(p) for p in SOURCES], build_directory=str(out),
                       extra_cflags=[*CFLAGS, *isa_mod.compile_flags(isa)],
                       extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why
            print(f"[memspec] native CPU forward ({isa}) unavailable ({type(exc).__name__}: "
                  f"{str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ''}); "
                  "using the PyTorch path", file=sys.stderr, flush=True)
    if ext is not None:
        if ext.kernel_path() != isa:  # a mis-keyed build must not run as another path
            print(f"[memspec] the build in {out} is for {ext.kernel_path()}, not {isa}; "
                  "using the PyTorch path (delete that folder to rebuild)",
                  file=sys.stderr, flush=True)
            ext = None
        spent = time.perf_counter() - t0
        if ext is not None and spent > 5:
            print(f"[memspec] built the native CPU forward for {isa} in {spent:.0f}s "
                  f"(cached in {out})", file=sys.stderr, flush=True)
    _EXT[isa] = ext
    return ext


def tiles(layer: Linear) -> bool:
    """Whether the block kernels cover this layer's shape (16 outputs x 32 inputs)."""
    n, k = (layer.q if isinstance(layer, (Int4Linear, Int8Linear)) else layer.weight).shape
    return n % 16 == 0 and k % GROUP == 0


def linear_spec(layer: Linear) -> tuple:
    """(kind, a, b, c, bias): the C++ side's view of one linear layer's weights. Every kind
    takes and returns fp32 rows; shapes the block kernels do not tile fall back to PyTorch's
    kernels, which the C++ side calls in their own dtype. Layers held as packed arrays
    (a prepared target) are passed as they are: the C++ side points its kernels at them."""
    if isinstance(layer, PackedInt4Linear):
        p = layer.parts
        return (7, p["q4n"], p["q4d"], p["q4m"], layer.bias)
    if isinstance(layer, PackedInt8Linear):
        p = layer.parts
        return (6, p["q8w"], p["q8d"], (p["q8c"], p["q8s"]), layer.bias)
    if isinstance(layer, Int4Linear):
        if tiles(layer):
            return (3, layer.q, layer.d, layer.m, layer.bias)
        packed, sz = layer._torch_pack()
        return (2, packed, sz, None, layer.bias)
    if isinstance(layer, Int8Linear):
        if tiles(layer):
            return (4, layer.q, layer.d, None, layer.bias)
        return _dense(layer.dequantize(), layer.bias)
    assert isinstance(layer, DenseLinear)
    w = layer.weight
    if w.dtype in (torch.bfloat16, torch.float16) and w.is_contiguous() \
            and w.shape[1] % GROUP == 0:
        return (5, w, None, None, layer.bias)
    return _dense(w, layer.bias)


def _dense(w: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """BLAS in the weights' own dtype (a slot view stays a view); the bias follows it."""
    return (0, w, None, None, None if bias is None else bias.to(w.dtype))


def rows_exact(specs: list[tuple]) -> bool:
    return all(spec[0] in ROW_EXACT_KINDS for spec in specs)


class NativeLM:
    """Same interface and weights as a :class:`LeanLM`, forward in one C++ call."""

    def __init__(self, lean: LeanLM, ext: Any) -> None:
        a = lean.arch
        self.lean, self.arch, self.vocab = lean, a, lean.vocab
        self.device = lean.device
        self.isa = str(ext.kernel_path())
        quantised = isinstance(lean.lm_head, (Int4Linear, Int8Linear))
        specs: list[tuple] = []

        def lin(p: Linear) -> tuple:
            specs.append(linear_spec(p))
            return specs[-1]

        layers = [(L.ln1, L.ln2, [lin(p) for p in L.qkv], lin(L.o),
                   [lin(p) for p in L.gate_up], lin(L.down)) for L in lean.layers]
        tied = lean.tied_rows  # the embedding is the packed LM head's rows: C++ reads them
        # The model copies every packed block (joined, then into huge pages), reading a
        # prepared target's file mapping page fault by page fault: on one thread, as two
        # PyTorch threads faulting the same mapping took 4x as long (0.05 s -> 0.2 s of a
        # fresh start on 2 cores)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.model = ext.Model((a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate,
                                    a.eps),
                                   None if tied else lean.embed_w,
                                   None if tied else lean.embed_scale, layers, lean.norm,
                                   lin(lean.lm_head), a.rope_theta, arena=arena.take())
        finally:
            torch.set_num_threads(threads)
        arena.remember(self.model.block_bytes())  # the next start's block (arena.py)
        if isinstance(lean.lm_head, PackedInt8Linear):  # Python reads the C++ copy's rows
            lean.lm_head.parts = dict(zip(q8blocks.PARTS, self.model.head_parts(), strict=True))
        self.act_dtype = torch.float32  # the C++ forward's rows between kernels
        # rows are computed independently when every kernel is one of ours, so a prompt
        # prefilled in chunks leaves a bit-identical cache (tests/test_engine.py checks)
        self.exact_chunks = rows_exact(specs)
        self.model.set_pad_rows(DENSE_PAD_ROWS)
        self._weight_bytes = lean.weight_bytes
        if quantised:  # the C++ side holds its own packed copy of every projection (the
            lean.layers = []  # LM head stays: draft heads read its rows)
        # per-layer views of the cache last used, kept with the cache tensor they view (an
        # id() alone could be reused by a later cache at a freed address)
        self._views: tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._cache: KVCache | None = None

    cache_dtype = torch.float32  # the C++ attention reads fp32 keys and values
    k_blocked = True

    def new_cache(self, capacity: int) -> KVCache:
        if self._cache is None or self._cache.capacity < capacity:
            self._cache = alloc_cache(self.arch, capacity, self.cache_dtype, self.device, True,
                                      len(self.lean.feature_layers))
        return self._cache

    def _layer_views(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._views is None or self._views[0] is not cache.k:
            self._views = (cache.k, list(cache.k.unbind(0)), list(cache.v.unbind(0)))
        return self._views[1], self._views[2]

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        k, v = self._layer_views(cache)
        return self.model.forward(ids, pos, k, v, last_only, self.lean.feature_layers,
                                  cache.feat)

    @property
    def weight_bytes(self) -> int:
        return self._weight_bytes


def accelerate(lean: LeanLM) -> LeanLM | NativeLM:
    """The native forward for a CPU model when the extension is available (runners.py
    picks this or CUDA graphs by device)."""
    if lean.device.type != "cpu":
        return lean
    ext = extension()
    return NativeLM(lean, ext) if ext is not None else lean


def main(argv: list[str]) -> int:
    """`python -m memspec.procs.decoder.forward.native [--all | --isa PATH] [-v]`: build the chosen
    path now (``--all``: every path this CPU runs, two at a time, for the suite's per-path
    tests; one build's compile leaves a core idle most of its time)."""
    if "--isa" in argv:
        paths: tuple[str, ...] = (argv[argv.index("--isa") + 1],)
    else:
        paths = isa_mod.supported() if "--all" in argv else (isa_mod.chosen_isa(),)
    if len(paths) == 1:
        return 0 if extension(verbose="-v" in argv, isa=paths[0]) is not None else 1
    from concurrent.futures import ThreadPoolExecutor

    def one(path: str) -> int:
        cmd = [sys.executable, "-m", "memspec.procs.decoder.forward.native", "--isa", path]
        return subprocess.run(cmd + (["-v"] if "-v" in argv else [])).returncode

    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        codes = list(pool.map(one, paths))
    return max(codes)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, IndexError) as exc:
        msg = str(exc) if isinstance(exc, ConfigError) else "--isa needs a path name"
        print(f"memspec: error: {msg}", file=sys.stderr)
        sys.exit(2)
