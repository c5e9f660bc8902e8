"""Measuring acceptance tables A_d(t) over a target trajectory, as the engine would see them.

With greedy decoding the committed tokens are the target's greedy trajectory whatever the
draft, so A_d(t) (how many consecutive trajectory tokens from t draft d would propose
correctly, capped at gamma and the remaining length) depends only on d and the trajectory.
For a draft model whose context is the committed tokens, one teacher-forced pass gives
every position. A head's 2nd..gamma-th proposals read its own previous outputs, so each
position is unrolled as the engine does it. :func:`runtime_table` runs the engine's own
runners (whose kernels give a row the same numbers however rows are batched), so its tables
are the engine's; :func:`acceptance_table` is the older pass through an HF module. The
replay over tables (runtime oracles, simulator) lives in procs/decoder/oracle/replay.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from memspec.procs.decoder.drafts.datastore import DATASTORE_KIND, Datastore, tail_width
from memspec.procs.decoder.drafts.head import HEAD_KIND, first_floor, stop_floor, unsure
from memspec.procs.decoder.drafts.lookup import NgramIndex

# --------------------------------------------------------------------------- model pass


@torch.inference_mode()
def draft_correct(draft_model: torch.nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int],
                  to_draft: torch.Tensor | None = None, to_target: torch.Tensor | None = None,
                  vocab: int | None = None) -> list[bool]:
    """Whether the draft's greedy next token equals ``tokens[j]`` given prompt + tokens[:j].

    Ids are mapped exactly as the engine maps them (``to_draft`` for inputs, ``to_target``
    for the argmax; ``vocab`` trims a padded same-tokenizer head), so the answers are the
    engine's proposals whenever the draft's context is the committed trajectory.
    """
    n = len(tokens)
    if n == 0:
        return []
    ids = torch.tensor(list(prompt_ids) + list(tokens[:-1]), dtype=torch.long)
    dev = next(draft_model.parameters()).device
    if to_draft is not None:
        ids = to_draft[ids.to(to_draft.device)]
    logits = draft_model(ids.to(dev).view(1, -1), logits_to_keep=n).logits[0, -n:]
    if to_target is None and vocab is not None:
        logits = logits[:, :vocab]
    pred = logits.argmax(-1)
    if to_target is not None:
        pred = to_target[pred.to(to_target.device)]
    return (pred.cpu() == torch.tensor(list(tokens), dtype=torch.long)).tolist()


def table_from_correct(correct: Sequence[bool], gamma: int) -> list[int]:
    """A(t) = length of the run of correct predictions starting at t, capped at gamma."""
    run = [0] * (len(correct) + 1)
    for t in range(len(correct) - 1, -1, -1):
        run[t] = run[t + 1] + 1 if correct[t] else 0
    return [min(r, gamma) for r in run[:-1]]


def acceptance_table(draft_model: torch.nn.Module, prompt_ids: Sequence[int],
                     tokens: Sequence[int], gamma: int, to_draft: torch.Tensor | None = None,
                     to_target: torch.Tensor | None = None, vocab: int | None = None) -> list[int]:
    """A_d(t) for t in [0, len(tokens)) from one teacher-forced pass of the draft."""
    return table_from_correct(draft_correct(draft_model, prompt_ids, tokens, to_draft,
                                            to_target, vocab), gamma)


# --------------------------------------------------------------------------- the engine's runners


@torch.inference_mode()
def runtime_table(engine, bound, prompt_ids: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """A_d(t) for t in [0, len(tokens)), computed with the engine's target and draft runners.

    ``engine`` is a SpecEngine whose target is in the dtype the runtime uses (the target
    runs only for a head, whose inputs are the target's features); ``bound`` is a draft
    bound in a slot (procs/decoder/slots.py)."""
    gamma, n = engine.gamma, len(tokens)
    if n == 0:
        return []
    if bound.kind == DATASTORE_KIND:  # no model: the lookups alone, as the engine chains them
        return store_table(prompt_ids, tokens, gamma, engine.lookup, bound.runner.store)
    seq = list(prompt_ids) + list(tokens)
    dev = engine.device
    ids = torch.tensor(seq, dtype=torch.long, device=dev)
    P = len(prompt_ids)
    lk = engine_lookup(engine, bound, prompt_ids, tokens)
    if bound.kind != "head":
        inp = ids[:-1] if bound.to_draft is None else bound.to_draft[ids[:-1]]
        logits = bound.runner.forward(inp, 0, bound.new_cache(len(seq) + gamma + 1))
        logits = logits[P - 1:]
        if bound.to_target is None:
            logits = logits[:, :engine.vocab]
        pred = logits.argmax(-1)
        if bound.to_target is not None:
            pred = bound.to_target[pred]
        correct = (pred.cpu() == torch.tensor(list(tokens), dtype=torch.long)).tolist()
        if lk is None:
            return table_from_correct(correct, gamma)
        return [_run(lk[t], tokens, t, lambda k, t=t: correct[t + k]) for t in range(n)]
    # a head: the target's features for every position first, then per start position
    # the engine's calls
    return head_table(bound, target_features(engine, ids), ids, P, tokens, gamma, lk)


def store_table(prompt_ids: Sequence[int], tokens: Sequence[int], gamma: int, lookup_n: int,
                store: Datastore) -> list[int]:
    """A_d(t) of a datastore draft (Session._lookup_step): from each t, the context lookup's
    proposal where the context repeats, else the store's, while they match the trajectory."""
    idx = NgramIndex(lookup_n, prompt_ids) if lookup_n else None
    seq = [int(x) for x in prompt_ids] + [int(x) for x in tokens]
    P, n = len(prompt_ids), len(tokens)
    width = tail_width(idx, store)
    out: list[int] = []
    for t in range(n):
        tail = seq[max(0, P + t - width):P + t]
        a = 0
        while a < min(gamma, n - t):
            c = idx.propose(tail) if idx is not None else None
            if c is None:
                c = store.propose(tail)
            if c != seq[P + t + a]:
                break
            tail.append(c)
            a += 1
        out.append(a)
        if idx is not None:
            idx.extend(seq[P + t:P + t + 1])
    return out


def engine_lookup(engine, bound, prompt_ids: Sequence[int], tokens: Sequence[int]
                  ) -> list[list[int | None]] | None:
    """:func:`lookup_rows` for a draft bound in ``engine``, None when its lookup is off."""
    if not engine.lookup:
        return None
    # a head takes a looked-up token outside its vocabulary (it embeds target ids); a model
    # draft cannot (its own guess stands)
    inside = None if bound.kind == HEAD_KIND else bound.to_target
    return lookup_rows(prompt_ids, tokens, engine.gamma, engine.lookup, inside)


def lookup_rows(prompt_ids: Sequence[int], tokens: Sequence[int], gamma: int, n_min: int,
                to_target: torch.Tensor | None) -> list[list[int | None]]:
    """``rows[t][k]``: the token the engine's context lookup proposes at step k of an
    iteration that starts with ``t`` tokens committed, every earlier proposal right (None:
    the draft's own guess stands, as for a token outside ``to_target``, the vocabulary of a
    draft that reads draft ids)."""
    idx = NgramIndex(n_min, prompt_ids)
    seq = [int(x) for x in prompt_ids] + [int(x) for x in tokens]
    P, n = len(prompt_ids), len(tokens)
    ok = None
    if to_target is not None:
        inside = set(to_target.tolist())
        ok = inside.__contains__
    rows: list[list[int | None]] = []
    for t in range(n):
        tail = seq[max(0, P + t - idx.n_max):P + t]
        row: list[int | None] = []
        for k in range(min(gamma, n - t)):
            c = idx.propose(tail)
            row.append(c if c is not None and (ok is None or ok(c)) else None)
            tail.append(seq[P + t + k])  # a chain goes on only past a right proposal
        rows.append(row)
        idx.extend(seq[P + t:P + t + 1])
    return rows


def _run(row: Sequence[int | None], tokens: Sequence[int], t: int,
         draft_right: Callable[[int], bool]) -> int:
    """Accepted proposals from t: the looked-up token where there is one, else the draft's."""
    a = 0
    for k, c in enumerate(row):
        if not (c == tokens[t + k] if c is not None else draft_right(k)):
            break
        a += 1
    return a


@torch.inference_mode()
def target_features(engine, ids: torch.Tensor) -> torch.Tensor:
    """The target's feature rows of positions 0..len(ids)-2 in one pass: the same rows the
    engine's steps and verifies write (the runners give a row the same numbers however
    rows are batched)."""
    tcache = engine.target.new_cache(len(ids) + engine.gamma + 1)
    engine.target.forward(ids[:-1], 0, tcache, last_only=True)
    return tcache.feat[:len(ids) - 1].clone()


@torch.inference_mode()
def head_table(bound, feat: torch.Tensor, ids: torch.Tensor, P: int, tokens: Sequence[int],
               gamma: int, lookup: Sequence[Sequence[int | None]] | None = None,
               stop: float | None = None, first: float | None = None) -> list[int]:
    """A head's A_d(t) given the target's feature rows of positions 0..len(ids)-2 (the
    rows :func:`runtime_table` computes; training reuses them across checkpoints).
    ``ids`` is prompt + tokens on the engine's device, ``P`` the prompt length;
    ``lookup``: :func:`lookup_rows` when the engine's context lookup is on; ``stop``: the
    floor under which the head stops proposing (None: the engine's, ``stop_floor``);
    ``first``: the floor under which it proposes nothing (None: ``first_floor``)."""
    n = len(tokens)
    head, to_target = bound.runner, bound.to_target
    cache = bound.new_cache(len(ids) + gamma + 1)
    zero = torch.zeros_like(feat[:1])
    if stop is None:  # where the engine stops proposing (unsure proposals)
        stop = stop_floor(ids.device)
    if first is None:  # ... and where it proposes nothing (an unsure first proposal)
        first = first_floor(ids.device)
    out = []
    logits, hidden = head.teacher(ids[:P], 0, cache, torch.cat([zero, feat[:P - 1]]))
    for t in range(n):
        L = P + t  # committed tokens before this iteration
        if t:  # the engine catches up on the newly committed token with its feature
            logits, hidden = head.teacher(ids[L - 1:L], L - 1, cache, feat[L - 2:L - 1])
        a, lg, hid = 0, logits, hidden
        for k in range(min(gamma, n - t)):
            c = lookup[t][k] if lookup is not None else None
            if c is None and unsure(lg[-1], stop if k else first):
                break
            if (c if c is not None else int(to_target[lg[-1].argmax()])) != tokens[t + k]:
                break
            a += 1
            if k < gamma - 1 and t + k + 1 < n:
                lg, hid = head.step(ids[L + k:L + k + 1], L + k, cache, hid)
        out.append(a)
    return out


# --------------------------------------------------------------------------- the engine's view


def capped_engine_accepts(accepted: Sequence[int], emitted: Sequence[int],
                          length: int) -> list[int]:
    """The engine's per-iteration accepted counts, capped at the remaining length.

    The engine verifies all gamma proposals even when fewer tokens remain (or past EOS), so
    its last iteration can report more accepted tokens than a table capped at the end.
    """
    out, pos = [], 0
    for a, e in zip(accepted, emitted):
        out.append(min(a, length - pos))
        pos += e
    return out
