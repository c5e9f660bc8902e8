"""The committed prompt splits: disjoint by source, and free of the drafts' training text.

Every figure that claims to be measured on unseen text rests on these files, so the
checks run on a clean clone (no corpora built): source lists and a sampled fingerprint of
the training text are committed beside the prompts. Where the corpora are built, a
further test regenerates every file and compares bytes, which also proves the committed
lists and fingerprint are those of the real training text.
"""

from __future__ import annotations

import json
import os
import re
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from memspec.zoo.corpora import DOMAINS
from memspec.zoo.prompts import PROMPTS_DIR, SPLITS, load_prompts, row_sources
from memspec.zoo.promptsets import FINGERPRINT_FILE, SOURCES_FILE
from memspec.zoo.prompttext import (
    MAX_OVERLAP,
    MAX_PROMPT_CHARS,
    fingerprint_ok,
    flat_text,
    leak_windows,
    prompt_body,
)
from memspec.zoo.shingles import load_fingerprint, sampled_hits
from memspec.zoo.splits import assign_sources

EVAL = ("dev", "dev2", "mixed", "test2")
MIN_PER_DOMAIN = {"train": 100, "dev": 30, "dev2": 50, "test2": 10}


@pytest.fixture(scope="module")
def sets() -> dict[str, list[dict]]:
    return {s: load_prompts(s) for s in SPLITS}


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((PROMPTS_DIR / SOURCES_FILE).read_text())


@pytest.fixture(scope="module")
def fingerprint() -> np.ndarray:
    return load_fingerprint(PROMPTS_DIR / FINGERPRINT_FILE)


def _text(row: dict) -> str:
    """What a leak check looks at: the source-derived body (mixed: the whole prompt)."""
    return prompt_body(row["prompt"]) if row["split"] != "mixed" else flat_text(row["prompt"])


# --------------------------------------------------------------------------- layout, counts


def test_rows_layout_and_unique_ids(sets) -> None:
    ids = [r["id"] for rows in sets.values() for r in rows]
    assert len(ids) == len(set(ids))
    for split, rows in sets.items():
        for r in rows:
            assert r["split"] == split
            assert 40 < len(r["prompt"]) <= MAX_PROMPT_CHARS, r["id"]
            if split == "mixed":
                assert re.fullmatch(r"mixed-\d{3}", r["id"]) and r["domain"] == "mixed"
                assert len(set(r["domains"])) >= 2 and set(r["domains"]) <= set(DOMAINS)
                assert isinstance(r["source"], list) and r["source"]
            else:
                assert re.fullmatch(rf"{split}-{r['domain']}-\d{{3}}", r["id"])
                assert r["domain"] in DOMAINS and isinstance(r["source"], str)


@pytest.mark.parametrize("split", ["train", "dev", "dev2", "test2"])
def test_enough_prompts_per_domain(sets, split: str) -> None:
    for domain in DOMAINS:
        n = sum(r["domain"] == domain for r in sets[split])
        assert n >= MIN_PER_DOMAIN[split], (split, domain, n)


def test_mixed_workload(sets) -> None:
    rows = sets["mixed"]
    assert len(rows) >= 100
    crossings = {tuple(r["domains"]) for r in rows}
    assert len(crossings) >= 8  # varied: not one pattern repeated
    assert {d for c in crossings for d in c} == set(DOMAINS)
    assert len({r["prompt"] for r in rows}) == len(rows)


# --------------------------------------------------------------------------- disjointness


def test_sets_disjoint_by_source(sets, manifest) -> None:
    lists = {d: {s: set(v) for s, v in manifest["domains"][d].items()} for d in DOMAINS}
    for d in DOMAINS:
        for a, b in combinations(("train", "dev", "dev2", "test2"), 2):
            assert not lists[d][a] & lists[d][b], (d, a, b, sorted(lists[d][a] & lists[d][b])[:5])
    for split in ("train", "dev", "dev2", "test2"):
        for r in sets[split]:
            assert r["source"] in lists[r["domain"]][split], (r["id"], r["source"])
    dev2_sources = set().union(*(lists[d]["dev2"] for d in DOMAINS))
    for r in sets["mixed"]:
        assert set(r["source"]) <= dev2_sources, r["id"]
    # and straight from the files, whatever the manifest says
    used = {s: {x for r in rows for x in row_sources(r)} for s, rows in sets.items()}
    for a, b in combinations(SPLITS, 2):
        if {a, b} != {"dev2", "mixed"}:  # mixed is built from dev2 sources on purpose
            assert not used[a] & used[b], (a, b, sorted(used[a] & used[b])[:5])


def test_no_prompt_text_shared_across_sets(sets) -> None:
    bodies = {s: {prompt_body(r["prompt"]) for r in rows} for s, rows in sets.items()}
    for a, b in combinations(SPLITS, 2):
        assert not bodies[a] & bodies[b], (a, b)
    for split, rows in sets.items():
        if split == "mixed":
            continue
        others = flat_text("\n".join(r["prompt"] for s, rr in sets.items() if s != split
                                  for r in rr))
        for r in rows:
            for window in leak_windows(prompt_body(r["prompt"])):
                assert window not in others, (r["id"], window)


# --------------------------------------------------------------------------- training text


