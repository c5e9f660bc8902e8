"""GPTQ and AWQ folders written as their reference implementations write them, from known
integer codes, scales and zeros: the packing loops below follow AutoGPTQ's
``QuantLinear.pack`` (qlinear_cuda_old / GPTQModel's ``pack_block`` qzeros path) and
AutoAWQ's ``WQLinear_GEMM.from_linear`` statement for statement, so a test can check that
the reader gets back exactly the weights the codes mean, bit for bit.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class Quantised:
    """One layer: w[n, k] = scales[g_idx[k], n] * (q[n, k] - zeros[g_idx[k], n])."""

    q: torch.Tensor  # int [N, K] in [0, 15]
    scales: torch.Tensor  # fp16 [G, N]
    zeros: torch.Tensor  # int [G, N] in [0, 15]
    g_idx: torch.Tensor  # int [K]

    def weight(self) -> torch.Tensor:
        g = self.g_idx.long()
        return self.scales.float()[g].t() * (self.q.float() - self.zeros.float()[g].t())


def rtn(w: torch.Tensor, group: int, sym: bool, act_order: bool, seed: int = 0) -> Quantised:
    """Round-to-nearest 4-bit groups the way GPTQ's quantizer sets scale and zero (xmin <= 0
    <= xmax; sym: z = 8), optionally with an act-order g_idx: the groups follow a random
    permutation of the inputs, as desc_act's Hessian order does (g_idx[perm[i]] = i // G)."""
    n, k = w.shape
    group = k if group == -1 else group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    groups = -(-k // group)
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n)
    for j in range(groups):
        cols = w[:, g_idx == j].float()
        xmin = cols.amin(1).clamp(max=0)
        xmax = cols.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        tmp = (xmin == 0) & (xmax == 0)
        xmin[tmp], xmax[tmp] = -1, 1
        scale = (xmax - xmin) / 15
        scales[j] = scale.half().float()
        zeros[j] = torch.full_like(scale, 8) if sym else torch.round(-xmin / scales[j])
    s = scales.half()
    g = g_idx.long()
    q = torch.clamp(torch.round(w.float() / s.float()[g].t() + zeros[g].t()), 0, 15)
    return Quantised(q.to(torch.int32), s, zeros.to(torch.int32), g_idx)


def pack_gptq(layer: Quantised, v1: bool = True) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales / g_idx exactly as AutoGPTQ's pack() writes them (v1:
    ``zeros -= 1`` before packing, the off-by-one of every older checkpoint)."""
    intweight = layer.q.t().contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 32 * 4, intweight.shape[1]), dtype=np.uint32)
    i = 0
    row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = layer.zeros.clone()
    if v1:
        zeros -= 1
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * 4), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return {"qweight": torch.from_numpy(qweight.astype(np.int32)),
            "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
            "scales": layer.scales.clone(), "g_idx": layer.g_idx.clone()}


def pack_awq(layer: Quantised) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales exactly as AutoAWQ's WQLinear_GEMM.from_linear writes them."""
    intweight = layer.q.t().contiguous().to(torch.int32)  # [K, N]
    pack_num = 8
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + AWQ_ORDER_MAP[i]]
            qweight[:, col] |= qweight_col << (i * 4)
    zeros = layer.zeros.to(torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + AWQ_ORDER_MAP[i]]
            qzeros[:, col] |= qzero_col << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": layer.scales.clone()}


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_quantised(src: Path, out: Path, method: str = "gptq", group: int = 128,
                    sym: bool = False, desc_act: bool = False, v1: bool = True,
                    dtype: torch.dtype = torch.float16) -> dict[str, Quantised]:
    """A GPTQ or AWQ folder made from the HF folder ``src``: every projection RTN-quantised
    and packed as the reference implementation packs it, the rest kept in ``dtype``; returns
    the layers' codes (what the reader must give back)."""
    out.mkdir(parents=True, exist_ok=True)
    sd = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, Quantised] = {}
    for i in range(int(cfg["num_hidden_layers"])):
        for part in PROJ:
            name = f"model.layers.{i}.{part}"
            lq = rtn(sd.pop(f"{name}.weight"), group, sym, desc_act and method == "gptq",
                     seed=i * 7 + PROJ.index(part))
            layers[name] = lq
            packed = pack_gptq(lq, v1) if method == "gptq" else pack_awq(lq)
            tensors.update({f"{name}.{k}": v for k, v in packed.items()})
            bias = sd.pop(f"{name}.bias", None)
            if bias is not None:
                tensors[f"{name}.bias"] = bias.to(torch.float16)
    tensors.update({k: v.to(dtype) for k, v in sd.items() if k.startswith("model.")})
    if not cfg.get("tie_word_embeddings") and "lm_head.weight" in sd:
        tensors["lm_head.weight"] = sd["lm_head.weight"].to(dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if method == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                      "desc_act": desc_act, "sym": sym,
                                      "checkpoint_format": "gptq" if v1 else "gptq_v2",
                                      "pack_dtype": "int32"}
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                      "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return layers
