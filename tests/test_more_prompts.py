"""More train prompts for draft training (`memspec zoo drafts --more-prompts N`): made
from training groups only, never a committed prompt again, and stable as N grows (the
responses to them are cached by id)."""

from __future__ import annotations

import json
from pathlib import Path

from memspec.zoo.corpora import DOMAINS, write_jsonl
from memspec.zoo.promptsets import more_train_prompts
from memspec.zoo.prompttext import prompt_body

_FUNC = '''
def f{i}(x):
    """Return x scaled by {i}; a docstring long enough to count as real documentation for
    the stub maker, which wants eighty characters or more."""
    return x * {i}
'''


def _doc(domain: str, i: int) -> dict:
    group = f"{domain}-g{i % 3}"
    words = " ".join(f"word{domain}{i}x{j}." for j in range(150))
    if domain == "code":
        return {"id": f"stdlib:m{i}", "text": "".join(_FUNC.format(i=i * 10 + j)
                                                   for j in range(4)), "group": group,
                "meta": {}}
    if domain == "math":
        return {"id": f"gsm:{i}", "text": "", "group": group,
                "meta": {"question": f"Tom has {i} apples and buys {i + 3} more. "
                                     "How many apples does Tom have now?"}}
    if domain == "medical":
        return {"id": f"hpo:{i}", "text": "", "group": group,
                "meta": {"name": f"Feature {i}", "definition": f"An abnormality number {i} "
                                                               "of the body, as seen in the clinic in many patients."}}
    return {"id": f"{domain}:{i}", "text": words, "group": group, "meta": {}}


def _corpus(root: Path) -> Path:
    for domain in DOMAINS:
        write_jsonl(root / domain / "train.jsonl", [_doc(domain, i) for i in range(8)])
    return root


def test_more_prompts_come_from_training_groups_and_skip_committed_ones(tmp_path):
    corpus = _corpus(tmp_path / "corpora")
    first = more_train_prompts(corpus, 3, [])
    taken = [first[0], first[1]]  # as if committed already
    rows = more_train_prompts(corpus, 3, taken)
    bodies = {prompt_body(r["prompt"]) for r in taken}
    assert not any(prompt_body(r["prompt"]) in bodies for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    groups = {d: {_doc(d, i)["group"] for i in range(8)} for d in DOMAINS}
    for r in rows:
        assert r["split"] == "train" and r["source"] in groups[r["domain"]], r
    assert {r["domain"] for r in rows} == set(DOMAINS)
    # deterministic, and N per domain is a prefix of any larger N: cached responses stay
    # valid when a later run asks for more
    assert json.dumps(rows) == json.dumps(more_train_prompts(corpus, 3, taken))
    more = {r["id"]: r for r in more_train_prompts(corpus, 5, taken)}
    assert all(more[r["id"]] == r for r in rows)
