"""Tiny random Llama models saved as real HF folders, for fast CPU tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY_VOCAB = 96


def tiny_config(vocab: int = TINY_VOCAB, layers: int = 2, hidden: int = 64,
                tie: bool = True) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=tie,
                       bos_token_id=1, eos_token_id=2)


def fake_tokenizer_json(vocab: int = TINY_VOCAB) -> dict:
    return {"version": "1.0", "added_tokens": [], "model": {
        "type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"}}


def save_model(model: torch.nn.Module, path: Path, tokenizer: dict | None = None) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer or fake_tokenizer_json()))
    return path


def make_tiny(seed: int, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kw)).eval()
    with torch.no_grad():  # sharper logits so greedy paths are stable and drafts differ
        for p in model.parameters():
            p.mul_(3.0)
    return model



QWEN_VOCAB = 264  # 256 byte tokens, <|endoftext|> (the EOS) and a few unused rows
QWEN_EOS = 256


def make_tiny_qwen2(seed: int, vocab: int = QWEN_VOCAB, layers: int = 2, hidden: int = 64
                    ) -> Qwen2ForCausalLM:
    """A tiny Qwen2 (q/k/v projections with bias), sharpened like :func:`make_tiny`."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=QWEN_EOS, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies hold)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer_json() -> dict:
    """A byte-level BPE without merges (one token per byte) that Qwen2's tokenizer class
    loads, so tiny Qwen2 pools take real text prompts."""
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}
    chars = _byte_chars()
    return {"version": "1.0", "normalizer": None, "post_processor": None,
            "pre_tokenizer": level, "decoder": level,
            "added_tokens": [{"id": QWEN_EOS, "content": "<|endoftext|>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True}],
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": "", "end_of_word_suffix": "",
                      "fuse_unk": False, "byte_fallback": False,
                      "vocab": {chars[b]: b for b in range(256)}, "merges": []}}


def make_tiny_head(path: Path, seed: int, target_config: LlamaConfig | None = None,
                   feature_layers: tuple[int, ...] = (0, 1), vocab: int = 48,
                   q8: bool = True) -> Path:
    """A random draft head for the tiny target (reads target layers ``feature_layers``),
    stored as the pool's heads are (packed Q8_0 matrices) or, ``q8=False``, in bf16."""
    from safetensors.torch import save_file

    from memspec.procs.decoder.drafts.head import pack_head

    cfg = target_config or tiny_config()
    h, nq = cfg.hidden_size, cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    hd = cfg.hidden_size // cfg.num_attention_heads
    nk = cfg.num_key_value_heads * hd
    inter = cfg.intermediate_size
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    tensors = {"fc.weight": rnd(h, len(feature_layers) * h),
               "norm_e.weight": torch.ones(h, dtype=torch.bfloat16),
               "norm_g.weight": torch.ones(h, dtype=torch.bfloat16),
               "q_proj.weight": rnd(nq, 2 * h), "k_proj.weight": rnd(nk, 2 * h),
               "v_proj.weight": rnd(nk, 2 * h), "o_proj.weight": rnd(h, nq),
               "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               "gate_proj.weight": rnd(inter, h), "up_proj.weight": rnd(inter, h),
               "down_proj.weight": rnd(h, inter),
               "memspec.draft_to_target": torch.randperm(cfg.vocab_size, generator=g)[:vocab]}
    if q8:
        tensors = pack_head(tensors)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "memspec_kind": "head", "hidden_size": h, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": hd,
        "intermediate_size": inter, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
                            or getattr(cfg, "rope_theta", None) or 10000.0),
        "feature_layers": list(feature_layers), "draft_vocab": vocab}))
    (path / "tokenizer.json").write_text(json.dumps(fake_tokenizer_json(cfg.vocab_size)))
    return path
