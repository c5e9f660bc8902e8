"""GPTQ and AWQ int4 checkpoints read into the engine's own int4 blocks, without their libraries.

Why: the Hugging Face hub is full of ``*-GPTQ-Int4`` and ``*-AWQ`` folders, and dequantising
one to run it would throw away the memory budget the runtime is about. auto-gptq is
archived and GPTQModel / AutoAWQ are large GPU-first stacks, so the format is read here.

What the files hold (4-bit, int32 words, eight 4-bit codes a word, lowest nibble first):
- GPTQ (AutoGPTQ / GPTQModel / optimum): ``qweight`` [K/8, N] packs 8 *inputs* of an
  output per word; ``qzeros`` [G, N/8] packs 8 *outputs'* zero points; ``scales`` [G, N]
  fp16; ``g_idx`` [K]: the group of each input (act-order ``desc_act`` checkpoints permute
  it). ``checkpoint_format = "gptq"`` (v1, the default and every older folder) stores each
  zero minus one; GPTQModel undoes that by adding 0x11111111 to the whole word (carries
  included), which we do too: per nibble it is ``(stored + 1) mod 16`` wherever no nibble
  wrapped, and only the word-wide add reproduces GPTQModel's own asymmetric saves where one
  did. ``gptq_v2`` stores the zeros as they are.
- AWQ (AutoAWQ / GPTQModel, GEMM packing): ``qweight`` [K, N/8] and ``qzeros`` [G, N/8]
  both pack 8 *outputs* a word in the interleaved order (0, 2, 4, 6, 1, 3, 5, 7): nibble i
  holds output 8c + ORDER[i]; ``scales`` [G, N]; groups are contiguous; zeros as they are.

The mapping (exact): a group of G inputs with scale s and zero z is w = s * (q - z) =
s * q + (-s * z). The engine's int4 blocks are w = d * q + m per 32 inputs (q in [0, 15]),
so every 32-input block of a group takes d = s and m = -s * z. d = s is an fp16 value kept
as it is. m is held in fp16 by the kernels: -s * z is exact in fp32 (an 11-bit mantissa
times a 4-bit integer) but in fp16 it is rounded unless z is a power of two times few bits;
symmetric checkpoints (z = 8) are exact, asymmetric ones err by at most 2^-11 |s z| <=
0.0074 s per weight (under 1% of one quantisation step, shared by the group's weights),
small beside the kernels' own int8 rounding of activations (1/254 of a group's largest).

Act order: blocks of 32 need their inputs' group to be one. Where every 32 consecutive
inputs share a group (groups in order: ``desc_act = false``, GPTQModel's act-group-aware
default, static groups) each block maps to its group in place. An act-order ``g_idx`` is
sorted (stably) instead: the columns are permuted so each group is contiguous and the
layer's input is gathered in the same order, y = W[:, p] x[p]. ``down_proj``'s gather is
free: its input is silu(gate) * up element by element, so the rows of gate and up are
permuted instead. The other projections read the residual stream or attention output,
which no earlier layer can reorder, so they gather at run time (:class:`PermutedLinear`);
the one-call C++ forward takes no gather, so such a model runs the PyTorch forward.
Layers whose groups cannot make 32-input blocks (group sizes that are not a multiple of 32,
inputs not a multiple of 32) keep exact dequantised weights in the activation dtype.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from memspec.common.errors import ModelError
from memspec.procs.decoder.forward.checkpoint import (
    lean_arch,
    load_state_dict,
    materialise_buffers,
    read_config,
)
from memspec.procs.decoder.forward.lean import Arch, LeanLM, projection_shapes
from memspec.procs.decoder.forward.linear import (
    GROUP,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    Linear,
    PermutedLinear,
)

METHODS = ("gptq", "awq")
PACKED = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]
AWQ_UNORDER = tuple(AWQ_ORDER.index(j) for j in range(8))  # output 8c + j sits in nibble ...
V1_ZERO_OFFSET = 0x11111111  # GPTQ v1 stored every zero minus one: one more on each nibble
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
REEXPORT = "re-export the checkpoint (GPTQModel or AutoAWQ write every tensor it needs)"


@dataclass(frozen=True)
class QuantFormat:
    """A folder's quantisation as far as reading it goes."""

    method: str  # "gptq" | "awq"
    group_size: int  # inputs per scale; -1: every input of a row
    v1_zeros: bool  # GPTQ v1: zeros stored minus one
    desc_act: bool
    sym: bool
    folder: str

    @property
    def name(self) -> str:
        return self.method.upper()

    def error(self, problem: str, fix: str = REEXPORT) -> ModelError:
        return ModelError(f"{self.name} folder {self.folder}: {problem}", fix)


