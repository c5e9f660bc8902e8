"""Small GGUF files for the brought-target tests, written here with gguf-py.

A tiny random Llama, Mistral or Qwen2 (two layers, 64 wide) carrying the demo GGUF's real
tokenizer (so transformers' GGUF readers convert it as they would a downloaded file), its
tensors in a mix of block types as llama.cpp's mixed files are (Q4_K_M and friends mix
several). The projections are written as llama.cpp's converter writes them: a Llama's q
and k rows permuted for its rotary layout.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
# per tensor role, the type it is written in: every type gguf-py can quantise appears
TYPES = {"attn_q": "Q4_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
         "ffn_gate": "Q5_0", "ffn_up": "F16", "ffn_down": "BF16", "token_embd": "Q8_0",
         "output": "Q4_1"}


@functools.cache
def _demo_tokenizer() -> dict:
    import gguf

    from memspec.zoo.target import find_gguf

    r = gguf.GGUFReader(str(find_gguf()))
    f = r.fields
    return {
        "tokens": f["tokenizer.ggml.tokens"].contents(),
        "types": f["tokenizer.ggml.token_type"].contents(),
        "merges": f["tokenizer.ggml.merges"].contents(),
        "pre": f["tokenizer.ggml.pre"].contents(),
        "template": f["tokenizer.chat_template"].contents(),
    }


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for a Llama's q / k (the inverse of unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_tiny(path: Path, arch: str = "llama", tied: bool = False, seed: int = 0,
               types: dict[str, str] | None = None, template: str | None = None
               ) -> dict[str, np.ndarray]:
    """Write the file; return its float weights by GGUF name (before quantisation).
    `template`: its chat template (default the demo's)."""
    import gguf

    types = {**TYPES, **(types or {})}
    tok = _demo_tokenizer()
    vocab = len(tok["tokens"])
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(template or tok["template"])

    floats: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], role: str | None, scale: float = 0.08,
               heads: int = 0) -> None:
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if role is None:  # norms, biases: F32
            x = (1.0 + x) if name.endswith("norm.weight") else x
            floats[name] = x
            w.add_tensor(name, x)
            return
        floats[name] = x
        if heads and arch in ("llama", "mistral"):
            x = _permute(x, heads)
        kind = types[role]
        if kind == "F32":
            w.add_tensor(name, x)
            return
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        data = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)

    tensor("token_embd.weight", (vocab, HIDDEN), "token_embd", 0.5)
    for i in range(LAYERS):
        p = f"blk.{i}"
        tensor(f"{p}.attn_norm.weight", (HIDDEN,), None)
        tensor(f"{p}.attn_q.weight", (HIDDEN, HIDDEN), "attn_q", heads=HEADS)
        tensor(f"{p}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN), "attn_k", heads=KV_HEADS)
        tensor(f"{p}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN), "attn_v")
        if arch == "qwen2":
            tensor(f"{p}.attn_q.bias", (HIDDEN,), None)
            tensor(f"{p}.attn_k.bias", (KV_HEADS * head_dim,), None)
            tensor(f"{p}.attn_v.bias", (KV_HEADS * head_dim,), None)
        tensor(f"{p}.attn_output.weight", (HIDDEN, HIDDEN), "attn_output")
        tensor(f"{p}.ffn_norm.weight", (HIDDEN,), None)
        tensor(f"{p}.ffn_gate.weight", (FFN, HIDDEN), "ffn_gate")
        tensor(f"{p}.ffn_up.weight", (FFN, HIDDEN), "ffn_up")
        tensor(f"{p}.ffn_down.weight", (HIDDEN, FFN), "ffn_down")
    tensor("output_norm.weight", (HIDDEN,), None)
    if not tied:
        tensor("output.weight", (vocab, HIDDEN), "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return floats