def test_fingerprint_detects_training_text(sets, manifest, fingerprint) -> None:
    """Positive control: train prompts quote training documents, and the check sees it
    whenever a prompt has a sampled shingle at all (code train prompts are rewritten stubs)."""
    assert fingerprint.size == manifest["shingles"]["count"] > 100_000
    assert np.all(np.diff(fingerprint.astype(np.int64)) > 0)
    seen = [r for r in sets["train"] if r["domain"] != "code"
            and sampled_hits(_text(r), fingerprint)[1] > 0]
    assert len(seen) > 300
    assert np.mean([not fingerprint_ok(_text(r), fingerprint) for r in seen]) > 0.95


@pytest.mark.parametrize("split", EVAL)
def test_eval_prompts_absent_from_training_text(sets, manifest, fingerprint, split) -> None:
    hits = sampled = covered = 0
    for r in sets[split]:
        text = _text(r)
        assert fingerprint_ok(text, fingerprint), r["id"]
        h, s = sampled_hits(text, fingerprint)
        hits, sampled, covered = hits + h, sampled + s, covered + (s > 0)
    assert covered >= 0.8 * len(sets[split])  # the check sees most prompts, not a few
    assert hits / sampled <= manifest["max_overlap"] == MAX_OVERLAP


# --------------------------------------------------------------------------- the split rules


def _doc(doc_id: str, group: str, **meta) -> dict:
    return {"id": doc_id, "text": "x", "group": group, "meta": meta}


def test_law_family_straddling_groups_is_not_held_out() -> None:
    """gpl-x sits in another family's group; gpl's own group is held out: both unusable."""
    train = [_doc("licence:gpl-2.0", "licence:gpl")]
    held = [_doc("licence:gpl-foo-exception", "licence:foo"), _doc("licence:foo-1", "licence:foo"),
            _doc("licence:bar", "licence:bar")]
    plan = assign_sources("law", train, held)
    assert set(plan.doc_split) == {"licence:bar"} and plan.unused_docs == 2


def test_hpo_terms_follow_every_parent_and_their_children() -> None:
    train = [_doc("hpo:T1", "hpo-family:P1", parents=["P1"]),
             _doc("hpo:C", "hpo-family:H3", parents=["H3"])]  # H3's child is training text
    held = [_doc("hpo:H1", "hpo-family:P2", parents=["P2", "P1"]),  # sibling of T1 via P1
            _doc("hpo:H2", "hpo-family:P3", parents=["P3"]),
            _doc("hpo:H3", "hpo-family:P3", parents=["P3"]),
            _doc("hpo:H4", "hpo-family:P4", parents=["P4", "P3"])]
    plan = assign_sources("medical", train, held)
    assert set(plan.doc_split) == {"hpo:H2", "hpo:H4"}
    assert plan.doc_split["hpo:H2"] == plan.doc_split["hpo:H4"]  # joined through P3
    assert {"hpo-family:P3", "hpo-family:P4"} <= plan.keys[plan.doc_split["hpo:H2"]]


def test_math_templates_are_one_source() -> None:
    held = [_doc(f"gsm:{t:02d}:{i:03d}", f"gsm:{t:02d}") for t in range(9) for i in range(3)]
    plan = assign_sources("math", [_doc("gsm:50:000", "gsm:50")], held)
    by_template: dict[str, set[str]] = {}
    for doc_id, split in plan.doc_split.items():
        by_template.setdefault(doc_id[:6], set()).add(split)
    assert all(len(s) == 1 for s in by_template.values())
    assert sorted(len(plan.keys[s]) for s in ("dev", "dev2")) == [3, 6]


def test_load_prompts_api() -> None:
    rows = load_prompts("dev2", ["law", "code"], per_domain=2)
    assert [r["domain"] for r in rows] == ["law", "law", "code", "code"]
    assert len(load_prompts("mixed", per_domain=5)) == 5


# --------------------------------------------------------------------------- against the corpora


def _corpus_dir() -> Path:
    home = os.environ.get("MEMSPEC_HOME", str(Path(__file__).resolve().parents[1] / "models"))
    return Path(home) / "corpora"


@pytest.mark.slow
def test_committed_files_are_what_the_corpora_give(tmp_path) -> None:
    """Regenerate every prompt file, the source lists and the fingerprint; compare bytes."""
    from memspec.zoo.promptsets import build_prompt_sets, corpus_inputs_of

    corpus = _corpus_dir()
    if not all((corpus / d / "train.jsonl").is_file() for d in DOMAINS):
        pytest.skip(f"corpora not built at {corpus} (run memspec zoo corpora)")
    committed = json.loads((PROMPTS_DIR / SOURCES_FILE).read_text())["corpus_inputs"]
    built = corpus_inputs_of(corpus)
    assert built == committed, ("corpora built from other inputs than the committed prompts: "
                                "run launch/install_corpus_sources.sh, then memspec zoo corpora",
                                built, committed)
    build_prompt_sets(corpus, tmp_path, progress=False)
    for name in (*(f"{s}.jsonl" for s in SPLITS), SOURCES_FILE, FINGERPRINT_FILE):
        assert (tmp_path / name).read_bytes() == (PROMPTS_DIR / name).read_bytes(), name
