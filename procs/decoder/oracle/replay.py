"""Exact greedy replay of speculative decoding over acceptance tables A_d(t).

With greedy decoding the committed tokens are the target's greedy trajectory whatever the
draft, so whether draft d's i-th proposal at position t is accepted depends only on d and
the trajectory prefix: A_d(t) is how many consecutive trajectory tokens from t the draft
proposes correctly, capped at gamma and at the remaining length (`memspec trace` measures
it, zoo/tables.py). Replaying any draft schedule over these tables reproduces the engine's
per-iteration accepted counts exactly, which makes oracle baselines and policy sweeps cheap.

Pure (lists and ints): the runtime's oracle policies (procs/decoder/oracle/oracle.py), the replay
simulator, the predictor's labels and the evaluations share this one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

Table = Sequence[int]
Schedule = Callable[[int, int], str] | Sequence[str]  # (iteration, position) -> draft name


def step_accepted(table: Table, pos: int, gamma: int) -> int:
    """Accepted proposals at ``pos``: the table entry, capped at gamma and the remaining length."""
    return max(0, min(int(table[pos]), gamma, len(table) - pos))


@dataclass
class Replay:
    """Per-iteration outcome of replaying SD over one trajectory."""

    gamma: int
    length: int  # trajectory tokens
    drafts: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # committed tokens before each iteration
    accepted: list[int] = field(default_factory=list)

    @property
    def iterations(self) -> int:
        return len(self.accepted)

    @property
    def total_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.total_accepted / self.iterations if self.iterations else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted / (self.gamma * self.iterations) if self.iterations else 0.0

    def add(self, name: str, table: Table) -> int:
        """Run one iteration of ``name`` at the current position; returns the new position."""
        pos = self.position
        if pos >= self.length:
            raise ValueError("trajectory already complete")
        self.drafts.append(name)
        self.positions.append(pos)
        self.accepted.append(step_accepted(table, pos, self.gamma))
        return self.position

    @property
    def position(self) -> int:
        """Committed tokens after the last iteration (the end caps the bonus token)."""
        if not self.accepted:
            return 0
        return min(self.positions[-1] + self.accepted[-1] + 1, self.length)

    @property
    def done(self) -> bool:
        return self.position >= self.length


def _length(tables: Mapping[str, Table]) -> int:
    lengths = {len(t) for t in tables.values()}
    if len(lengths) != 1:
        raise ValueError(f"tables of one trajectory must have one length, got {sorted(lengths)}")
    return lengths.pop()


def replay(tables_by_draft: Mapping[str, Table], schedule: Schedule, gamma: int) -> Replay:
    """Exact greedy SD over one trajectory; ``schedule`` names the draft of every iteration."""
    out = Replay(gamma, _length(tables_by_draft))
    while not out.done:
        it = out.iterations
        if callable(schedule):
            name = schedule(it, out.position)
        elif it < len(schedule):
            name = schedule[it]
        else:
            raise ValueError(f"schedule ends after {len(schedule)} iterations, before the end")
        out.add(name, tables_by_draft[name])
    return out


def replay_static(tables_by_draft: Mapping[str, Table], name: str, gamma: int) -> Replay:
    return replay(tables_by_draft, lambda _it, _pos: name, gamma)


def _better(a: Replay, b: Replay) -> bool:
    """Fewer iterations is faster; at equal iterations more accepted tokens (end effects)."""
    return (a.iterations, -a.total_accepted) < (b.iterations, -b.total_accepted)


def oracle_static(tables_by_draft: Mapping[str, Table], gamma: int) -> tuple[str, Replay]:
    """Best single draft for this trajectory (ties: pool order)."""
    best_name, best = "", None
    for name in tables_by_draft:
        r = replay_static(tables_by_draft, name, gamma)
        if best is None or _better(r, best):
            best_name, best = name, r
    if best is None:
        raise ValueError("no drafts")
    return best_name, best


def lookahead(table: Table, pos: int, gamma: int, iterations: int) -> tuple[int, int]:
    """(position reached, iterations used) running one draft from ``pos`` for ``iterations``."""
    used = 0
    while used < iterations and pos < len(table):
        pos = min(pos + step_accepted(table, pos, gamma) + 1, len(table))
        used += 1
    return pos, used


def interval_utility(tables_by_draft: Mapping[str, Table], pos: int, gamma: int, interval: int,
                     horizon: int = 4) -> dict[str, float]:
    """Each draft's utility at a scheduling point: tokens it would commit over the next
    ``interval`` iterations, plus a small tie-breaker from the next ``horizon`` intervals.

    The tie-breaker matters: over one 4-iteration interval drafts often tie, and a draft that
    stays good longer is the better one to keep resident (loads take several iterations).
    """
    out = {}
    for name, table in tables_by_draft.items():
        near, _ = lookahead(table, pos, gamma, interval)
        far, _ = lookahead(table, pos, gamma, interval * horizon)
        out[name] = (near - pos) + (far - pos) / (1000.0 * interval * horizon * (gamma + 1))
    return out


def dynamic_scores(tables_by_draft: Mapping[str, Table], pos: int, gamma: int, interval: int,
                   active: str | None = None, resident: Collection[str] = ()
                   ) -> dict[str, float]:
    """oracle-dynamic's scores at a scheduling point: the interval utility, where exact ties
    keep what is already there (the active draft, then resident ones): a switch or a load
    buys nothing."""
    scores = interval_utility(tables_by_draft, pos, gamma, interval)
    return {d: s + (2e-9 if d == active else 1e-9 if d in resident else 0.0)
            for d, s in scores.items()}


def oracle_dynamic(tables_by_draft: Mapping[str, Table], gamma: int, interval: int = 4) -> Replay:
    """oracle-dynamic without a memory limit: at each interval boundary the best-scored
    draft (:func:`dynamic_scores`, the runtime policy's own choice) runs the interval.

    Greedy per interval with future knowledge, not a global optimum, so it can fall below
    oracle-static on an unlucky trajectory. Ties keep the current draft, then pool order.
    """
    if interval < 1:
        raise ValueError("interval must be >= 1")
    out = Replay(gamma, _length(tables_by_draft))
    current: str | None = None
    while not out.done:
        scores = dynamic_scores(tables_by_draft, out.position, gamma, interval, current)
        current = max(scores, key=lambda d: scores[d])
        for _ in range(interval):
            if out.done:
                break
            out.add(current, tables_by_draft[current])
    return out


def utility_label(tables_by_draft: Mapping[str, Table], pos: int, gamma: int, interval: int,
                  horizon: int = 4) -> str | None:
    """The draft with the highest interval utility; None when every draft ties exactly
    (no draft is better there, so the position teaches nothing). Ties: pool order."""
    u = interval_utility(tables_by_draft, pos, gamma, interval, horizon)
    if len(set(u.values())) <= 1:
        return None
    return max(u, key=lambda d: u[d])


def pooled(replays: Sequence[Replay]) -> dict[str, float]:
    """Token-weighted totals over several trajectories (vLLM-style aggregate metrics)."""
    iters = sum(r.iterations for r in replays)
    acc = sum(r.total_accepted for r in replays)
    gamma = replays[0].gamma if replays else 1
    return {
        "iterations": iters,
        "accepted": acc,
        "mean_acceptance_length": 1.0 + acc / iters if iters else 1.0,
        "acceptance_rate": acc / (gamma * iters) if iters else 0.0,
    }
