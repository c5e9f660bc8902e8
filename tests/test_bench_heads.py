"""`memspec bench heads`: its prompts are dev rows no head checkpoint was chosen on."""

from __future__ import annotations

import pytest

from memspec.bench.heads_ab import unscored_dev
from memspec.common.errors import ConfigError
from memspec.zoo.heads import DEV_PER_DOMAIN
from memspec.zoo.prompts import DOMAINS, load_prompts


def test_prompts_are_dev_rows_past_the_checkpoint_choice() -> None:
    rows = unscored_dev(3)
    scored = {r["id"] for r in load_prompts("dev", DOMAINS, DEV_PER_DOMAIN)}
    assert len(rows) == 3 * len(DOMAINS) and not scored & {r["id"] for r in rows}
    assert [r["domain"] for r in rows[:len(DOMAINS)]] == list(DOMAINS)  # interleaved
    assert rows[0] == load_prompts("dev", ["general"])[DEV_PER_DOMAIN]


def test_too_many_prompts_is_one_line() -> None:
    with pytest.raises(ConfigError, match="no prompts past"):
        unscored_dev(5, skip=10_000)