def _config_of(folder: Path, config: Mapping | None) -> tuple[dict | None, str]:
    """The quantisation config and where it came from: config.json's
    ``quantization_config``, else AutoGPTQ's ``quantize_config.json`` beside it."""
    if config is None:
        try:
            config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            return None, ""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if qc is not None:
        if not isinstance(qc, Mapping):
            raise ModelError(f"folder {folder}: config.json's quantization_config is not an "
                             "object", REEXPORT)
        return dict(qc), "quantization_config"
    side = Path(folder) / "quantize_config.json"
    if side.is_file():
        try:
            qc = json.loads(side.read_text())
        except (OSError, ValueError):
            raise ModelError(f"folder {folder}: quantize_config.json does not parse",
                             REEXPORT) from None
        if isinstance(qc, Mapping):
            return {"quant_method": "gptq", **qc}, "quantize_config.json"
    return None, ""


def quant_format(folder: Path, config: Mapping | None = None) -> QuantFormat | None:
    """The folder's GPTQ / AWQ format, None for an unquantised folder; a format this module
    cannot read is a one-line ModelError naming the format and the field."""
    qc, src = _config_of(folder, config)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelError(f"folder {folder}: {src}.quant_method '{method or '(none)'}' is not "
                         "a format memspec reads",
                         "use a 4-bit GPTQ or AWQ folder, or save the model unquantised")
    name = method.upper()
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelError(f"{name} folder {folder}: {src}.bits = {bits}; memspec reads "
                         "4-bit GPTQ and AWQ only", "quantize with bits=4 or save it unquantised")
    group = qc.get("group_size", qc.get("q_group_size", -1 if method == "gptq" else 128))
    if isinstance(group, bool) or not isinstance(group, int) or not (group > 0 or group == -1):
        raise ModelError(f"{name} folder {folder}: {src}.group_size = {group!r} is not a "
                         "positive group size or -1", REEXPORT)
    pack = str(qc.get("pack_dtype", "int32")).replace("torch.", "")
    if pack != "int32":
        raise ModelError(f"{name} folder {folder}: {src}.pack_dtype = {pack}; memspec reads "
                         "codes packed in int32 words", REEXPORT)
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            fmt = "marlin" if qc.get("is_marlin_format") else fmt
            raise ModelError(f"GPTQ folder {folder}: {src}.checkpoint_format = '{fmt}'; "
                             "memspec reads the gptq and gptq_v2 packings",
                             "save it with format='gptq' (GPTQModel) or re-export it")
        return QuantFormat("gptq", group, fmt == "gptq", bool(qc.get("desc_act", False)),
                           bool(qc.get("sym", True)), str(folder))
    version = str(qc.get("version", qc.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ModelError(f"AWQ folder {folder}: {src}.version = '{version}'; memspec reads "
                         "AWQ's GEMM packing", "quantize with version='gemm' (the default)")
    return QuantFormat("awq", group, False, False, not qc.get("zero_point", True),
                       str(folder))


# ---- unpacking ----------------------------------------------------------------------------
def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> their eight 4-bit codes [..., W, 8], lowest nibble first (an
    arithmetic shift of a negative word leaves the low four bits right)."""
    return ((words.to(torch.int32)[..., None] >> SHIFTS) & 15).to(torch.uint8)


def unpack_gptq_weight(qweight: torch.Tensor) -> torch.Tensor:
    """[K/8, N] words -> codes [N, K] (word r holds inputs 8r..8r+7 of every output)."""
    k8, n = qweight.shape
    return _nibbles(qweight.t()).reshape(n, k8 * 8)


def unpack_gptq_zeros(qzeros: torch.Tensor, v1: bool) -> torch.Tensor:
    """[G, N/8] words -> zeros [G, N]; v1 words get +1 on each nibble, carries included."""
    w = qzeros.to(torch.int64)
    if v1:  # mod 2^32, back into int32's range
        w = ((w + V1_ZERO_OFFSET + 2**31) & 0xFFFFFFFF) - 2**31
    return _nibbles(w).reshape(qzeros.shape[0], -1)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM [R, N/8] words -> [R, N] in output order (undoes the interleave)."""
    r = words.shape[0]
    return _nibbles(words)[..., list(AWQ_UNORDER)].reshape(r, -1)


@dataclass
class Codes:
    """One layer as its checkpoint means it: w[n, k] = s[g[k], n] * (q[n, k] - z[g[k], n])."""

    q: torch.Tensor  # uint8 [N, K]
    s: torch.Tensor  # fp32 [groups, N] (fp16 values)
    z: torch.Tensor  # fp32 [groups, N] (integers 0..16)
    g: torch.Tensor  # int64 [K]
    bias: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32, exact: (q - z) is an integer of at most 5 bits, s an fp16."""
        return (self.s[self.g].t() * (self.q.float() - self.z[self.g].t())).contiguous()


def _tensor(fmt: QuantFormat, t: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in t:
        raise fmt.error(f"tensor '{name}' is missing")
    return t[name]


def _expect(fmt: QuantFormat, name: str, x: torch.Tensor, shape: tuple[int, ...],
            n: int, k: int) -> None:
    if tuple(x.shape) != shape:
        raise fmt.error(f"tensor '{name}' has shape {tuple(x.shape)}, 4-bit {fmt.name} with "
                        f"group_size {fmt.group_size} needs {shape} for its {n}x{k} layer",
                        "config.json and the weights disagree; " + REEXPORT)


def read_codes(fmt: QuantFormat, prefix: str, t: Mapping[str, torch.Tensor], n: int, k: int
               ) -> Codes:
    """Unpack and check one quantised layer of shape [n, k] (output, input)."""
    qweight = _tensor(fmt, t, f"{prefix}.qweight")
    qzeros = _tensor(fmt, t, f"{prefix}.qzeros")
    scales = _tensor(fmt, t, f"{prefix}.scales")
    for name, x in (("qweight", qweight), ("qzeros", qzeros)):
        if x.dtype != torch.int32:
            raise fmt.error(f"tensor '{prefix}.{name}' is {str(x.dtype).replace('torch.', '')}"
                            f", {fmt.name} packs codes in int32 words")
    if not scales.is_floating_point():
        raise fmt.error(f"tensor '{prefix}.scales' is {scales.dtype}, not floating point")
    group = k if fmt.group_size == -1 else fmt.group_size
    groups = -(-k // group)
    if n % 8 or k % 8:
        raise fmt.error(f"layer '{prefix}' is {n}x{k}; 4-bit packing needs both sides a "
                        "multiple of 8")
    _expect(fmt, f"{prefix}.scales", scales, (groups, n), n, k)
    _expect(fmt, f"{prefix}.qzeros", qzeros, (groups, n // 8), n, k)
    if fmt.method == "gptq":
        _expect(fmt, f"{prefix}.qweight", qweight, (k // 8, n), n, k)
        q = unpack_gptq_weight(qweight)
        z = unpack_gptq_zeros(qzeros, fmt.v1_zeros)
        g_idx = t.get(f"{prefix}.g_idx")
        if g_idx is None:
            g = torch.arange(k) // group
        else:
            _expect(fmt, f"{prefix}.g_idx", g_idx, (k,), n, k)
            g = g_idx.to(torch.int64)
            bad = g[(g < 0) | (g >= groups)]
            if bad.numel():
                raise fmt.error(f"tensor '{prefix}.g_idx' holds group {int(bad[0])}, outside "
                                f"the {groups} groups of its scales")
    else:
        _expect(fmt, f"{prefix}.qweight", qweight, (k, n // 8), n, k)
        q = unpack_awq(qweight).t().contiguous()
        z = unpack_awq(qzeros)
        g = torch.arange(k) // group
    return Codes(q.contiguous(), scales.float(), z.float(), g, t.get(f"{prefix}.bias"))


# ---- into the engine's formats ------------------------------------------------------------
def to_linear(c: Codes, act_dtype: torch.dtype) -> Linear:
    """The engine's int4 blocks for one layer: d = s, m = -s * z per 32-input block of a
    group (permuting act-order columns first), else exact dense weights (module doc)."""
    n, k = c.q.shape
    bias = None if c.bias is None else c.bias.to(act_dtype)
    if k % GROUP == 0:
        perm = None
        g, q = c.g, c.q
        if not _blocks_pure(g):
            perm = torch.argsort(g, stable=True)
            g, q = g[perm], q[:, perm]
        if _blocks_pure(g):
            block = g.view(-1, GROUP)[:, 0]
            d = c.s[block].t()
            m = (-(c.s * c.z))[block].t()
            lin: Linear = Int4Linear.from_blocks(q.contiguous(), d.contiguous().half().float(),
                                                 m.contiguous().half().float(), act_dtype, bias)
            return lin if perm is None else PermutedLinear(lin, perm)
    return DenseLinear(c.dequantize().to(act_dtype), bias)


def _blocks_pure(g: torch.Tensor) -> bool:
    blocks = g.view(-1, GROUP)
    return bool((blocks == blocks[:, :1]).all())


def permute_rows(lin: Linear, perm: torch.Tensor) -> Linear | None:
    """The layer with its outputs in ``perm`` order, None when its format cannot."""
    if lin.bias is not None:
        return None
    if isinstance(lin, PermutedLinear):
        inner = permute_rows(lin.inner, perm)
        return None if inner is None else PermutedLinear(inner, lin.perm)
    if isinstance(lin, Int4Linear):
        return Int4Linear.from_blocks(lin.q[perm].contiguous(), lin.d[perm].contiguous(),
                                      lin.m[perm].contiguous(), lin.act_dtype)
    if isinstance(lin, Int8Linear):
        return Int8Linear.from_blocks(lin.q[perm].contiguous(), lin.d[perm].contiguous(),
                                      lin.act_dtype)
    if isinstance(lin, DenseLinear):
        return DenseLinear(lin.weight[perm].contiguous())
    return None


def absorb_down_gather(linears: dict[str, Linear], layer: str) -> None:
    """down_proj's input gather moved into the rows of gate and up (silu(g) * u is taken
    element by element, so permuting both outputs permutes its input exactly)."""
    down = linears.get(f"{layer}.mlp.down_proj")
    names = (f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj")
    if not isinstance(down, PermutedLinear) or not all(n in linears for n in names):
        return
    moved = [permute_rows(linears[n], down.perm) for n in names]
    if all(m is not None for m in moved):
        linears.update(zip(names, moved))
        linears[f"{layer}.mlp.down_proj"] = down.inner


def _module_names(arch: Arch) -> list[tuple[str, str]]:
    """(module name, last name) of every projection the lean forward reads, and the head."""
    names = []
    for i in range(arch.layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names.append((f"model.layers.{i}.{part}", part.split(".")[-1]))
    return names + [("lm_head", "lm_head")]


def split_weights(fmt: QuantFormat, arch: Arch, weights: Mapping[str, torch.Tensor],
                  act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Linear]]:
    """A quantised state dict as (the dense tensors, the engine's layers by module name):
    every packed layer in int4 blocks, projections the checkpoint left dense in int8 (the
    format the engine gives its LM head under int4 layers)."""
    shapes = projection_shapes(arch)
    dense = dict(weights)
    linears: dict[str, Linear] = {}
    for module, part in _module_names(arch):
        n, k = shapes[part]
        if f"{module}.qweight" in weights:
            linears[module] = to_linear(read_codes(fmt, module, weights, n, k), act_dtype)
            for suffix in (*PACKED, "bias"):
                dense.pop(f"{module}.{suffix}", None)
        elif module != "lm_head" and f"{module}.weight" in weights:
            w = dense.pop(f"{module}.weight")
            b = dense.pop(f"{module}.bias", None)
            if tuple(w.shape) == (n, k) and k % GROUP == 0:
                linears[module] = Int8Linear(w, act_dtype, b)
            else:  # the shape check and the error are LeanLM's
                dense[f"{module}.weight"] = w
                if b is not None:
                    dense[f"{module}.bias"] = b
    stray = sorted(k for k in dense if k.rsplit(".", 1)[-1] in PACKED)
    if stray:
        raise fmt.error(f"tensor '{stray[0]}' belongs to no layer of the configured model",
                        "config.json and the weights disagree; " + REEXPORT)
    for i in range(arch.layers):
        absorb_down_gather(linears, f"model.layers.{i}")
    return dense, linears


def dequantized(fmt: QuantFormat, arch_shapes: Mapping[str, tuple[int, int]] | None,
                weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with every packed layer as its exact fp32 ``.weight`` (for the dense
    dtypes and the eager HF path); shapes from the packing when no config shapes are given."""
    out = {k: v for k, v in weights.items() if k.rsplit(".", 1)[-1] not in PACKED}
    for name in [k[:-len(".qweight")] for k in weights if k.endswith(".qweight")]:
        part = name.rsplit(".", 1)[-1]
        qw = weights[f"{name}.qweight"]
        if arch_shapes is not None and part in arch_shapes:
            n, k = arch_shapes[part]
        elif fmt.method == "gptq":
            k, n = qw.shape[0] * 8, qw.shape[1]
        else:
            k, n = qw.shape[0], qw.shape[1] * 8
        out[f"{name}.weight"] = read_codes(fmt, name, weights, n, k).dequantize()
    return out


def needs_gather(lean: LeanLM) -> bool:
    """Whether any layer gathers its input (act-order): the C++ forward has no such step."""
    return any(isinstance(p, PermutedLinear)
               for L in lean.layers for p in (*L.qkv, L.o, *L.gate_up, L.down)) or \
        isinstance(lean.lm_head, PermutedLinear)


_NOTED: set[str] = set()


def note_pytorch_forward(folder: str) -> None:
    """Said once per folder: why an act-order checkpoint runs the slower forward."""
    if folder not in _NOTED:
        _NOTED.add(folder)
        print(f"[memspec] {folder}: act-order (desc_act) GPTQ layers gather their inputs, "
              "which the C++ forward does not do; running the PyTorch forward",
              file=sys.stderr, flush=True)


def quantized_lean(fmt: QuantFormat, arch: Arch, weights: Mapping[str, torch.Tensor],
                   act_dtype: torch.dtype, fuse: bool = True) -> LeanLM:
    """The lean model of a GPTQ / AWQ state dict in the engine's int4 blocks."""
    dense, linears = split_weights(fmt, arch, weights, act_dtype)
    lean = LeanLM.from_weights(arch, dense, "int4", act_dtype, fuse=fuse, linears=linears)
    if needs_gather(lean) and lean.device.type == "cpu":
        note_pytorch_forward(fmt.folder)
    return lean


def dense_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """A folder's tensors with GPTQ / AWQ layers dequantised exactly (fp32), for the float
    and int8 dtypes; an unquantised folder's tensors as they are."""
    weights = load_state_dict(model_dir)
    fmt = quant_format(model_dir)
    if fmt is None:
        return weights
    arch = lean_arch(read_config(model_dir))
    return dequantized(fmt, projection_shapes(arch) if arch else None, weights)


def load_hf_dequantized(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A GPTQ / AWQ folder as a plain HF module over its exact dequantised weights (the
    eager path; transformers itself would want GPTQModel or AutoAWQ for the folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    sd = {k: v.to(dtype) for k, v in dense_state_dict(model_dir).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m.endswith("lm_head.weight"))]
    if missing or unexpected:
        bad = (missing or unexpected)[0]
        raise ModelError(f"folder {model_dir}: tensor '{bad}' does not match its config",
                         REEXPORT)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    materialise_buffers(model, torch.device("cpu"))  # rotary tables are not in the file
    return model.eval()
