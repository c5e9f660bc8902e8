"""Draft heads (``kind = "head"``): EAGLE-style drafts that read the target's features.

A head is one decoder layer. Its input at position j is the target's token embedding of
token j beside ``g``: for a position the target has processed, ``g = fc(f)`` where ``f``
is the target's residual stream after a few layers (``feature_layers``) at position j-1;
for the head's own proposals, ``g`` is the head's previous output. The residual runs on
``g``; logits come from the *target's* final norm and the target's LM-head rows of the
draft vocabulary (the id map). So a slot holds only the head's own weights (fc + one
layer, ~10 MB in bf16) while the embedding and LM head are read from the resident target.

File (``model.safetensors`` beside a ``config.json`` with ``"memspec_kind": "head"``):
``fc.weight`` [h, n*h], ``norm_e.weight``, ``norm_g.weight`` [h], ``q_proj/k_proj/v_proj``
[*, 2h], ``o_proj`` [h, h], ``post_attention_layernorm.weight`` [h], ``gate_proj/up_proj``
[I, h], ``down_proj`` [h, I] (all ``.weight``), and ``memspec.draft_to_target`` [V_draft].
A packed head (what the pool ships) holds its matrices in the block kernels' own layout
instead: ``fc``, ``qkv_proj`` (q, k and v stacked), ``o_proj``, ``gate_up_proj`` (gate over
up) and ``down_proj``, each as Q8_0 blocks ``.q8w/.q8d/.q8c/.q8s`` (q8blocks.py) or Q4_1
blocks ``.q4n/.q4d/.q4m`` (q4blocks.py); the norms stay ``.weight``. The pool's heads keep
``fc`` Q8_0 and the layer Q4_1 (``Q4_MATRICES``): a draft step reads 2.6 MB instead of 5.4.

The head's KV cache holds real (target-featured) positions only up to the committed length
minus one: after every iteration the accepted tokens are re-run with the target's
features, as EAGLE does, instead of keeping K/V computed from the head's own guesses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memspec.common.errors import ModelError
from memspec.common.tuned import knob
from memspec.procs.decoder.forward import q4blocks, q8blocks
from memspec.procs.decoder.forward.cudagraph import GraphLM, HeadSteps
from memspec.procs.decoder.forward.lean import (
    Arch,
    KVCache,
    LeanLM,
    alloc_cache,
    attend,
    rope,
    rope_tables,
)
from memspec.procs.decoder.forward.linear import DenseLinear, Int8Linear, Linear
from memspec.procs.decoder.forward.native import NativeLM, extension, linear_spec
from memspec.procs.decoder.forward.q8blocks import PackedInt8Linear

HEAD_KIND = "head"
HEAD_TENSORS = ("fc", "norm_e", "norm_g", "q_proj", "k_proj", "v_proj", "o_proj",
                "post_attention_layernorm", "gate_proj", "up_proj", "down_proj")
NORMS = ("norm_e", "norm_g", "post_attention_layernorm")
# the matrices of a Q8_0-stored head, as the C++ head runs them (stacked projections read
# the same rows: one call, the rows quantised once)
PACKED = {"fc": ("fc",), "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
          "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
MATRICES = {f"{m}.weight" for members in PACKED.values() for m in members}  # 16-bit names
FORMATS = {"q8": q8blocks, "q4": q4blocks}
# the matrices a head file holds as Q4_1 (the rest Q8_0), chosen on dev: the layer runs once
# per proposal, fc only in the teacher pass and its rounding costs the most acceptance
Q4_MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class HeadArch:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    feature_layers: tuple[int, ...]
    vocab: int  # draft vocabulary (rows of the target's LM head it reads)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> HeadArch:
        try:
            return cls(hidden=int(cfg["hidden_size"]), heads=int(cfg["num_attention_heads"]),
                       kv_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg["head_dim"]),
                       intermediate=int(cfg["intermediate_size"]),
                       eps=float(cfg["rms_norm_eps"]), rope_theta=float(cfg["rope_theta"]),
                       feature_layers=tuple(int(x) for x in cfg["feature_layers"]),
                       vocab=int(cfg["draft_vocab"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"head config is missing or has a bad field ({exc})",
                             "rebuild the head with `memspec zoo drafts`") from None

    def as_arch(self) -> Arch:
        """The one-layer shape its KV cache needs."""
        return Arch(hidden=self.hidden, layers=1, heads=self.heads, kv_heads=self.kv_heads,
                    head_dim=self.head_dim, intermediate=self.intermediate, vocab=self.vocab,
                    eps=self.eps, rope_theta=self.rope_theta, tie=False, qkv_bias=False,
                    max_pos=1 << 30)

    @property
    def features(self) -> int:
        return len(self.feature_layers) * self.hidden

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, nq, nk = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"fc": (h, self.features), "norm_e": (h,), "norm_g": (h,), "q_proj": (nq, 2 * h),
                "k_proj": (nk, 2 * h), "v_proj": (nk, 2 * h), "o_proj": (h, nq),
                "post_attention_layernorm": (h,), "gate_proj": (self.intermediate, h),
                "up_proj": (self.intermediate, h), "down_proj": (h, self.intermediate)}


def scored_rows(to_target: torch.Tensor) -> torch.Tensor:
    """The head's draft vocabulary as the runtime scores it: its first ``head.VOCAB`` ids
    (tuned on dev; None: all). A draft vocabulary is frequency-ranked, so a cut keeps the
    commonest ids, and the LM rows are most of a draft step's work. Looked-up tokens
    outside the cut are still proposed (a head embeds any target id)."""
    rows = knob("head.VOCAB")
    return to_target[:rows] if rows and rows < to_target.numel() else to_target


def stop_floor(device: torch.device | str = "cpu") -> float:
    """``head.STOP`` (tuned.json, chosen on dev): a head's proposal whose top probability is
    below it ends the iteration's proposals (0: always gamma). On a CPU every proposal is
    another verify row and draft step, and most rejected ones were proposed unsure. On a
    GPU extra verify rows are free (a 5-row verify costs one step on an H200), so a head
    there always proposes gamma."""
    if torch.device(device).type != "cpu":
        return 0.0
    return float(knob("head.STOP") or 0.0)


def first_floor(device: torch.device | str = "cpu") -> float:
    """``head.FIRST`` (tuned.json, chosen on dev): a head whose *first* proposal's top
    probability is below it proposes nothing, and the iteration is a target step (0: a head
    always proposes one). That proposal costs no draft step (the head's catch-up computed
    it) but a second verify row: ~a fifth of a target step on a 2-core CPU, paid back only
    where it is accepted, and most first proposals a head makes unsure are rejected. Free
    on a GPU, as ``head.STOP``."""
    if torch.device(device).type != "cpu":
        return 0.0
    return float(knob("head.FIRST") or 0.0)


def unsure(row: torch.Tensor, floor: float) -> bool:
    """The head's top probability over the rows it scores is below ``floor``. The engine
    and the tables ask it of the same row bits, so they stop at the same proposal."""
    if floor <= 0.0:
        return False
    return float(torch.softmax(row.float(), -1).max()) < floor


def is_head(model_dir: Path) -> bool:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return cfg.get("memspec_kind") == HEAD_KIND


def read_head_config(model_dir: Path) -> tuple[HeadArch, dict]:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {model_dir}/config.json ({exc})",
                         "rebuild the head with `memspec zoo drafts`") from None
    return HeadArch.from_config(cfg), cfg


def matrix_format(weights: Mapping[str, torch.Tensor], joined: str) -> str | None:
    """How a packed head stores one of its joined matrices ("q8", "q4"; None: 16-bit)."""
    for fmt, blocks in FORMATS.items():
        if f"{joined}.{blocks.PARTS[0]}" in weights:
            return fmt
    return None


def is_packed(weights: Mapping[str, torch.Tensor]) -> bool:
    """The head's matrices are stored as packed blocks (q8blocks.py, q4blocks.py)."""
    return matrix_format(weights, "fc") is not None


