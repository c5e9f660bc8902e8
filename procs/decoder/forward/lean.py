"""A lean Llama-family forward (Llama, Qwen2, Mistral) over static, preallocated KV caches.

Why not the Hugging Face module: at batch 1 a decode step on a CPU is a pass over the
weights plus per-operator overhead, and HF's eager graph (a ``DynamicCache`` that is cropped
and re-concatenated, fp32 everywhere) spends more time on the latter than on the former.
Here every layer is a handful of kernels: fused q/k/v and gate/up projections in the
chosen weight format (:mod:`memspec.procs.decoder.forward.linear`), rotary tables sliced by
position, K/V written in place at ``pos`` and attention over ``[:pos + T]``. Rolling a
request back is a change of the caller's length: nothing is truncated or copied.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memspec.common.errors import ModelError
from memspec.procs.decoder.forward.linear import (
    GROUP,
    DenseLinear,
    Int8Linear,
    Linear,
    fuse_prebuilt,
    make_linear,
)

LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")


class UnsupportedArch(ModelError):
    """The config needs features the lean forward does not implement (HF path instead)."""


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    tie: bool
    qkv_bias: bool
    max_pos: int

    @classmethod
    def from_config(cls, cfg: Mapping) -> Arch:
        mtype = cfg.get("model_type")
        if mtype not in LEAN_MODEL_TYPES:
            raise UnsupportedArch(f"model_type '{mtype}' has no lean forward")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rtype = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rtype != "default":
            raise UnsupportedArch(f"rope scaling '{rtype}' has no lean forward")
        if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
            raise UnsupportedArch("only SiLU MLPs without bias have a lean forward")
        if mtype == "llama" and cfg.get("attention_bias"):
            raise UnsupportedArch("llama attention_bias has no lean forward")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if mtype in ("mistral", "qwen2") and window and int(window) < max_pos:
            max_pos = int(window)  # full attention is exact up to the window
        return cls(hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads),
                   intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
                   eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                   tie=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=mtype == "qwen2", max_pos=max_pos)


def projection_shapes(a: Arch) -> dict[str, tuple[int, int]]:
    """(out, in) of every weight matrix by its module's last name."""
    nq, nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
    return {"q_proj": (nq, a.hidden), "k_proj": (nk, a.hidden), "v_proj": (nk, a.hidden),
            "o_proj": (a.hidden, nq), "gate_proj": (a.intermediate, a.hidden),
            "up_proj": (a.intermediate, a.hidden), "down_proj": (a.hidden, a.intermediate),
            "embed_tokens": (a.vocab, a.hidden), "lm_head": (a.vocab, a.hidden)}


@dataclass
class KVCache:
    """K and V for every layer: [layers, kv_heads, capacity, head_dim], written in place.

    With ``k_blocked`` K is [layers, kv_heads, capacity / 16, head_dim, 16] (the C++
    forward's layout: scores for 16 consecutive keys are one vector of floats)."""

    k: torch.Tensor
    v: torch.Tensor
    k_blocked: bool = False
    feat: torch.Tensor | None = None  # [capacity, layers * hidden]: features for draft heads

    @property
    def capacity(self) -> int:
        return self.v.shape[2]


