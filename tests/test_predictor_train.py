"""Predictor head trainer: utility labels at scheduling points, the three input modes, and a
head that learns separable data but not shuffled labels. Synthetic data; no encoder."""

from __future__ import annotations

import torch

from memspec.procs.predictor.encoder import recent_text
from memspec.zoo.train_predictor import (
    Data,
    EmbeddingCache,
    Example,
    TrainConfig,
    build_examples,
    domain_rule,
    fit_head,
    main,
    majority_baseline,
    scheduling_labels,
    topk_metrics,
)

NAMES = ["general", "code", "math"]
GAMMA = 4


class WordTokenizer:
    """Token 0 is a space (whitespace-only windows), others a word each."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(" " if i == 0 else f"w{i} " for i in ids)


def _rows() -> tuple[dict, dict, dict]:
    """a: code best; b: every draft equal (all ties); c: math best, blank window at p = 8;
    d: no prompt text. Tables are constant per draft."""
    trajs = {"a": {"tokens": list(range(1, 41))}, "b": {"tokens": list(range(1, 17))},
             "c": {"tokens": [0] * 8 + list(range(9, 41))}, "d": {"tokens": [1, 2, 3]}}

    def row(domain, n, general, code, math):
        return {"domain": domain, "length": n,
                "tables": {"general": [general] * n, "code": [code] * n, "math": [math] * n}}

    tables = {"a": row("code", 40, 1, 4, 0), "b": row("general", 16, 2, 2, 2),
              "c": row("math", 40, 0, 1, 3), "d": row("law", 3, 0, 1, 3)}
    prompts = {"a": "write code", "b": "say hi", "c": "solve x"}
    return trajs, tables, prompts


def _build(every: int = 8, T: int = 3):
    trajs, tables, prompts = _rows()
    tok = WordTokenizer()
    return build_examples(trajs, prompts, tables, NAMES, lambda ids: recent_text(tok, ids, T),
                          GAMMA, 4, every)


def test_scheduling_labels_positions_and_ties():
    _, tables, _ = _rows()
    # a at p = 32: general catches code up (both reach the end): a top tie keeps pool order
    assert scheduling_labels(tables["a"]["tables"], NAMES, 40, GAMMA, 4, 8) == (
        [(0, 1), (8, 1), (16, 1), (24, 1), (32, 0)], 0)
    # a at p = 36: every draft reaches the end within the interval: an exact tie, skipped
    assert scheduling_labels(tables["a"]["tables"], NAMES, 40, GAMMA, 4, 4)[1] == 1
    assert scheduling_labels(tables["b"]["tables"], NAMES, 16, GAMMA, 4, 3) == ([], 6)
    # c at p = 32: math and code both reach the end, general does not
    assert scheduling_labels(tables["c"]["tables"], NAMES, 40, GAMMA, 4, 8) == (
        [(0, 2), (8, 2), (16, 2), (24, 2), (32, 1)], 0)
    # a draft that is better only beyond the first interval still breaks the tie
    late = {"general": [0] * 40, "code": [0] * 4 + [4] * 36, "math": [0] * 40}
    assert scheduling_labels(late, NAMES, 40, GAMMA, 2, 40) == ([(0, 1)], 0)


def test_examples_three_modes_and_what_is_dropped():
    got = _build()
    assert got.trajectories == 3 and got.missing == ["d"]
    assert got.ties == 2 and got.positions == 10
    po, ro, pr = (got.modes[m] for m in ("prompt_only", "recent_only", "prompt_recent"))
    assert [(e.prompt_id, e.label) for e in pr] == (
        [("a", 1)] * 4 + [("a", 0)] + [("c", 2)] * 4 + [("c", 1)])
    assert all(e.recent == "" for e in po) and [e.prompt for e in po] == [e.prompt for e in pr]
    assert pr[0] == Example("a", 1, "write code", "")  # p = 0: prompt+recent == prompt-only
    assert pr[1].recent == "w6 w7 w8 " and pr[3].recent == "w22 w23 w24 "  # T = 3 window
    assert pr[6].recent == ""  # c at p = 8: three spaces count as no text
    assert pr[7].recent == "w14 w15 w16 "
    # recent-only: no prompt, no p = 0, nothing for the blank window
    assert [(e.prompt_id, e.prompt) for e in ro] == [("a", "")] * 4 + [("c", "")] * 3
    assert [e.recent for e in ro] == [e.recent for e in pr if e.recent]
    assert got.blank_recent == 1
    assert got.label_counts(NAMES) == {"general": 1, "code": 5, "math": 4}
    assert got.domains == {"a": "code", "b": "general", "c": "math"}
    rule = domain_rule(pr, got.domains, {"general": 0, "code": 1, "math": 2}, [0])
    assert rule == {"top1": 0.8, "top2": 0.9, "n": 10}  # a at p = 32 is labelled general
    # a mixed prompt ranks its listed domains in answer order
    mixed = domain_rule(pr, {"a": ["math", "code"], "c": ["math", "code"]},
                        {"general": 0, "code": 1, "math": 2}, [0])
    assert mixed == {"top1": 0.4, "top2": 0.9, "n": 10}


def test_stride_and_window_change_inputs():
    got = _build(every=4, T=32)
    assert [e.prompt_id for e in got.modes["prompt_only"]].count("a") == 9  # 0..32; 36 ties
    assert got.modes["prompt_recent"][1].recent == "w1 w2 w3 w4 "


class FakeEncoder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def embed(self, prompts, recents):
        self.seen += list(zip(prompts, recents))
        return torch.stack([torch.full((384,), float(len(p) + 10 * len(r)))
                            for p, r in zip(prompts, recents)])


def test_embedding_cache_embeds_each_input_once(tmp_path):
    got = _build()
    examples = got.modes["prompt_only"] + got.modes["prompt_recent"]
    enc = FakeEncoder()
    emb = EmbeddingCache(tmp_path).embed(enc, examples)
    assert emb.shape == (len(examples), 384)
    assert len(enc.seen) == len(set(enc.seen)) == 9  # 2 prompts + 7 windows
    again = EmbeddingCache(tmp_path).embed(None, examples)  # from disk, no encoder
    assert torch.equal(emb, again)


def _blobs(n: int, seed: int, centers: torch.Tensor) -> Data:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % len(centers)
    x = torch.nn.functional.normalize(centers[y] + 0.08 * torch.randn(n, 384, generator=g), dim=-1)
    flags = torch.randint(0, 2, (n,), generator=g)
    return Data(x, flags, y, tuple(f"p{i}" for i in range(n)))


def test_head_learns_separable_data_but_not_shuffled_labels():
    centers = torch.nn.functional.normalize(
        torch.randn(len(NAMES) + 2, 384, generator=torch.Generator().manual_seed(0)), dim=-1)
    names = [*NAMES, "law", "medical"]
    train, held = _blobs(400, 1, centers), _blobs(400, 2, centers)
    cfg = TrainConfig(steps=150, seed=0)
    head, _ = fit_head(names, train, cfg)
    good = topk_metrics(head, held)
    assert good["top1"] > 0.9 and good["top2"] >= good["top1"] and good["n"] == 400
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(3))
    shuffled = Data(train.x, train.flags, train.y[perm], train.ids)
    control, _ = fit_head(names, shuffled, cfg)
    assert topk_metrics(control, held)["top1"] < 0.45
    # same seed, same head
    again, _ = fit_head(names, train, cfg)
    assert torch.equal(again.net[-1].weight, head.net[-1].weight)


def test_majority_baseline_ranks_by_training_frequency():
    y_train = torch.tensor([2, 2, 2, 0, 0, 1])
    held = Data(torch.zeros(4, 384), torch.zeros(4, dtype=torch.long),
                torch.tensor([2, 0, 1, 2]), ("a", "b", "c", "d"))
    got = majority_baseline(NAMES, y_train, held)
    assert got["ranking"] == ["math", "general", "code"]
    assert (got["top1"], got["top2"]) == (0.5, 0.75)


def test_missing_tables_is_one_line_error(tmp_path, monkeypatch, capsys):
    from memspec.common.paths import default_target_dir

    real = default_target_dir()
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path))
    has_target = (real / "config.json").is_file()
    if has_target:  # the target is there, its traces are not
        (tmp_path / real.name).symlink_to(real)
    assert main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    fix = "memspec trace" if has_target else "config.json"
    assert len(err) == 1 and fix in err[0]
    assert not (tmp_path / "out").exists()
