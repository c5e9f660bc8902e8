"""`memspec zoo curves`: training records read, domain heads placed after the general
head's chosen checkpoint, and what the last third of a run was still buying."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from memspec.common.errors import ConfigError
from memspec.zoo.curves import last_gain, read_curves


def _head(root: Path, name: str, evals: list[tuple[float, float]], init: str | None) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "training.json").write_text(json.dumps({
        "evals": [{"step": i, "train_s": 60 * m, "dev": v} for i, (m, v) in enumerate(evals)],
        "plan": {"minutes": evals[-1][0], "init_from": init}, "best_dev": max(v for _, v in
                                                                             evals),
        "stopped": "budget", "rows_seen": 10}))
    return folder


def test_curves_place_domain_heads_and_measure_the_end(tmp_path: Path) -> None:
    g = _head(tmp_path, "general", [(0, 0.0), (10, 1.3), (20, 1.5), (30, 1.45)], None)
    m = _head(tmp_path, "math", [(0, 1.6), (2, 1.7), (4, 1.75), (6, 1.76)], "general")
    e = _head(tmp_path, "law", [(0, 0.0)], None)  # stopped before a scored checkpoint
    pool = SimpleNamespace(drafts=[SimpleNamespace(name="general", path=g),
                                   SimpleNamespace(name="math", path=m),
                                   SimpleNamespace(name="law", path=e)])
    c = read_curves(pool)
    assert "law" not in c
    assert c["general"]["minutes"] == [10, 20, 30]  # step 0 of a fresh head scores nothing
    assert c["general"]["offset_min"] == 0.0
    assert c["math"]["offset_min"] == 20  # from the general head's best checkpoint
    assert c["math"]["minutes"][0] == 0 and c["math"]["dev"][0] == 1.6
    # last third of math: from 4 min (1.75) to its best after (1.76) over 2 min
    assert last_gain(c["math"]) == pytest.approx(10 * 0.01 / 2)
    # general's last third starts at 20 min: nothing above 1.5 after it
    assert last_gain(c["general"]) == pytest.approx(0.0)


def test_a_broken_record_is_one_line_naming_the_head(tmp_path: Path) -> None:
    folder = tmp_path / "law"
    folder.mkdir()
    (folder / "training.json").write_text("{}")
    pool = SimpleNamespace(drafts=[SimpleNamespace(name="law", path=folder)])
    with pytest.raises(ConfigError, match="zoo drafts --only law"):
        read_curves(pool)


def test_a_continued_head_is_drawn_on_one_clock(tmp_path: Path) -> None:
    """--continue keeps the run before in the record: its points come first, the new run's
    after them; an older fine-tune still starts at the first run's choice, a newer one
    where its record says its parent's choice was."""
    first = {"evals": [{"step": i, "train_s": 60 * m, "dev": v} for i, (m, v) in
                       enumerate([(0, 0.0), (10, 1.3), (20, 1.5), (30, 1.45)])],
             "plan": {"minutes": 30, "init_from": None}, "wall_s": 1800, "best_dev": 1.5}
    g = tmp_path / "general"
    g.mkdir()
    (g / "training.json").write_text(json.dumps({
        "evals": [{"step": i, "train_s": 60 * m, "dev": v} for i, (m, v) in
                  enumerate([(0, 1.5), (10, 1.55), (20, 1.6)])],
        "plan": {"minutes": 20, "init_from": "general@previous"}, "wall_s": 1200,
        "best_dev": 1.6, "continues": first}))
    old = _head(tmp_path, "math", [(0, 1.6), (2, 1.7)], "general")
    new = _head(tmp_path, "law", [(0, 1.62), (2, 1.72)], "general")
    rec = json.loads((new / "training.json").read_text())
    (new / "training.json").write_text(json.dumps(rec | {"parent_minutes": 50.0}))
    pool = SimpleNamespace(drafts=[SimpleNamespace(name=n, path=p) for n, p in
                                   (("general", g), ("math", old), ("law", new))])
    c = read_curves(pool)
    assert c["general"]["minutes"] == [10, 20, 30, 30, 40, 50]
    assert c["general"]["dev"][-1] == 1.6 and c["general"]["offset_min"] == 0.0
    assert c["math"]["offset_min"] == 20 and c["law"]["offset_min"] == 50
