"""Acceptance arithmetic for speculative decoding: greedy matching and the rejection rule.

Pure tensor math with no model or process state, so the engine, the simulator and the
distribution tests share one implementation. Speculative sampling follows Leviathan et
al. / Chen et al.: accept draft token x with probability min(1, p(x)/q(x)), otherwise
sample from norm(max(p - q, 0)); the output is distributed exactly as the target's p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memspec.common.config import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: off; 1: greedy whatever the temperature
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.seed, self.top_k, self.min_p)

    @property
    def greedy(self) -> bool:
        """The target's argmax: temperature 0, or only the most likely token kept (top_k 1:
        the greedy path itself, so the tokens are greedy's, ties included)."""
        return self.temperature == 0.0 or self.top_k == 1


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, nucleus (top-p) and min-p filtering, renormalised. Draft and
    target rows go through the same warp, and the rejection rule then samples exactly from
    the warped target distribution: every filter stays lossless."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = probs * (probs >= kth)
    if params.top_p < 1.0:
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < params.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    if params.min_p > 0.0:
        probs = probs * (probs >= params.min_p * probs.amax(dim=-1, keepdim=True))
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def greedy_accept(proposals: torch.Tensor, target_logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of proposals equal to the target's argmax, then the target's next token.

    Returns 0-dim tensors on the logits' device, so the caller decides when to sync."""
    choice = target_logits.argmax(dim=-1)
    g = proposals.numel()
    match = (proposals == choice[:g]).to(torch.int32)
    n = torch.cumprod(match, dim=0).sum()
    return n, choice[n]


def host_rows(logits: torch.Tensor) -> bool:
    """Logits that numpy reads in place (fp32 on the CPU): there :func:`host_argmax` and
    :func:`greedy_accept_host` replace torch's small-tensor ops, whose dispatch and slow CPU
    argmax (~1 G values/s) cost ~0.2 ms of a ~5 ms greedy 5-row verify."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def host_argmax(logits: torch.Tensor) -> int:
    """``int(logits.argmax())`` of one row: the first maximum, NaN counting as the maximum,
    as torch takes it."""
    return int(logits.numpy().argmax())


def argmax_index(row: torch.Tensor) -> torch.Tensor:
    """A draft row's argmax as a 1-element index tensor (numpy's where :func:`host_rows`)."""
    if host_rows(row):
        return torch.from_numpy(row.numpy().argmax(keepdims=True).astype(np.int64))
    return row.argmax().view(1)


def greedy_accept_host(proposals: Sequence[int], target_logits: torch.Tensor
                       ) -> tuple[int, int]:
    """:func:`greedy_accept` on :func:`host_rows` logits, as ints."""
    choice = target_logits.numpy().argmax(-1)
    n = 0
    while n < len(proposals) and proposals[n] == choice[n]:
        n += 1
    return n, int(choice[n])


def speculative_accept(proposals: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       gen: torch.Generator | None) -> tuple[int, int]:
    """Rejection rule. q: [g, V] draft probs the proposals were drawn from; p: [g+1, V]."""
    g = proposals.numel()
    idx = torch.arange(g)
    px = p[idx, proposals]
    qx = q[idx, proposals]
    r = torch.rand(g, generator=gen)
    ok = (r * qx < px).to(torch.int32)  # r < p/q without dividing by a zero q
    n = int(torch.cumprod(ok, dim=0).sum().item())
    if n == g:
        return n, sample(p[g], gen)
    residual = torch.clamp(p[n] - q[n], min=0.0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[n]
    return n, sample(residual, gen)
