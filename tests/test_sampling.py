"""Speculative sampling must reproduce the target distribution exactly (rejection rule)."""

from __future__ import annotations

import pytest
import torch

from memspec.common.errors import RequestError
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.models import load_causal_lm
from memspec.procs.decoder.sched.acceptance import (
    SamplingParams,
    greedy_accept,
    greedy_accept_host,
    host_argmax,
    host_rows,
    speculative_accept,
    warp,
)
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

V = 6


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def empirical(samples: list[int], n: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples[:n]), minlength=V).float() / n


def test_the_host_greedy_rule_accepts_what_the_tensor_rule_accepts():
    """The numpy path the CPU engine takes: the same prefix and next token as torch, with
    ties (first maximum) and NaN (the maximum) taken as torch takes them."""
    gen = torch.Generator().manual_seed(1)
    nan = float("nan")
    cases = [torch.tensor([[0., 2., 2.], [1., 1., 0.], [nan, 3., nan]]),
             torch.randint(0, 3, (6, 5), generator=gen).float()]
    for logits in cases:
        assert host_rows(logits) and not host_rows(logits.double())
        choice = logits.argmax(-1).tolist()
        g = logits.shape[0] - 1
        for k in range(g + 1):  # k proposals right, then a wrong one (or all right)
            props = choice[:k] + [(c + 1) % logits.shape[1] for c in choice[k:g]]
            n, nxt = greedy_accept(torch.tensor(props), logits)
            assert greedy_accept_host(props, logits) == (int(n), int(nxt)) == (k, choice[k])
        for row in logits:
            assert host_argmax(row) == int(row.argmax())


def test_rejection_rule_converges_to_target_at_every_position():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=gen) * 2, -1)  # target, 2 positions + bonus
    q = torch.softmax(torch.randn(2, V, generator=gen) * 2, -1)  # a quite different draft
    first: list[int] = []
    second: list[int] = []
    for _ in range(20000):
        props = torch.multinomial(q, 1, generator=gen).view(-1)
        n, nxt = speculative_accept(props, q, p, gen)
        emitted = props[:n].tolist() + [nxt]
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
    perturbed = torch.softmax(torch.log(p[0]) + 0.3 * torch.randn(V, generator=gen), -1)
    dists = [tv(empirical(first, n), p[0]) for n in (250, 2000, 20000)]
    assert dists[0] > dists[1] > dists[2]  # seeded, so this cannot flake
    assert dists[2] < 0.015
    assert dists[2] < 0.25 * tv(perturbed, p[0])
    assert tv(empirical(second, len(second)), p[1]) < 0.02  # later positions too


def test_draft_equal_to_target_accepts_everything():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, V, generator=gen), -1)
    for _ in range(200):
        props = torch.multinomial(p[:3], 1, generator=gen).view(-1)
        n, _ = speculative_accept(props, p[:3], p, gen)
        assert n == 3


def test_top_p_and_temperature_warp():
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -1.0, -2.0])
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert probs[2:].sum() == 0 and abs(float(probs.sum()) - 1) < 1e-6
    cold = warp(logits, SamplingParams(temperature=0.1))
    assert cold[0] > 0.99
    with pytest.raises(RequestError):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError):
        SamplingParams(top_p=0)


def engine(tiny_dir):
    eng = SpecEngine(load_causal_lm(tiny_dir / "target"), (), gamma=3)
    eng.add_draft(load_into_slot("random", tiny_dir / "random", SlotBuffer(1 << 20), 96))
    return eng


def test_engine_sampling_matches_target_next_token_distribution(tiny_dir):
    """Through the whole engine: the second generated token after a fixed prefix."""
    eng = engine(tiny_dir)
    prompt = [1, 5, 9]
    params = SamplingParams(temperature=1.5, seed=None)
    with torch.inference_mode():
        logits = eng.target.model(torch.tensor([prompt])).logits[0, -1]
    p = warp(logits, params)
    counts = torch.zeros(p.numel())
    n = 1500
    for seed in range(n):
        out, _ = eng.generate(prompt, 1, SamplingParams(1.5, 1.0, seed), select=lambda s: "random")
        counts[out[0]] += 1
    emp = counts / n
    noise = 0.5 * float(torch.sqrt(2 * p * (1 - p) / (torch.pi * n)).sum())  # E[TV] if exact
    perturbed = warp(logits + 2 * torch.randn(p.numel(), generator=torch.Generator().manual_seed(3)),
                     params)
    assert tv(emp, p) < 1.3 * noise
    assert tv(perturbed, p) > 3 * noise


def test_seeded_sampling_repeats_exactly(tiny_dir):
    eng = engine(tiny_dir)
    runs = [eng.generate([1, 2, 3], 30, SamplingParams(0.9, 0.95, 42),
                         select=lambda s: "random")[0] for _ in range(2)]
    assert runs[0] == runs[1]
    other = eng.generate([1, 2, 3], 30, SamplingParams(0.9, 0.95, 43), select=lambda s: "random")[0]
    assert other != runs[0]


def test_top_k_and_min_p_warp():
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -1.0, -2.0])
    top2 = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[2:] == 0).all() and (top2[:2] > 0).all()
    assert abs(float(top2.sum()) - 1) < 1e-6
    full = torch.softmax(logits, -1)
    assert torch.allclose(top2[:2], full[:2] / full[:2].sum())
    minp = warp(logits, SamplingParams(temperature=1.0, min_p=0.1))  # keeps p >= 0.1 * max
    assert ((minp > 0) == (full >= 0.1 * full.max())).all()
    assert torch.equal(warp(logits, SamplingParams(temperature=1.0, top_k=len(logits))),
                       warp(logits, SamplingParams(temperature=1.0)))
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8, top_k=2).greedy
    for bad in ({"top_k": -1}, {"top_k": 1.5}, {"min_p": 1.5}, {"min_p": float("nan")}):
        with pytest.raises(RequestError):
            SamplingParams(temperature=1.0, **bad)


def test_rejection_rule_stays_lossless_with_top_k_and_min_p():
    """Filtered rows have zeros where the other has mass: the draft proposes only what it
    kept, the residual supplies the rest, and the output is the warped target exactly."""
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0, top_k=4, min_p=0.05)
    p = warp(torch.randn(2, V, generator=gen) * 2, params)
    q = warp(torch.randn(1, V, generator=gen) * 2, params)
    assert (p == 0).any() and (q == 0).any()
    first = []
    for _ in range(20000):
        props = torch.multinomial(q, 1, generator=gen).view(-1)
        n, nxt = speculative_accept(props, q, p, gen)
        first.append((props[:n].tolist() + [nxt])[0])
    emp = empirical(first, len(first))
    assert tv(emp, p[0]) < 0.015
    assert (emp[p[0] == 0] == 0).all()  # never a token the target's filters removed


def test_top_k_1_decodes_the_greedy_tokens_at_any_temperature(tiny_dir):
    eng = engine(tiny_dir)
    greedy = eng.generate([1, 2, 3], 30, SamplingParams(), select=lambda s: "random")[0]
    for params in (SamplingParams(0.9, 1.0, 7, top_k=1), SamplingParams(1.5, 0.9, None, 1, 0.2)):
        assert eng.generate([1, 2, 3], 30, params, select=lambda s: "random")[0] == greedy
