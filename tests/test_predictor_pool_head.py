"""A pool's own predictor head: the pool fingerprint in its sidecar (a head trained for other
drafts with the same names is refused), split prompt/recent views, and the runtime building
exactly the inputs the trainer trained on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from memspec.common.errors import ModelError
from memspec.procs.predictor import pool_head_path
from memspec.procs.predictor.head import RankHead, load_head, save_head, split_input
from memspec.procs.predictor.ranker import Ranker
from memspec.zoo.train_predictor import EmbeddingCache, Example, head_inputs, view_examples

NAMES = ["general", "code"]
FP = {"general": "a" * 64, "code": "b" * 64, "(lookup)": "2"}


def _head(views: str = "joint", seed: int = 0) -> RankHead:
    torch.manual_seed(seed)
    return RankHead(NAMES, embed_dim=8, views=views).eval()


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=-1)


# --- fingerprint -------------------------------------------------------------------------
def test_fingerprint_round_trip_and_a_head_for_other_weights_is_refused(tmp_path):
    path = tmp_path / "p.head.safetensors"
    save_head(_head(), path, {"pool_fingerprint": FP})
    assert load_head(path, NAMES, FP).fingerprint == FP
    other = {**FP, "code": "c" * 64}  # same names, another code draft
    with pytest.raises(ModelError, match="trained for another pool") as exc:
        load_head(path, NAMES, other)
    msg = str(exc.value)
    assert "code" in msg and "general" not in msg.split("differs on")[1].split(")")[0]
    assert "memspec predictor train --pool" in msg and "\n" not in msg
    with pytest.raises(ModelError, match="lookup"):  # the context lookup changes tables too
        load_head(path, NAMES, {k: v for k, v in FP.items() if k != "(lookup)"})


def test_a_head_without_a_fingerprint_loads_for_the_caller_to_judge(tmp_path):
    path = tmp_path / "old.safetensors"
    save_head(_head(), path)  # as heads trained before fingerprints were saved
    head = load_head(path, NAMES, FP)
    assert head.fingerprint is None and head.views == "joint"


# --- views -------------------------------------------------------------------------------
def test_split_head_round_trip_and_wrong_width_is_one_line_error(tmp_path):
    head = _head("split", seed=1)
    path = tmp_path / "s.safetensors"
    save_head(head, path, {"pool_fingerprint": FP})
    back = load_head(path, list(reversed(NAMES)), FP)
    assert back.views == "split" and back.width == 2
    x, flags = _unit(3, 16, 0), [False, True, True]
    assert torch.allclose(back.probs(x, flags), head.probs(x, flags)[:, [1, 0]])
    with pytest.raises(ModelError, match="split-view head reads 16-d inputs, got 8-d"):
        back.probs(_unit(3, 8, 0), flags)


def test_split_input_zeroes_missing_recent():
    p, r = _unit(2, 4, 1), _unit(2, 4, 2)
    got = split_input(p, r, [False, True])
    assert torch.equal(got[:, :4], p)
    assert torch.equal(got[0, 4:], torch.zeros(4)) and torch.equal(got[1, 4:], r[1])


class CountingEncoder:
    """Deterministic fake: a vector from the (prompt, recent) text; counts what it encodes."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def embed(self, prompts, recents=None):
        recents = list(recents) if recents is not None else [""] * len(prompts)
        self.seen += list(zip(prompts, recents))
        rows = [torch.tensor([len(p), len(r), p.count("a"), r.count("e")], dtype=torch.float)
                for p, r in zip(prompts, recents)]
        return torch.nn.functional.normalize(torch.stack(rows) + 0.5, dim=-1)


@pytest.mark.parametrize("views", ["joint", "split"])
def test_runtime_inputs_are_the_trainers(tmp_path, views):
    """What the process feeds a head equals what the head was trained on (cached training
    embeddings), for both views; split encodes a request's prompt once."""
    prompts = ["a prompt", "a prompt", "another prompt", "a prompt"]
    recents = ["", "some recent text", "tree", "more recent"]
    enc = CountingEncoder()
    ranker = Ranker(enc, RankHead(NAMES, embed_dim=4, views=views), None, NAMES, 32)
    runtime = ranker.head_input(prompts, recents)
    examples = [Example("x", 0, p, r) for p, r in zip(prompts, recents)]
    cache = EmbeddingCache(tmp_path)
    cache.embed(CountingEncoder(), cache.missing(view_examples(examples, views)))
    assert torch.allclose(runtime, head_inputs(cache, examples, views))
    if views == "split":
        assert sorted(p for p, r in enc.seen if not r) == ["a prompt", "another prompt"]
        ranker.head_input(["a prompt"], ["new text"])
        assert enc.seen[-1] == ("", "new text")  # the prompt came from the cache
        assert not any(p and r for p, r in enc.seen)  # never a joint input


# --- the ranker with the pool's own head ----------------------------------------------------
@pytest.fixture(scope="module")
def pool_file(tmp_path_factory, tiny_dir) -> Path:
    from memspec.procs.predictor.encoder import encoder_available

    if not encoder_available():
        pytest.skip("all-MiniLM-L6-v2 wheel missing")
    root = tmp_path_factory.mktemp("poolhead")
    toml = root / "mine.toml"
    toml.write_text(f'''[pool]
target = "{tiny_dir / 'target'}"
[[drafts]]
name = "general"
path = "{tiny_dir / 'self'}"
[[drafts]]
name = "code"
domain = "code"
path = "{tiny_dir / 'small'}"
''')
    return toml


def _pool(pool_file: Path):
    from memspec.common.config import load_pool

    return load_pool(pool_file)


def _write_own_head(pool_file: Path, fingerprint: dict | None, views: str = "split") -> Path:
    path = pool_head_path(pool_file)
    torch.manual_seed(0)
    info = {"pool_fingerprint": fingerprint} if fingerprint is not None else {}
    save_head(RankHead(NAMES, views=views), path, info)
    return path


def test_pool_head_for_this_pool_ranks_and_one_for_other_drafts_falls_back(pool_file):
    from memspec.procs.decoder.oracle.tablefiles import pool_fingerprint

    pool = _pool(pool_file)
    torch.set_num_threads(1)
    _write_own_head(pool_file, pool_fingerprint(pool))
    r = Ranker.load(pool)
    assert r.head is not None and r.head.views == "split" and not r.notice and not r.warning
    (probs,), _ = r.rank(["Write a Python function."], [[]])
    assert len(probs) == 2 and abs(sum(probs) - 1) < 1e-5

    _write_own_head(pool_file, {**pool_fingerprint(pool), "code": "0" * 64})
    r = Ranker.load(pool)
    assert r.head is None and "trained for another pool" in r.notice
    assert f"memspec predictor train --pool {pool_file}" in r.notice and "\n" not in r.notice
    with pytest.raises(ModelError, match="trained for another pool"):  # named: an error
        Ranker.load(replace(pool, predictor_head=pool_head_path(pool_file)))


def test_pool_head_without_fingerprint_ranks_with_a_warning(pool_file):
    pool = _pool(pool_file)
    _write_own_head(pool_file, None, views="joint")
    r = Ranker.load(pool)
    assert r.head is not None and not r.notice
    assert "records no pool fingerprint" in r.warning and "memspec predictor train" in r.warning
    assert "\n" not in r.warning