def wanted_format(joined: str, q4: tuple[str, ...] = Q4_MATRICES) -> str:
    return "q4" if joined in q4 else "q8"


def pack_head(tensors: Mapping[str, torch.Tensor], q4: tuple[str, ...] = Q4_MATRICES
              ) -> dict[str, torch.Tensor] | None:
    """A 16-bit head's tensors with its matrices as packed blocks, Q4_1 for the joined
    matrices named in ``q4`` and Q8_0 for the rest (the norms and any metadata as they
    are); None where a shape does not tile (the head stays 16-bit)."""
    out = {k: v for k, v in tensors.items() if k not in MATRICES}
    for joined, members in PACKED.items():
        w = torch.cat([tensors[f"{m}.weight"].float() for m in members])
        blocks = FORMATS[wanted_format(joined, q4)]
        if not blocks.packable(tuple(w.shape)):
            return None
        out.update({f"{joined}.{p}": t for p, t in blocks.pack(w).items()})
    return out


def dense_weights(weights: Mapping[str, torch.Tensor], arch: HeadArch, dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """Every matrix as dense [N, K] by its 16-bit name (a packed head unpacked to ``dtype``:
    the PyTorch forward's and the trainer's copy), norms as stored."""
    if not is_packed(weights):
        return {k[:-len(".weight")]: v for k, v in weights.items() if k.endswith(".weight")}
    out = {n: weights[f"{n}.weight"] for n in NORMS}
    shapes = arch.shapes()
    for joined, members in PACKED.items():
        blocks = FORMATS[matrix_format(weights, joined) or "q8"]
        parts = {p: weights[f"{joined}.{p}"] for p in blocks.PARTS}
        dense = blocks.unpack(parts).to(dtype)
        out.update(zip(members, torch.split(dense, [shapes[m][0] for m in members])))
    return out


def check_weights(name: str, arch: HeadArch, weights: Mapping[str, torch.Tensor]) -> None:
    shapes = arch.shapes()
    if is_packed(weights):
        return _check_packed(name, shapes, weights)
    for key, shape in shapes.items():
        w = weights.get(f"{key}.weight")
        if w is None:
            raise ModelError(f"head '{name}' has no tensor {key}.weight",
                             "rebuild the head's model.safetensors")
        if tuple(w.shape) != shape:
            raise ModelError(f"head '{name}' tensor {key}.weight has shape {tuple(w.shape)}, "
                             f"its config says {shape}", "rebuild the head's model.safetensors")
    extra = sorted(set(weights) - {f"{k}.weight" for k in shapes})
    if extra:
        raise ModelError(f"head '{name}' has an unexpected tensor {extra[0]}",
                         "rebuild the head's model.safetensors")


def _check_packed(name: str, shapes: Mapping[str, tuple[int, ...]],
                  weights: Mapping[str, torch.Tensor]) -> None:
    fix = "rebuild the head's model.safetensors"
    expected = {f"{n}.weight" for n in NORMS}
    for n in NORMS:
        w = weights.get(f"{n}.weight")
        if w is None or tuple(w.shape) != shapes[n]:
            raise ModelError(f"head '{name}' tensor {n}.weight is missing or misshapen", fix)
    for joined, members in PACKED.items():
        rows = sum(shapes[m][0] for m in members)
        blocks = FORMATS[matrix_format(weights, joined) or "q8"]
        parts = {p: weights[f"{joined}.{p}"] for p in blocks.PARTS
                 if f"{joined}.{p}" in weights}
        bad = blocks.check(joined, parts, (rows, shapes[members[0]][1]))
        if bad:
            raise ModelError(f"head '{name}': {bad}", fix)
        expected |= {f"{joined}.{p}" for p in blocks.PARTS}
    extra = sorted(set(weights) - expected)
    if extra:
        raise ModelError(f"head '{name}' has an unexpected tensor {extra[0]}", fix)


class TargetParts:
    """What a head reads from the resident target: embeddings, final norm, LM-head rows."""

    def __init__(self, target: Any) -> None:
        lean = getattr(target, "lean", target)
        self.target = target
        if isinstance(lean, LeanLM):
            self.norm = lean.norm.float()
            self.eps = lean.arch.eps
            self._head = lean.lm_head
            self._embed = lean.embed if not hasattr(target, "model") else \
                (lambda ids: target.model.embed(ids))
        else:  # HF module
            model = target.model
            inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
            self.norm = inner.norm.weight.detach().float()
            self.eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
            self._head = DenseLinear(model.get_output_embeddings().weight.detach())
            self._embed = model.get_input_embeddings()
        self._subsets: dict[int, Linear] = {}
        self._packed: dict[tuple[int, int], Any] = {}  # (id(subset), id(ext)) -> C++ Linear

    def native_lm(self, lin: Linear, ext: Any) -> Any:
        """The C++ LM-head rows of a draft vocabulary, packed once for every head that
        shares them (a bind then costs no packing)."""
        key = (id(lin), id(ext))
        if key not in self._packed:
            self._packed[key] = ext.Linear(linear_spec(lin))
        return self._packed[key]

    def prepare(self, to_target: torch.Tensor) -> None:
        """Build a draft vocabulary's LM rows (and their C++ packing) now: on an int4
        target that is a dequantisation of the whole LM head and a repacking, ~20 ms that
        would otherwise land in the first bind of a fresh decoder's first request."""
        lin = self.lm_rows(to_target.to(torch.long))
        if isinstance(self.target, NativeLM):
            ext = extension(isa=self.target.isa)
            if ext is not None:
                self.native_lm(lin, ext)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self._embed(ids).float()

    def lm_rows(self, to_target: torch.Tensor) -> Linear:
        """The LM head restricted to the draft vocabulary, built once per id map."""
        key = hash(tuple(to_target[:64].tolist())) ^ int(to_target.sum()) ^ to_target.numel()
        lin = self._subsets.get(key)
        if lin is None:
            head = self._head
            if isinstance(head, Int8Linear):
                sub = Int8Linear.__new__(Int8Linear)
                if isinstance(head, PackedInt8Linear):  # from the packed copy, none unpacked
                    sub.q, sub.d = q8blocks.rows(head.parts, to_target)
                else:
                    sub.q, sub.d = head.q[to_target].contiguous(), head.d[to_target].contiguous()
                sub.act_dtype, sub.bias, sub._dense = head.act_dtype, None, None
                lin = sub
            elif isinstance(head, DenseLinear):
                lin = DenseLinear(head.weight[to_target].contiguous())
            else:  # int4 heads: go through dequantised rows
                lin = DenseLinear(head.dequantize()[to_target].to(torch.bfloat16).contiguous())
            self._subsets[key] = lin
        return lin


class HeadRunner:
    """Runs one bound head; the engine calls :meth:`teacher` then :meth:`step`."""

    kind = HEAD_KIND
    cache_dtype: torch.dtype | None = None
    k_blocked = False

    def __init__(self, name: str, arch: HeadArch, weights: Mapping[str, torch.Tensor],
                 parts: TargetParts, to_target: torch.Tensor) -> None:
        check_weights(name, arch, weights)
        self.name, self.arch, self.parts = name, arch, parts
        self.vocab = arch.vocab
        self.cache_arch = arch.as_arch()
        self.device = weights["norm_e.weight"].device
        self.act_dtype = weights["norm_e.weight"].dtype
        self.packed = weights if is_packed(weights) else None
        # the PyTorch forward's weights: the slot's views; a packed head runs the C++ head
        # on the slot's arrays, or where that does not run (a GPU, no build) a dense copy
        self.w = dense_weights(weights, arch, self.act_dtype) if self.packed is None else {}
        self.lm = parts.lm_rows(to_target.to(torch.long))
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self._views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.native = _native_head(self)
        if self.native is None and self.packed is not None:
            self.w = dense_weights(weights, arch, self.act_dtype)
        # CUDA graphs for the draft steps when the target replays them too (the engine's
        # `fast` setting): a step is ~40 small kernels, launch-bound on a GPU
        self.graphs = HeadSteps(self) if isinstance(parts.target, GraphLM) else None
        if self.native is not None:
            self.cache_dtype, self.k_blocked = torch.float32, True

    def new_cache(self, capacity: int) -> KVCache:
        return alloc_cache(self.cache_arch, capacity, self.cache_dtype or self.act_dtype,
                           self.device, self.k_blocked)

    # ---- the two calls the engine makes ------------------------------------------------
    def teacher(self, ids: torch.Tensor, pos: int, cache: KVCache, feats: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for committed tokens ``ids`` at pos.. with the target's features of the
        positions before each; returns the last row's logits and output."""
        emb = self.parts.embed(ids)
        if self.native is not None:
            g = self.native.fc(feats)
            return self._native_forward(emb, g, pos, cache)
        g = F.linear(feats.to(self.act_dtype), self.w["fc"]).float()
        return self._forward(emb, g, pos, cache)

    def step(self, token: torch.Tensor, pos: int, cache: KVCache, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One proposal after another: the token just proposed, the head's last output."""
        if self.graphs is not None:
            self._check_room(pos + 1, cache)
            return self.graphs(token, pos, cache, hidden)
        if self.native is not None:  # the token's embedding looked up in the same C++ call
            k, v = self._kv(cache)
            return self.native.step(self.parts.target.model, token, hidden, pos, k, v)
        return self._forward(self.parts.embed(token), hidden, pos, cache)

    def _native_forward(self, emb, g, pos, cache):
        k, v = self._kv(cache)
        logits, rows = self.native.forward(emb, g, pos, k, v, True)
        return logits, rows

    def _kv(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V views of `cache`, kept with the cache tensor they view (a
        step is ~0.2 ms, and two fresh views from Python cost ~3 us of it)."""
        if self._views is None or self._views[0] is not cache.k:
            self._views = (cache.k, cache.k[0], cache.v[0])
        return self._views[1], self._views[2]

    # ---- the reference forward (PyTorch) ----------------------------------------------
    def _forward(self, emb: torch.Tensor, g: torch.Tensor, pos: int, cache: KVCache
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        T = emb.shape[0]
        end = pos + T
        self._check_room(end, cache)
        if end > self._rope_len:
            n = max(end, 2 * self._rope_len, 256)
            self._cos, self._sin = rope_tables(self.cache_arch, n, self.act_dtype, self.device)
            self._rope_len = n
        bias = None
        if T > 1:
            hidden = torch.arange(end, device=self.device)[None, :] > \
                torch.arange(pos, end, device=self.device)[:, None]
            bias = torch.zeros(hidden.shape, dtype=self.act_dtype, device=self.device
                               ).masked_fill_(hidden, float("-inf"))
        return self._layer(emb, g, pos, cache, self._cos[pos:end], self._sin[pos:end], bias,
                           end)

    @staticmethod
    def _check_room(end: int, cache: KVCache) -> None:
        if end > cache.capacity:
            raise ModelError(f"context of {end} tokens exceeds the head's KV cache",
                             "raise max_context in the pool")

    def _layer(self, emb: torch.Tensor, g: torch.Tensor, at: int | torch.Tensor,
               cache: KVCache, cos: torch.Tensor, sin: torch.Tensor,
               bias: torch.Tensor | None, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's layer and LM rows. ``at``: the first position (K/V written into a
        slice) or a tensor of positions (``index_copy_``: what a CUDA graph replays)."""
        a, w = self.arch, self.w
        T = emb.shape[0]
        dt = self.act_dtype
        x = g.float()
        a_in = torch.cat([F.rms_norm(emb, (a.hidden,), w["norm_e"].float(), a.eps),
                          F.rms_norm(x, (a.hidden,), w["norm_g"].float(), a.eps)], -1).to(dt)
        q = rope(F.linear(a_in, w["q_proj"]).view(T, a.heads, a.head_dim), cos, sin)
        k = rope(F.linear(a_in, w["k_proj"]).view(T, a.kv_heads, a.head_dim), cos, sin)
        v = F.linear(a_in, w["v_proj"]).view(T, a.kv_heads, a.head_dim)
        kc, vc = cache.k[0], cache.v[0]
        if isinstance(at, int):
            kc[:, at:at + T] = k.transpose(0, 1)
            vc[:, at:at + T] = v.transpose(0, 1)
        else:
            kc.index_copy_(1, at, k.transpose(0, 1).to(kc.dtype))
            vc.index_copy_(1, at, v.transpose(0, 1).to(vc.dtype))
        x = x + F.linear(attend(q, kc[:, :keys], vc[:, :keys], bias), w["o_proj"]).float()
        h = F.rms_norm(x, (a.hidden,), w["post_attention_layernorm"].float(), a.eps).to(dt)
        x = x + F.linear(F.silu(F.linear(h, w["gate_proj"])) * F.linear(h, w["up_proj"]),
                         w["down_proj"]).float()
        last = x[-1:]
        hn = F.rms_norm(last, (a.hidden,), self.parts.norm, self.parts.eps)
        return self.lm(hn.to(self._lm_dtype())).float(), last

    # ---- the static-shape step a CUDA graph captures ------------------------------------
    def graph_tables(self, capacity: int) -> tuple[torch.Tensor, ...]:
        """RoPE tables and key indices over a whole cache, owned by the graph that reads
        them by address (the eager tables are regrown, and so reallocated, as contexts grow)."""
        cos, sin = rope_tables(self.cache_arch, capacity, self.act_dtype, self.device)
        return cos, sin, torch.arange(capacity, device=self.device)

    def graph_step(self, token: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                   hidden: torch.Tensor, tables: tuple[torch.Tensor, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` with its position as device data: attention reads the whole cache
        with the keys after ``pos`` masked, so one capture serves every position."""
        cos, sin, keys = tables
        at = pos.view(1)
        bias = torch.zeros(1, keys.numel(), dtype=self.act_dtype, device=self.device
                           ).masked_fill_(keys[None, :] > at[:, None], float("-inf"))
        return self._layer(self.parts.embed(token), hidden, at, cache,
                           cos.index_select(0, at), sin.index_select(0, at), bias, keys.numel())

    def _lm_dtype(self) -> torch.dtype:
        return getattr(self.lm, "act_dtype", None) or self.lm.weight.dtype


def _native_head(runner: HeadRunner):
    """The C++ head when the target runs the C++ forward (same build, same kernel path):
    packed blocks through the block kernels on the slot's own bytes, bf16 weights through
    the path's 16-bit kernel (native bf16 dot products or widened to fp32, never emulated
    bf16 arithmetic), the LM rows through the int8 block kernel."""
    target = runner.parts.target
    if not isinstance(target, NativeLM) or runner.device.type != "cpu":
        return None
    ext = extension(isa=target.isa)
    if ext is None:
        return None
    a, p = runner.arch, runner.packed
    w = runner.w if p is None else {n: p[f"{n}.weight"] for n in NORMS}

    def lin(name: str) -> tuple:  # a packed head: the slot's arrays, as they are
        if p is None:
            return linear_spec(DenseLinear(runner.w[name]))
        if matrix_format(p, name) == "q4":
            return (7, p[f"{name}.q4n"], p[f"{name}.q4d"], p[f"{name}.q4m"], None)
        return (6, p[f"{name}.q8w"], p[f"{name}.q8d"], (p[f"{name}.q8c"], p[f"{name}.q8s"]),
                None)

    qkv = [lin("qkv_proj")] if p is not None else [lin(n) for n in PACKED["qkv_proj"]]
    gate_up = [lin("gate_up_proj")] if p is not None else \
        [lin(n) for n in PACKED["gate_up_proj"]]
    return ext.Head((a.hidden, a.heads, a.kv_heads, a.head_dim, a.intermediate, a.eps),
                    lin("fc"), w["norm_e"], w["norm_g"], qkv, lin("o_proj"),
                    w["post_attention_layernorm"], gate_up, lin("down_proj"),
                    runner.parts.norm, runner.parts.native_lm(runner.lm, ext), a.rope_theta)