def alloc_cache(arch: Arch, capacity: int, dtype: torch.dtype, device: torch.device,
                k_blocked: bool = False, feature_layers: int = 0) -> KVCache:
    if k_blocked:
        capacity = -(-capacity // 16) * 16
    shape = (arch.layers, arch.kv_heads, capacity, arch.head_dim)
    kshape = (arch.layers, arch.kv_heads, capacity // 16, arch.head_dim, 16) if k_blocked \
        else shape
    feat = _zeros((capacity, feature_layers * arch.hidden), torch.float32, device) \
        if feature_layers else None
    return KVCache(_zeros(kshape, dtype, device), _zeros(shape, dtype, device), k_blocked, feat)


def kv_cache_bytes(runner: object, capacity: int) -> int:
    """What a runner's KV cache of `capacity` positions holds when every position is
    written (alloc_cache's shapes; 0 for a runner without a lean architecture)."""
    arch = getattr(runner, "arch", None)
    if not isinstance(arch, Arch):
        return 0
    dtype = getattr(runner, "cache_dtype", None) or getattr(runner, "act_dtype", torch.float32)
    per = 2 * arch.layers * arch.kv_heads * arch.head_dim * torch.tensor([], dtype=dtype
                                                                         ).element_size()
    return per * (-(-capacity // 16) * 16)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost memory only where written, on a CPU: an anonymous mapping's pages are
    zeroed by the kernel on first touch, in 4 KiB pages (no huge-page advice, which would
    make every touched 2 MB resident), so a cache sized for the pool's whole context holds
    only the positions requests reached (torch.zeros writes every byte: the demo target's
    2048 positions were 94 MB at start; a 300-token request now touches ~14 MB)."""
    nbytes = math.prod(shape) * 4
    if torch.device(device).type == "cpu" and dtype == torch.float32 and nbytes >= 1 << 20:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.float32).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class LeanLayer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: list[Linear]  # one fused projection, or q, k, v
    o: Linear
    gate_up: list[Linear]  # one fused projection, or gate, up
    down: Linear


def rope_tables(arch: Arch, length: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, head_dim] in the half-split layout HF Llama uses (fp32 maths)."""
    half = arch.head_dim // 2
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, half, device=device,
                                                  dtype=torch.float32) / half))
    ang = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate each head's halves by its position's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
            ) -> torch.Tensor:
    """Causal GQA attention for a few queries. q: [T, H, D]; k, v: [KVH, L, D] -> [T, H*D].

    Plain bmm + softmax + bmm: for the 1..gamma+1 queries of decoding, the fused SDPA
    kernels cost more in set-up than in arithmetic, and their blocking differs between one
    query and several, which would make a token's logits depend on how it was batched.
    """
    T, H, D = q.shape
    kvh = k.shape[0]
    g = H // kvh
    qg = q.view(T, kvh, g, D).permute(1, 2, 0, 3).reshape(kvh, g * T, D)
    s = torch.bmm(qg, k.transpose(1, 2)) * (D ** -0.5)
    if bias is not None:
        s = (s.view(kvh, g, T, -1) + bias).view(kvh, g * T, -1)
    p = torch.softmax(s, dim=-1)
    o = torch.bmm(p, v)  # [kvh, g*T, D]
    return o.view(kvh, g, T, D).permute(2, 0, 1, 3).reshape(T, H * D)


