"""The trainable twin of a runtime draft head (procs/decoder/drafts/head.py), with training-time test.

Same maths as :class:`memspec.procs.decoder.drafts.head.HeadRunner`, batched over sequences: the
input at position j is ``[norm_e(embed(tok_j)); norm_g(g_j)]``, the residual runs on
``g``, and logits come from the target's final norm and the target's LM-head rows of the
draft vocabulary (both frozen, read from the runtime target). Step 0 is teacher forced:
``g_j = fc(f_{j-1})`` from the target's features. Step s > 0 is what the runtime does for
its s-th own proposal (EAGLE-3's training-time test): at position p, ``g`` is the head's
step-(s-1) output at p-1, and attention sees the teacher-forced keys of positions
``0..p-s`` plus the chain's own keys at ``p-s+1..p`` (one from each earlier step). Inputs
are the true tokens: acceptance only counts step s when steps before it were right.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from memspec.procs.decoder.drafts.head import HeadArch


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, head_dim], the half-split layout of the runtime's lean forward."""
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    ang = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """x moved n places later along ``dim`` (row p holds old row p-n; the first n are 0)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim)


class TrainableHead(nn.Module):
    """Weights named as in the head's model.safetensors (``<name>.weight``)."""

    def __init__(self, arch: HeadArch, embed: torch.Tensor, lm_rows: torch.Tensor,
                 target_norm: torch.Tensor, target_eps: float, seed: int,
                 warm: bool = True) -> None:
        super().__init__()
        a = self.arch = arch
        h, nq, nk = a.hidden, a.heads * a.head_dim, a.kv_heads * a.head_dim
        g = torch.Generator().manual_seed(seed)

        def lin(out: int, inp: int) -> nn.Parameter:
            bound = 1.0 / math.sqrt(inp)
            return nn.Parameter(torch.empty(out, inp).uniform_(-bound, bound, generator=g))

        self.fc = lin(h, a.features)
        self.norm_e = nn.Parameter(torch.ones(h))
        self.norm_g = nn.Parameter(torch.ones(h))
        self.q_proj, self.k_proj, self.v_proj = lin(nq, 2 * h), lin(nk, 2 * h), lin(nk, 2 * h)
        self.o_proj = lin(h, nq)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_proj, self.up_proj = lin(a.intermediate, h), lin(a.intermediate, h)
        self.down_proj = lin(h, a.intermediate)
        if warm:  # start as "the target's state from its highest feature layer": logits at
            # the target's scale from step 0; the branches then learn the next position
            with torch.no_grad():
                self.fc.zero_()
                self.fc[:, -h:] = torch.eye(h)
                self.o_proj.zero_()
                self.down_proj.zero_()
        # frozen: what the runtime reads from the resident target
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("lm_rows", lm_rows.float(), persistent=False)
        self.register_buffer("target_norm", target_norm.float(), persistent=False)
        self.target_eps = float(target_eps)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- weights as files hold them --------------------------------------------------------
    def head_state(self) -> dict[str, torch.Tensor]:
        return {f"{k}.weight": v.detach() for k, v in self.named_parameters()}

    def load_head_state(self, weights: dict[str, torch.Tensor]) -> None:
        for k, p in self.named_parameters():
            p.data.copy_(weights[f"{k}.weight"].float())

    # ---- pieces ------------------------------------------------------------------------------
    def _tables(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope is None or self.rope[0].shape[0] < T:
            self.rope = rope_tables(self.arch.head_dim, self.arch.rope_theta, max(T, 512))
        cos, sin = self.rope
        return cos[:T], sin[:T]

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """x through the target's final norm: what the LM-head rows read."""
        return F.rms_norm(x.float(), (x.shape[-1],), self.target_norm, self.target_eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of head outputs x [..., h]."""
        return self.normed(x) @ self.lm_rows.t()

    def target_logits(self, last: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary, from its last-layer stream."""
        return self.logits(last)

    def _qkv(self, emb: torch.Tensor, g: torch.Tensor, cos, sin):
        a, eps = self.arch, self.arch.eps
        B, T, h = g.shape
        a_in = torch.cat([F.rms_norm(emb.float(), (h,), self.norm_e, eps),
                          F.rms_norm(g.float(), (h,), self.norm_g, eps)], -1)
        q = (a_in @ self.q_proj.t()).view(B, T, a.heads, a.head_dim).transpose(1, 2)
        k = (a_in @ self.k_proj.t()).view(B, T, a.kv_heads, a.head_dim).transpose(1, 2)
        v = (a_in @ self.v_proj.t()).view(B, T, a.kv_heads, a.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        a = self.arch
        B, H, T, D = attn.shape
        x = g.float() + (attn.transpose(1, 2).reshape(B, T, H * D) @ self.o_proj.t()).float()
        hh = F.rms_norm(x, (a.hidden,), self.post_attention_layernorm, a.eps)
        mlp = (F.silu(hh @ self.gate_proj.t()) * (hh @ self.up_proj.t())) @ self.down_proj.t()
        return x + mlp.float()

    # ---- the unrolled forward ----------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int
                ) -> list[torch.Tensor]:
        """Head outputs [B, T, h] for steps 0..steps-1. ``feats[:, j]`` is the target's
        feature row of position j-1 (zeros at j = 0). Row p of step s predicts token p+1
        with the chain started at p-s; rows p < s are padding."""
        a = self.arch
        B, T = tokens.shape
        grp = a.heads // a.kv_heads
        cos, sin = self._tables(T)
        emb = self.embed[tokens]
        scale = a.head_dim ** -0.5
        idx = torch.arange(T)
        outs: list[torch.Tensor] = []
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        g = feats @ self.fc.t()
        for s in range(steps):
            if s:
                g = shift(outs[-1], 1, 1)
            q, k, v = self._qkv(emb, g, cos, sin)
            keys.append((k, v))
            q = q.view(B, a.kv_heads, grp, T, a.head_dim)
            k0, v0 = keys[0]
            sc = torch.einsum("bkgtd,bkld->bkgtl", q, k0) * scale  # teacher-forced keys
            sc = sc.masked_fill(idx[None, :] > (idx[:, None] - s), float("-inf"))
            diag = []  # the chain: step i's key at p-s+i
            for i in range(1, s + 1):
                ki = shift(keys[i][0], s - i, 2)
                diag.append(torch.einsum("bkgtd,bktd->bkgt", q, ki) * scale)
            if diag:
                sc = torch.cat([sc, torch.stack(diag, -1)], -1)
            p = torch.softmax(sc, dim=-1)
            attn = torch.einsum("bkgtl,bkld->bkgtd", p[..., :T], v0)
            for i in range(1, s + 1):
                vi = shift(keys[i][1], s - i, 2)
                attn = attn + p[..., T + i - 1].unsqueeze(-1) * vi.unsqueeze(2)
            outs.append(self._finish(g, attn.reshape(B, a.heads, T, a.head_dim)))
        return outs
