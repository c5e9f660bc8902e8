"""Measuring acceptance tables A_d(t): one teacher-forced pass of a draft per trajectory.

With greedy decoding the committed tokens are the target's greedy trajectory whatever the
draft, so one pass of d over prompt + trajectory yields, for every position t, how many
consecutive trajectory tokens from t the draft would propose correctly (capped at gamma and
at the remaining length). The replay over these tables, which the runtime's oracles and the
simulator use, lives on the runtime side: procs/decoder/replay.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