class LeanLM:
    """Weights + forward; the caller owns positions and cache lengths."""

    def __init__(self, arch: Arch, embed: torch.Tensor | None, layers: list[LeanLayer],
                 norm: torch.Tensor, lm_head: Linear, act_dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None) -> None:
        """``embed`` None: the embedding is the int8 LM head's own rows and scales
        (``tied_rows``; a prepared target holds them once, packed: prepared.py)."""
        self.arch, self._embed, self.layers = arch, embed, layers
        self.norm, self.lm_head, self.act_dtype = norm, lm_head, act_dtype
        self._embed_scale = embed_scale  # int8 embedding rows: a scale per 32 values
        self.device = norm.device
        self.vocab = arch.vocab
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self._cache: KVCache | None = None

    @property
    def tied_rows(self) -> bool:
        return self._embed is None

    @property
    def embed_w(self) -> torch.Tensor:
        return self.lm_head.q if self._embed is None else self._embed

    @property
    def embed_scale(self) -> torch.Tensor | None:
        return self.lm_head.d if self._embed is None else self._embed_scale

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_weights(cls, arch: Arch, weights: Mapping[str, torch.Tensor], fmt: str,
                     act_dtype: torch.dtype, fuse: bool = True,
                     linears: Mapping[str, Linear] | None = None) -> LeanLM:
        """Build from an HF state dict. ``fmt``: ``float32``/``bfloat16``/``float16`` keep
        the weights dense in that dtype (views stay views when nothing changes), ``int8`` or
        ``int4`` quantise the projections and the LM head. ``linears``: layers already in
        their final format, by module name (a GPTQ / AWQ checkpoint's: quantized.py), used
        as they are instead of ``<name>.weight``."""
        a = arch
        shapes = projection_shapes(a)
        linears = linears or {}
        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            try:
                w = weights[name]
            except KeyError:
                raise ModelError(f"weight '{name}' is missing", "rebuild the weight file") from None
            part = name.split(".")[-2]
            want = shapes.get(part, (a.hidden,)) if name.endswith("weight") else None
            if want is not None and tuple(w.shape) != want:
                raise ModelError(f"weight '{name}' has shape {tuple(w.shape)}, the config "
                                 f"says {want}", "rebuild the weight file from its config")
            used.add(name)
            return w

        def lin(*names: str, bias: bool = False) -> list[Linear]:
            if all(n in linears for n in names):
                built = [linears[n] for n in names]
                return fuse_prebuilt(built) if fuse else built
            ws = [get(f"{n}.weight") for n in names]
            bs = [get(f"{n}.bias") for n in names] if bias else None
            if fuse and len(ws) > 1:
                w = torch.cat([x.to(act_dtype) if fmt not in ("int8", "int4") else x.float()
                               for x in ws])
                b = torch.cat([x.to(act_dtype) for x in bs]) if bs else None
                return [make_linear(w, fmt, act_dtype, b)]
            return [make_linear(w, fmt, act_dtype, None if bs is None else bs[i])
                    for i, w in enumerate(ws)]

        layers = []
        for i in range(arch.layers):
            p = f"model.layers.{i}"
            sa = f"{p}.self_attn"
            layers.append(LeanLayer(
                ln1=get(f"{p}.input_layernorm.weight").to(act_dtype),
                ln2=get(f"{p}.post_attention_layernorm.weight").to(act_dtype),
                qkv=lin(f"{sa}.q_proj", f"{sa}.k_proj", f"{sa}.v_proj", bias=arch.qkv_bias),
                o=lin(f"{sa}.o_proj")[0],
                gate_up=lin(f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"),
                down=lin(f"{p}.mlp.down_proj")[0]))
        embed = get("model.embed_tokens.weight")
        if "lm_head" in linears:  # a quantised LM head of its own (never tied)
            lm_head = linears["lm_head"]
        else:
            head_w = embed if arch.tie else get("lm_head.weight")
            # int4 layers keep an int8 LM head: the vocabulary projection is where low-bit
            # rounding moves the argmax most (GGUF files store it as Q8_0 for that reason)
            lm_head = make_linear(head_w, "int8" if fmt == "int4" else fmt, act_dtype)
        embed_scale = None
        if arch.tie and isinstance(lm_head, Int8Linear):
            embed, embed_scale = lm_head.q, lm_head.d  # int8 rows serve both ends
        elif arch.tie and isinstance(lm_head, DenseLinear):
            embed = lm_head.weight
        else:
            embed = embed.to(act_dtype)
        norm = get("model.norm.weight").to(act_dtype)
        extra = sorted(k for k in weights if k not in used and not k.endswith("inv_freq")
                       and not (arch.tie and k == "lm_head.weight"))
        if extra:
            raise ModelError(f"weight '{extra[0]}' is not part of the configured model",
                             "rebuild the weight file from its config")
        return cls(arch, embed, layers, norm, lm_head, act_dtype, embed_scale)

    # ---- caches -------------------------------------------------------------------------
    cache_dtype: torch.dtype | None = None  # None: the activation dtype
    k_blocked = False
    # layers whose outputs the cache keeps per position (draft heads read them); set before
    # the first new_cache()
    feature_layers: list[int] = []

    def new_cache(self, capacity: int) -> KVCache:
        """A zeroed cache of ``capacity`` positions; reused while it is large enough."""
        if self._cache is None or self._cache.capacity < capacity:
            self._cache = alloc_cache(self.arch, capacity, self.cache_dtype or self.act_dtype,
                                      self.device, self.k_blocked, len(self.feature_layers))
        return self._cache

    def _tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        if end > self._rope_len:
            n = max(end, 2 * self._rope_len, 256)
            self._cos, self._sin = rope_tables(self.arch, n, self.act_dtype, self.device)
            self._rope_len = n
        return self._cos, self._sin

    # ---- forward ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_w[ids]
        if self.embed_scale is not None:  # Q8_0 rows: one scale per 32 values
            T, h = x.shape
            x = (x.float().view(T, -1, GROUP) * self.embed_scale[ids][..., None]).view(T, h)
        return x.to(self.act_dtype)

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        """Logits [T, V] (or [1, V]) for ``ids`` [T] at positions pos..pos+T-1; K/V of those
        positions are written into ``cache``, attention reads positions [0, pos + T)."""
        T = ids.numel()
        end = pos + T
        if end > cache.capacity:
            raise ModelError(f"context of {end} tokens exceeds the KV cache's {cache.capacity}",
                             "raise max_context in the pool or shorten the request")
        cos_t, sin_t = self._tables(end)
        bias = None
        if T > 1:  # query pos+i sees keys [0, pos+i]: an additive -inf bias on the rest
            bias = self.causal_bias(torch.arange(pos, end, device=self.device), end)
        x = self.layers_forward(self.embed(ids), pos, cache, cos_t[pos:end], sin_t[pos:end],
                                bias, end)
        return self.head(x[-1:] if last_only else x)

    def causal_bias(self, positions: torch.Tensor, keys: int) -> torch.Tensor:
        """Additive attention bias [T, keys]: 0 where key <= the query's position, else -inf."""
        hidden = torch.arange(keys, device=self.device)[None, :] > positions[:, None]
        bias = torch.zeros(hidden.shape, dtype=self.act_dtype, device=self.device)
        return bias.masked_fill_(hidden, float("-inf"))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(F.rms_norm(x, (self.arch.hidden,), self.norm, self.arch.eps))

    def layers_forward(self, x: torch.Tensor, at: int | torch.Tensor, cache: KVCache,
                       cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor | None,
                       keys: int) -> torch.Tensor:
        """The decoder layers over ``x`` [T, hidden]. ``at``: the first position (K/V are
        written into a slice) or a tensor of T positions (written with ``index_copy_``, so
        a CUDA graph can replay it at any position); attention reads keys [0, keys)."""
        a = self.arch
        T = x.shape[0]
        nq, nk = a.heads * a.head_dim, a.kv_heads * a.head_dim
        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (a.hidden,), L.ln1, a.eps)
            if len(L.qkv) == 1:
                q, k, v = L.qkv[0](h).split((nq, nk, nk), dim=-1)
            else:
                q, k, v = (proj(h) for proj in L.qkv)
            q = rope(q.view(T, a.heads, a.head_dim), cos, sin)
            k = rope(k.view(T, a.kv_heads, a.head_dim), cos, sin).transpose(0, 1)
            v = v.view(T, a.kv_heads, a.head_dim).transpose(0, 1)
            kc, vc = cache.k[i], cache.v[i]
            if isinstance(at, int):
                kc[:, at:at + T] = k
                vc[:, at:at + T] = v
            else:
                kc.index_copy_(1, at, k)
                vc.index_copy_(1, at, v)
            if isinstance(at, int) and 1 < T <= DenseLinear.pad_rows:
                # a verify: each row over exactly its own keys, the shapes a step of that
                # token alone has (BLAS and softmax reductions block by length, and a
                # token's logits must not depend on whether it was verified or stepped)
                att = torch.cat([attend(q[j:j + 1], kc[:, :at + j + 1], vc[:, :at + j + 1],
                                         None) for j in range(T)])
            else:
                att = attend(q, kc[:, :keys], vc[:, :keys], bias)
            x = x + L.o(att)
            h = F.rms_norm(x, (a.hidden,), L.ln2, a.eps)
            if len(L.gate_up) == 1:
                g, u = L.gate_up[0](h).chunk(2, dim=-1)
            else:
                g, u = (proj(h) for proj in L.gate_up)
            x = x + L.down(F.silu(g) * u)
            if cache.feat is not None and i in self.feature_layers:
                j = self.feature_layers.index(i)
                rows = cache.feat[:, j * a.hidden:(j + 1) * a.hidden]
                if isinstance(at, int):
                    rows[at:at + T] = x.float()
                else:
                    rows.index_copy_(0, at, x.float())
        return x

    @property
    def weight_bytes(self) -> int:
        n = sum(p.nbytes for L in self.layers for p in (*L.qkv, L.o, *L.gate_up, L.down))
        return n + self.lm_head.nbytes
