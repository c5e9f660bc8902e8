"""The lean forward's CPU fast path: one C++ call per forward (csrc/lean_cpu.cpp).

Built once with PyTorch's extension builder (g++ and ninja; `bash launch/setup.sh` does it)
into ``$MEMSPEC_HOME/build``; later processes load the cached build in well under a second.
Where it cannot be built (no compiler), the pure-PyTorch lean forward runs instead: same
results up to rounding, more Python overhead per step.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from memspec.common.paths import memspec_home
from memspec.procs.decoder.lean import KVCache, LeanLM, alloc_cache
from memspec.procs.decoder.linear import DenseLinear, Int4Linear, Int8Linear, Linear

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "lean_cpu.cpp", CSRC / "qgemm.cpp"]
_EXT: Any = None
_TRIED = False
DENSE_PAD_ROWS = 8  # decode calls (a step, a verify of up to 8 tokens) as 8 rows: lossless
_ACT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def extension(build: bool = True, verbose: bool = False) -> Any:
    """The compiled module, or None when disabled (MEMSPEC_NATIVE=0) or not buildable."""
    global _EXT, _TRIED
    if _TRIED or os.environ.get("MEMSPEC_NATIVE", "1") == "0":
        return _EXT
    _TRIED = True
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(str(CSRC).encode())  # one build per checkout and source text
    for src in SOURCES:
        digest.update(src.read_bytes())
    tag = f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:10]}"
    out = memspec_home() / "build" / f"lean_cpu-{tag}"
    if not build and not any(out.glob("*.so")):
        return None
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        _EXT = load(name="memspec_lean_cpu", sources=[str(p) for p in SOURCES], build_directory=str(out),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=verbose)
    except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why
        print(f"[memspec] native CPU forward unavailable ({type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else ''}); "
              "using the PyTorch path", file=sys.stderr, flush=True)
        _EXT = None
    else:
        spent = time.perf_counter() - t0
        if spent > 5:
            print(f"[memspec] built the native CPU forward in {spent:.0f}s (cached in {out})",
                  file=sys.stderr, flush=True)
    return _EXT


def linear_spec(layer: Linear, vnni: bool, bf16: bool = False,
                act: torch.dtype | None = None) -> tuple:
    """(kind, a, b, c, bias): the C++ side's view of one linear layer's weights. ``act`` is
    the dtype the C++ forward runs its activations in: the dense (BLAS) fallback, taken by
    shapes the kernels do not tile (e.g. a vocabulary that is no multiple of 16), must hold
    its weights and bias in it too."""
    if isinstance(layer, (Int4Linear, Int8Linear)):
        n, k = layer.q.shape
        vnni = vnni and n % 16 == 0 and k % 32 == 0  # the kernels' tile and block sizes
    if isinstance(layer, Int4Linear):
        if vnni:
            return (3, layer.q, layer.d, layer.m, layer.bias)
        packed, sz = layer._torch_pack()
        return (2, packed, sz, None, layer.bias)
    if isinstance(layer, Int8Linear):
        if vnni:
            return (4, layer.q, layer.d, None, layer.bias)
        return _dense(layer.dequantize(), layer.bias, act or layer.act_dtype)
    assert isinstance(layer, DenseLinear)
    w = layer.weight
    if bf16 and w.dtype == torch.bfloat16 and w.is_contiguous() and w.shape[1] % 32 == 0:
        return (5, w, None, None, layer.bias)
    return _dense(w, layer.bias, act or w.dtype)


def _dense(w: torch.Tensor, bias: torch.Tensor | None, act: torch.dtype) -> tuple:
    """Weights already in ``act`` stay what they are (a slot view stays a view)."""
    return (0, w.to(act), None, None, None if bias is None else bias.to(act))


class NativeLM:
    """Same interface and weights as a :class:`LeanLM`, forward in one C++ call."""

    def __init__(self, lean: LeanLM, ext: Any) -> None:
        a = lean.arch
        self.lean, self.arch, self.vocab = lean, a, lean.vocab
        self.device = lean.device
        vnni, bf16 = bool(ext.qgemm_available()), bool(ext.bf16_available())
        quantised = isinstance(lean.lm_head, (Int4Linear, Int8Linear))
        # the VNNI and BF16 kernels take fp32 rows (they round them themselves)
        act = torch.float32 if (vnni and quantised) or (bf16 and lean.act_dtype ==
                                                         torch.bfloat16) else lean.act_dtype

        def lin(p: Linear) -> tuple:
            return linear_spec(p, vnni, bf16, act)

        layers = [(L.ln1, L.ln2, [lin(p) for p in L.qkv], lin(L.o),
                   [lin(p) for p in L.gate_up], lin(L.down)) for L in lean.layers]
        self.model = ext.Model((a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.eps),
                               lean.embed_w, lean.embed_scale, layers, lean.norm,
                               lin(lean.lm_head), a.rope_theta, _ACT_NAMES[act])
        self.act_dtype = act
        self.model.set_pad_rows(DENSE_PAD_ROWS)
        self._weight_bytes = lean.weight_bytes
        if quantised:  # the C++ side holds its own packed copy of every projection (the
            lean.layers = []  # LM head stays: draft heads read its rows)
        self._views: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._cache: KVCache | None = None

    cache_dtype = torch.float32  # the C++ attention reads fp32 keys and values
    k_blocked = True
    # rows are computed independently (no batched reductions across positions), so a prompt
    # prefilled in chunks leaves a bit-identical cache (tests/test_engine.py checks)
    exact_chunks = True

    def new_cache(self, capacity: int) -> KVCache:
        if self._cache is None or self._cache.capacity < capacity:
            self._cache = alloc_cache(self.arch, capacity, self.cache_dtype, self.device, True,
                                      len(self.lean.feature_layers))
        return self._cache

    def _layer_views(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._views is None or self._views[0] != id(cache.k):
            self._views = (id(cache.k), list(cache.k.unbind(0)), list(cache.v.unbind(0)))
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


if __name__ == "__main__":  # `python -m memspec.procs.decoder.native`: build it now
    sys.exit(0 if extension(verbose="-v" in sys.argv) is not None else 1)
