"""oracle-dynamic's exact proposals beside the engine's own, for the engine tests."""

from __future__ import annotations

from collections.abc import Sequence

from memspec.procs.decoder.oracle.oracle import exact_depth


def exact_and_full(eng, prompt: list[int], n: int, name: str,  # noqa: ANN001
                   table: Sequence[int | None]) -> tuple[tuple, tuple]:
    """(tokens, stats) of `name` run told its table (`Session.propose`), then as the
    engine runs it alone."""
    propose = exact_depth({name: table}, eng.gamma)

    def exact(s):  # noqa: ANN001, ANN202
        s.propose = propose
        return name

    return eng.generate(prompt, n, select=exact), eng.generate(prompt, n, select=lambda s: name)
