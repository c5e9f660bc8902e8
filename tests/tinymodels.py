"""Tiny random Llama models saved as real HF folders, for fast CPU tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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


