"""Predictor head trainer: utility labels at scheduling points, the three input modes, and a
head that learns separable data but not shuffled labels. Synthetic data; no encoder."""

from __future__ import annotations

import torch

from memspec.procs.predictor.encoder import recent_text
from memspec.zoo.train_predictor import (
    JOIN,
    Data,
    EmbeddingCache,
    Example,
    ExampleSet,
    TrainConfig,
    build_examples,
    build_workspace,
    candidates,
    cfg_name,
    choose_config,
    composite_examples,
    composite_partners,
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


# --- composites and the choice of views ---------------------------------------------------
def test_composite_partners_are_of_another_domain_and_stable():
    domains = {f"{d}{i}": d for d in ("code", "math", "law") for i in range(4)}
    got = composite_partners(domains, seed=0)
    assert set(got) == set(domains)
    assert all(domains[p] != domains[q] for p, q in got.items())
    assert composite_partners(domains, seed=0) == got  # seeded
    assert composite_partners({**domains, "zz9": "law"}, seed=0)["code0"] == got["code0"]
    assert composite_partners({"a": "code", "b": "code"}, seed=0) == {}  # one domain: none


def test_composite_examples_keep_labels_and_join_prompts_in_both_orders():
    got = _build()  # trajectories a (code) and c (math): each the other's partner
    pr = got.modes["prompt_recent"]
    comp = composite_examples(pr, got.domains, seed=0)
    prompt = {e.prompt_id: e.prompt for e in pr}
    own = {"a": prompt["a"] + JOIN + prompt["c"], "c": prompt["c"] + JOIN + prompt["a"]}
    other = {"a": own["c"], "c": own["a"]}
    # every point under its own prompt first; with recent text also under the other first
    assert [(e.prompt_id, e.label, e.recent) for e in comp if e.prompt == own[e.prompt_id]] \
        == [(e.prompt_id, e.label, e.recent) for e in pr]
    assert [(e.prompt_id, e.label, e.recent) for e in comp if e.prompt == other[e.prompt_id]] \
        == [(e.prompt_id, e.label, e.recent) for e in pr if e.recent]
    assert len(comp) == len(pr) + sum(1 for e in pr if e.recent)
    assert composite_examples(got.modes["recent_only"], got.domains) == []  # no prompt


def test_candidates_offer_views_with_both_inputs_only_and_no_joint_composites():
    base = TrainConfig()
    names = lambda cs: {(c.views, c.augment) for c in cs}  # noqa: E731
    both = candidates("prompt_recent", base, ["plain"], [0], ["joint", "split"],
                      ["none", "composite"])
    assert names(both) == {("joint", "none"), ("split", "none"), ("split", "composite")}
    assert names(candidates("prompt_only", base, ["plain"], [0], ["joint", "split"],
                            ["none", "composite"])) == {("joint", "none"), ("joint", "composite")}
    assert names(candidates("recent_only", base, ["plain"], [0], ["split"], ["composite"])) \
        == {("joint", "none")}


class TextEncoder:
    """Prompt and recent words -> fixed random directions: a head can read both."""

    def __init__(self) -> None:
        self.vocab: dict[str, torch.Tensor] = {}

    def _vec(self, text: str) -> torch.Tensor:
        v = torch.zeros(384)
        for w in text.split():
            if w not in self.vocab:
                g = torch.Generator().manual_seed(len(self.vocab))
                self.vocab[w] = torch.randn(384, generator=g)
            v += self.vocab[w]
        return v

    def embed(self, prompts, recents):
        rows = [self._vec(p) + 0.3 * self._vec(r) for p, r in zip(prompts, recents)]
        return torch.nn.functional.normalize(torch.stack(rows) + 1e-3, dim=-1)


def _toy_set(prefix: str, n: int) -> tuple[dict, dict]:
    """n prompts per domain; the label is the domain of the recent words (always the
    prompt's own here, as in one-domain sets)."""
    examples, domains = [], {}
    for d, dom in enumerate(("code", "math", "law")):
        for i in range(n):
            pid = f"{prefix}-{dom}-{i}"
            domains[pid] = dom
            prompt = f"task{d} {prefix}{i} please"
            examples.append(Example(pid, d, prompt, ""))
            for j in range(3):
                examples.append(Example(pid, d, prompt, f"{dom}word{j} {dom}word{i % 3}"))
    return examples, domains


def test_choice_on_dev_scores_composites_and_split_views_read_recent_text(tmp_path):
    """On one-domain data the prompt alone decides; only dev composites (two-domain prompts)
    show whether a head reads the recent text. Candidates are scored on both, the best mean
    is chosen, and a split head reads composites far better than a joint one."""
    sets = {}
    for w, n in (("train", 12), ("dev", 6)):
        ex, dom = _toy_set(w, n)
        es = ExampleSet()
        es.modes["prompt_recent"], es.domains = ex, dom
        sets[w] = es
    grid = candidates("prompt_recent", TrainConfig(steps=150), ["plain"], [0],
                      ["joint", "split"], ["none", "composite"])
    ws = build_workspace(sets, ["train", "dev"], {"prompt_recent": grid}, 0,
                         EmbeddingCache(tmp_path), TextEncoder)
    best, scores = choose_config(["code", "math", "law"], ws, "prompt_recent", grid, ["train"])
    assert scores[cfg_name(best)]["score"] == max(v["score"] for v in scores.values())
    assert best.views == "split"
    split, joint = scores["split/composite/plain/0/150"], scores["joint/none/plain/0/150"]
    assert split["dev_composite"] > joint["dev_composite"] + 0.1
    assert split["score"] == round((split["dev"] + split["dev_composite"]) / 2, 4)


def test_an_early_stop_scored_in_a_run_is_the_head_a_shorter_run_ends_with():
    """Dev scores every early stop of one run (STEP_GRID): it must be the same head a run of
    that many steps trains, or the chosen steps would not reproduce."""
    centers = torch.nn.functional.normalize(
        torch.randn(len(NAMES), 384, generator=torch.Generator().manual_seed(4)), dim=-1)
    data = _blobs(120, 5, centers)
    seen = {}

    def probe(head, step):
        seen[step] = head(data.x, data.flags).detach().clone()
        assert not head.training

    for hidden in (0, 16):  # dropout in the MLP: its draws must not shift either
        seen.clear()
        fit_head(NAMES, data, TrainConfig(steps=100, hidden=hidden), probe=probe)
        assert sorted(seen) == [25, 50, 100]
        short, _ = fit_head(NAMES, data, TrainConfig(steps=50, hidden=hidden))
        assert torch.allclose(short(data.x, data.flags), seen[50])
