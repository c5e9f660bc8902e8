"""A GGUF file as a target folder: config, tokenizer and the file's own blocks, no fp32 copy.

Why this shape: GGUF is the format edge users already hold, and its blocks are what the
engine runs (procs/decoder/forward/ggml.py), so the folder keeps them as they are: the
demo's 94 MB Q4_1 file becomes a 98 MB folder, not 538 MB of fp32, and the int4 path runs
the file's own weights. The tokenizer, special tokens, chat template and config come from
the file's metadata through transformers' GGUF readers (no weights go through them).

Tensors get their Hugging Face names; llama.cpp's converter permutes the rows of a Llama's
q and k projections for its rotary layout, and that is undone here (rows are whole blocks,
so the blocks move unchanged). Qwen2 keeps HF's order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from memspec.common.errors import ModelError

ARCHS = ("llama", "mistral", "qwen2")
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM"}
PERMUTED = ("llama", "mistral")  # llama.cpp permutes q / k rows for these
# the block types a target may hold: kept as they are, dequantised on load where needed
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
             "Q6_K")
FLOAT = {"F32": "float32", "F16": "float16"}
SKIPPED = ("rope_freqs.weight",)  # llama 3's rope factors: the config's rope_scaling holds them
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not a tensor a target uses)."""
    if name in _TOP:
        return _TOP[name]
    m = _BLK.match(name)
    if not m:
        return None
    i, part, kind = m.group(1), m.group(2), m.group(3)
    if f"{part}.{kind}" in _LAYER:
        return f"model.layers.{i}.{_LAYER[f'{part}.{kind}']}"
    if part in _LAYER and kind:
        return f"model.layers.{i}.{_LAYER[part]}.{kind}"
    return None


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k projection (per head, the two
    halves of the head's rows were interleaved); works on block rows and float rows."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    return f.contents() if f is not None else None


def read_tensors(reader: Any, path: Path, say: Callable[[str], None] = lambda _m: None
                 ) -> tuple[dict[str, Any], dict[str, list]]:
    """The file's tensors under HF names (torch, blocks as uint8 rows) and the block map
    (``{name: [type, columns]}``) that ggml.py reads back."""
    import torch

    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ModelError(f"{path.name}: architecture '{arch}' is not one memspec runs "
                         f"(supported: {', '.join(ARCHS)})",
                         "use a Llama, Mistral or Qwen2 GGUF")
    heads = int(field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(field(reader, f"{arch}.attention.head_count_kv") or heads)
    out: dict[str, Any] = {}
    types: dict[str, list] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        name = hf_name(t.name)
        if name is None:
            if t.name in SKIPPED:
                continue
            raise ModelError(f"{path.name}: tensor '{t.name}' is not part of a {arch} model "
                             "memspec runs", "use a plain Llama, Mistral or Qwen2 GGUF")
        if kind not in SUPPORTED:
            raise ModelError(f"{path.name}: tensor '{t.name}' is {kind}, a type memspec does "
                             f"not read (supported: {', '.join(SUPPORTED)})",
                             "requantise the file to one of those types with llama.cpp")
        dims = [int(d) for d in t.shape]  # ggml order: columns first
        cols, rows = dims[0], int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if kind not in FLOAT and kind != "BF16" and len(dims) != 2:
            raise ModelError(f"{path.name}: tensor '{t.name}' is a {kind} tensor of "
                             f"{len(dims)} dimensions", "use a plain Llama, Mistral or "
                             "Qwen2 GGUF")
        try:
            raw = np.ascontiguousarray(np.asarray(t.data))
            if kind in FLOAT:
                arr = raw.view(FLOAT[kind]).reshape(tuple(reversed(dims)))
            else:  # blocks, and bf16 (numpy has none) as bytes
                arr = raw.view(np.uint8).reshape(rows, -1)
        except (ValueError, TypeError) as exc:
            raise ModelError(f"{path.name}: tensor '{t.name}' ({kind}) does not read "
                             f"({str(exc)[:80]})", "the file is truncated or damaged; "
                             "download or convert it again") from None
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = unpermute(arr, heads if ".q_proj" in name else kv_heads)
        tensor = torch.from_numpy(np.array(arr, order="C"))  # a copy: the map is read-only
        if kind == "BF16":
            tensor = tensor.view(torch.bfloat16).reshape(tuple(reversed(dims)))
        elif kind not in FLOAT:
            types[name] = [kind, cols]
        out[name] = tensor
    say(f"read {len(out)} tensors ({len(types)} in blocks)")
    return out, types


def check_decoding(tensors: dict[str, Any], types: dict[str, list]) -> float:
    """Our dequantisation of every block tensor against gguf-py's own: the largest
    difference (0.0 for a right conversion)."""
    import gguf
    import torch

    from memspec.procs.decoder.forward import ggml

    worst = 0.0
    for name, (kind, cols) in types.items():
        ours = ggml.dequantize(tensors[name], kind, cols)
        ref = gguf.quants.dequantize(tensors[name].numpy(), getattr(gguf.GGMLQuantizationType,
                                                                    kind))
        worst = max(worst, float((ours - torch.from_numpy(
            np.asarray(ref, dtype=np.float32)).view_as(ours)).abs().max()))
    return worst


def save_weights(tensors: dict[str, Any], types: dict[str, list], dest: Path) -> None:
    from safetensors.torch import save_file

    from memspec.procs.decoder.forward.ggml import META_KEY

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest),
              metadata={"format": "pt", META_KEY: json.dumps(types)})
