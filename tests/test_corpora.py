"""Checks on the committed prompt sets and, when built, the corpora they came from.

The eval prompts must measure drafts on text they never trained on, so the tests
guard the three ways that could break: eval/train prompt overlap, eval prompt text
inside the train prompts, and held-out prompt text inside the training corpus.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memspec.zoo.corpora import DOMAINS, leak_windows, load_corpus, normalise, prompt_body

PROMPTS = Path(__file__).resolve().parents[1] / "prompts"
MAX_PROMPT_CHARS = 800


def _read(name: str) -> list[dict]:
    with (PROMPTS / name).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _corpus_dir() -> Path:
    home = os.environ.get("MEMSPEC_HOME", str(Path(__file__).resolve().parents[1] / "models"))
    return Path(home) / "corpora"


@pytest.fixture(scope="module")
def eval_prompts() -> dict[str, list[dict]]:
    return {d: _read(f"{d}.jsonl") for d in DOMAINS}


@pytest.fixture(scope="module")
def train_prompts() -> list[dict]:
    return _read("train.jsonl")


@pytest.mark.parametrize("domain", DOMAINS)
def test_eval_prompt_files(eval_prompts: dict[str, list[dict]], domain: str) -> None:
    rows = eval_prompts[domain]
    assert len(rows) == 100
    assert [r["id"] for r in rows] == [f"{domain}-{i:03d}" for i in range(100)]
    for r in rows:
        assert set(r) == {"id", "domain", "prompt", "source"}
        assert r["domain"] == domain
        assert 40 < len(r["prompt"]) <= MAX_PROMPT_CHARS
    assert len({prompt_body(r["prompt"]) for r in rows}) == 100


def test_train_prompt_file(train_prompts: list[dict]) -> None:
    ids = [r["id"] for r in train_prompts]
    assert len(ids) == len(set(ids))
    assert {r["domain"] for r in train_prompts} == set(DOMAINS)
    for domain in DOMAINS:
        assert sum(r["domain"] == domain for r in train_prompts) >= 100
    assert all(len(r["prompt"]) <= MAX_PROMPT_CHARS for r in train_prompts)


def test_ids_unique_across_files(eval_prompts, train_prompts) -> None:
    ids = [r["id"] for rows in eval_prompts.values() for r in rows] + [
        r["id"] for r in train_prompts
    ]
    assert len(ids) == len(set(ids))


def test_eval_and_train_prompts_disjoint(eval_prompts, train_prompts) -> None:
    train_bodies = {prompt_body(r["prompt"]) for r in train_prompts}
    train_sources = {r["source"] for r in train_prompts}
    train_text = "\n".join(sorted(train_bodies))
    for rows in eval_prompts.values():
        for r in rows:
            assert prompt_body(r["prompt"]) not in train_bodies, r["id"]
            assert r["source"] not in train_sources, r["id"]
            for window in leak_windows(r["prompt"]):
                assert window not in train_text, (r["id"], window)


@pytest.mark.parametrize("domain", DOMAINS)
def test_heldout_prompts_absent_from_training_corpus(eval_prompts, domain: str) -> None:
    corpus = _corpus_dir()
    if not (corpus / domain / "train.jsonl").exists():
        pytest.skip(f"corpus not built at {corpus} (run memspec zoo corpora)")
    train_text = normalise("\n".join(d["text"] for d in load_corpus(corpus, domain, "train")))
    for r in eval_prompts[domain]:
        for window in leak_windows(r["prompt"]):
            assert window not in train_text, (r["id"], window)
