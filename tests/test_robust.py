"""Robustness in one process: weight manifests, the decoder's start checks (quarantine with
a one-line reason, the rest serve), request validation, the fallback ranking of a pool
without a trained head, and where `memspec predictor train --pool` puts its head."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import TINY_VOCAB, make_tiny, save_model

from memspec.common import manifest as mf
from memspec.common.config import check_sampling, parse_pool
from memspec.common.errors import ConfigError, ModelError, RequestError
from memspec.common.limits import check_request
from memspec.common.messages import Submit
from memspec.common.paths import DEFAULT_POOL
from memspec.launch.cli import main as cli
from memspec.procs.decoder.sched.acceptance import SamplingParams
from memspec.procs.decoder.service import open_drafts, verify_target
from memspec.procs.predictor import DEFAULT_HEAD, pool_head_path
from memspec.zoo.train_predictor import head_file


def corrupt(path: Path, offset: int, n: int = 64) -> None:
    """Flip `n` bytes in place: same size, same header, different tensor bytes."""
    raw = bytearray(path.read_bytes())
    raw[offset:offset + n] = bytes(b ^ 0xFF for b in raw[offset:offset + n])
    path.write_bytes(bytes(raw))


def middle_of_data(path: Path) -> int:
    entry = mf.weights_entry(path, path.name)
    return entry.data_offset + entry.data_size // 2


@pytest.fixture
def draft(tmp_path, tiny_dir) -> Path:
    out = tmp_path / "mine"
    shutil.copytree(tiny_dir / "small", out)
    return out


# --- manifests ---------------------------------------------------------------------------
def test_manifest_tiles_every_tensor_and_checks_clean(draft):
    doc = mf.build_manifest(draft)
    assert set(doc["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    man = mf.write_manifest(draft)
    assert man.name == mf.NAME and mf.check_folder(draft) == []
    entry = mf.read_manifest(draft).entry(draft / "model.safetensors")
    names = {r.name for r in entry.ranges}
    assert names == set(load_file(draft / "model.safetensors"))
    assert entry.ranges[0].start == 0 and entry.ranges[-1].end == entry.data_size


def test_same_size_corruption_is_named_by_tensor(draft):
    mf.write_manifest(draft)
    corrupt(draft / "model.safetensors", middle_of_data(draft / "model.safetensors"))
    problems = mf.check_folder(draft)
    assert len(problems) == 1 and "tensor '" in problems[0] and "differs from its manifest" \
        in problems[0]


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_range_verifier_any_chunking(draft, step):
    path = draft / "model.safetensors"
    entry = mf.weights_entry(path, path.name)
    data = path.read_bytes()[entry.data_offset:]
    check = mf.RangeVerifier(entry.ranges, "x")
    for pos in range(0, len(data), step):
        check.update(pos, data[pos:pos + step])
    assert check.complete
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 1
    check = mf.RangeVerifier(entry.ranges, "x")
    with pytest.raises(ModelError, match="differs from its manifest"):
        for pos in range(0, len(bad), step):
            check.update(pos, bytes(bad[pos:pos + step]))


def test_manifest_command_writes_and_checks(draft, capsys):
    assert cli(["manifest", str(draft)]) == 0
    assert (draft / mf.NAME).is_file()
    assert cli(["manifest", "--check", str(draft)]) == 0
    (draft / "config.json").write_text((draft / "config.json").read_text() + " ")
    assert cli(["manifest", "--check", str(draft)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memspec: error: ") and "config.json" in err[0]


def test_malformed_manifest_is_a_one_line_error(draft):
    (draft / mf.NAME).write_text("{not json")
    with pytest.raises(ModelError, match="not a valid manifest.*memspec manifest"):
        mf.read_manifest(draft)


def test_target_is_hashed_once_per_change(draft, tmp_path, monkeypatch):
    mf.write_manifest(draft)
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "home"))
    calls = []
    real = mf.verify_section
    monkeypatch.setattr(mf, "verify_section", lambda *a: calls.append(a) or real(*a))
    verify_target(draft)
    verify_target(draft)
    assert len(calls) == 1  # the stamp of an unchanged file spares the second read
    corrupt(draft / "model.safetensors", middle_of_data(draft / "model.safetensors"))
    with pytest.raises(ModelError, match="differs from its manifest"):
        verify_target(draft)


def test_target_conversion_writes_a_manifest(tmp_path, monkeypatch):
    from memspec.zoo import target

    monkeypatch.setattr(target, "find_gguf", lambda: tmp_path / "fake.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"")
    monkeypatch.setattr(target, "_gguf_special_tokens", lambda _p: {"eos_token": "<|im_end|>"})

    def fake_convert(_g: Path, dest: Path, *_a: object) -> dict:
        save_file({"w": torch.ones(4, 4)}, dest / target.WEIGHTS_NAME)
        (dest / "config.json").write_text("{}")
        return {"version": target.MARKER_VERSION, "files": {target.WEIGHTS_NAME: 1}}

    monkeypatch.setattr(target, "_convert_into", fake_convert)
    out = target.convert_target(tmp_path / "t", progress=False)
    man = mf.read_manifest(out)
    assert man is not None and target.MARKER_NAME in man.files
    assert mf.check_folder(out) == []


# --- the decoder's start checks ----------------------------------------------------------
def _pool(tmp: Path, tiny_dir: Path, drafts: dict[str, Path]):
    return parse_pool({"pool": {"target": str(tiny_dir / "target")},
                       "drafts": [{"name": n, "path": str(p)} for n, p in drafts.items()]},
                      tmp)


def test_bad_drafts_are_quarantined_at_start_and_the_rest_kept(tmp_path, tiny_dir):
    folders = {}
    for name in ("good", "corrupt", "truncated", "smallvocab"):
        folders[name] = tmp_path / name
        shutil.copytree(tiny_dir / "self", folders[name])
    for name in ("good", "corrupt", "truncated"):
        mf.write_manifest(folders[name])
    weights = folders["corrupt"] / "model.safetensors"
    corrupt(weights, middle_of_data(weights))
    raw = (folders["truncated"] / "model.safetensors").read_bytes()
    (folders["truncated"] / "model.safetensors").write_bytes(raw[:len(raw) // 2])
    shutil.rmtree(folders["smallvocab"])
    save_model(make_tiny(5, vocab=48, layers=1), folders["smallvocab"])  # no id map

    files, quarantined = open_drafts(_pool(tmp_path, tiny_dir, folders), TINY_VOCAB)
    assert set(files) == {"good"}
    assert set(quarantined) == {"corrupt", "truncated", "smallvocab"}
    assert "differs from its manifest" in quarantined["corrupt"]
    assert "truncated" in quarantined["truncated"]
    assert ("vocabulary of 48 tokens, the target 96, and no id map"
            in quarantined["smallvocab"])
    assert all("\n" not in r for r in quarantined.values())
    assert [r.name for r in files["good"].entry.ranges] == \
        [r.name for r in mf.read_manifest(folders["good"]).entry(
            folders["good"] / "model.safetensors").ranges]


def test_draft_without_manifest_is_measured_at_start(tmp_path, tiny_dir, caplog):
    files, quarantined = open_drafts(_pool(tmp_path, tiny_dir, {"g": tiny_dir / "self"}),
                                     TINY_VOCAB)
    assert quarantined == {} and files["g"].entry.ranges
    said = [r for r in caplog.records if "has no manifest.json" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"  # the decoder's log, once


# --- one place that checks a request ------------------------------------------------------
@pytest.mark.parametrize("kw, needle", [
    ({"temperature": math.nan}, "temperature = nan is not a finite number"),
    ({"temperature": -1.0}, "temperature -1.0 is negative"),
    ({"top_p": math.inf}, "top_p = inf is not a finite number"),
    ({"top_p": 0.0}, "top_p 0.0 is outside"),
    ({"seed": -3}, "seed -3 is not an integer"),
    ({"seed": 2**64}, "seed .* is not an integer"),
    ({"ucb_c": math.nan}, "ucb_c = nan is not a finite number"),
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"max_new_tokens": -1}, "max_new_tokens -1 is negative"),
    ({"prompt": ""}, "empty prompt"),
])
def test_every_bad_request_field_is_one_line(kw, needle):
    req = Submit(**{"req_id": "r", "prompt": "hi", **kw})
    with pytest.raises(RequestError, match=needle) as got:
        check_request(req)
    assert "\n" not in str(got.value)
    check_request(Submit(req_id="r", prompt="hi", temperature=0.7, top_p=0.9, seed=2**64 - 1))


def test_sampling_params_use_the_same_check():
    with pytest.raises(RequestError, match="not a finite number"):
        SamplingParams(math.nan)
    with pytest.raises(RequestError, match="not a finite number"):
        check_sampling(0.5, math.nan, None)


def test_generate_with_nan_temperature_is_one_line_before_anything_starts():
    res = subprocess.run([sys.executable, "-m", "memspec", "submit", "--endpoint",
                          "ipc:///nonexistent/x.sock", "--temperature", "nan", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "memspec: error: temperature = nan is not a finite number; give temperature a number"]


# --- a pool without a trained head --------------------------------------------------------
def test_pool_head_goes_beside_the_pool_never_over_the_committed_one(tmp_path):
    pool = tmp_path / "mine.toml"
    assert head_file(pool, None) == pool_head_path(pool) == tmp_path / "mine.head.safetensors"
    assert head_file(None, None) == DEFAULT_HEAD
    assert head_file(DEFAULT_POOL, None) == DEFAULT_POOL.with_name("pool.head.safetensors")
    assert head_file(DEFAULT_POOL, DEFAULT_HEAD.parent) == DEFAULT_HEAD  # the project's own
    with pytest.raises(ConfigError, match="would replace the committed"):
        head_file(pool, DEFAULT_HEAD.parent)
    assert head_file(pool, tmp_path / "h") == tmp_path / "h" / "head.safetensors"


@pytest.fixture(scope="module")
def ranker_pool(tmp_path_factory, tiny_dir):
    from memspec.procs.predictor.encoder import encoder_available

    if not encoder_available():
        pytest.skip("all-MiniLM-L6-v2 wheel missing")
    root = tmp_path_factory.mktemp("rank")
    toml = root / "mine.toml"
    toml.write_text(f'''[pool]
target = "{tiny_dir / 'target'}"
[[drafts]]
name = "coder"
domain = "code"
path = "{tiny_dir / 'self'}"
[[drafts]]
name = "doctor"
path = "{tiny_dir / 'small'}"
description = "medicine: diseases, symptoms and their treatment"
''')
    from memspec.common.config import load_pool

    return load_pool(toml)


def test_fallback_ranks_by_description_and_says_so(ranker_pool):
    from memspec.procs.predictor.ranker import Ranker

    torch.set_num_threads(1)
    r = Ranker.load(ranker_pool)
    assert r.head is None and "ranking by similarity" in r.notice
    assert "memspec predictor train --pool" in r.notice and "\n" not in r.notice
    (code, med), _ = r.rank(["Write a Python function that sorts a list.",
                             "What are the symptoms of measles and how is it treated?"],
                            [[], []])
    assert code[0] > code[1] and med[1] > med[0]
    assert abs(sum(code) - 1) < 1e-5


def test_fallback_without_encoder_is_uniform(ranker_pool, monkeypatch):
    from memspec.procs.predictor import ranker as ranker_mod

    def missing(*_a, **_k):
        raise ModelError("the all-MiniLM-L6-v2 encoder is not installed", "pip install it")

    monkeypatch.setattr(ranker_mod, "Encoder", missing)
    r = ranker_mod.Ranker.load(ranker_pool)
    assert "every draft ranks equally" in r.notice
    assert r.rank(["x"], [[1, 2]])[0] == [[0.5, 0.5]]


def test_a_head_named_in_the_pool_must_fit(ranker_pool, tmp_path):
    from dataclasses import replace

    from memspec.procs.predictor.ranker import Ranker

    with pytest.raises(ModelError, match="predictor head ranks drafts"):
        Ranker.load(replace(ranker_pool, predictor_head=DEFAULT_HEAD))


def test_status_shows_quarantined_in_one_line(monkeypatch, capsys):
    from memspec.common.messages import ProcStatus, Status
    from memspec.launch import client

    st = Status(procs={"decoder": ProcStatus(pid=1, state="ready")}, slots=[],
                quarantined={"beta": "draft 'beta': tensor 'w' differs from its manifest"})
    monkeypatch.setattr(client, "status", lambda _ep, _timeouts=None: st)
    assert cli(["status", "--endpoint", "ipc:///x"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ('quarantined: {"beta": "draft \'beta\': tensor \'w\' differs from its '
                       'manifest"}')
    assert cli(["status", "--endpoint", "ipc:///x", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined"] == st.quarantined


def test_in_process_loads_are_checked_too(draft):
    from memspec.procs.decoder.inprocess import check_slot
    from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

    mf.write_manifest(draft)
    slot = SlotBuffer(1 << 20)
    load_into_slot("mine", draft, slot, TINY_VOCAB)
    check_slot("mine", draft, slot)
    corrupt(draft / "model.safetensors", middle_of_data(draft / "model.safetensors"))
    load_into_slot("mine", draft, slot, TINY_VOCAB)
    with pytest.raises(ModelError, match="draft 'mine': tensor .* differs from its manifest"):
        check_slot("mine", draft, slot)
    assert slot.draft is None


def test_a_model_card_edit_does_not_quarantine(draft, tmp_path, tiny_dir):
    (draft / "README.md").write_text("# my draft\n")
    mf.write_manifest(draft)
    (draft / "README.md").write_text("# my draft, better described\n")
    files, quarantined = open_drafts(_pool(tmp_path, tiny_dir, {"d": draft}), TINY_VOCAB)
    assert quarantined == {} and "d" in files
    assert "README.md" in mf.check_folder(draft)[0]  # the full check still sees it
