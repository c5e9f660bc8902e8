"""Bad pool files fail at start with one line naming the field and the fix."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tinymodels import fake_tokenizer_json

from memspec.common.config import load_pool, parse_pool
from memspec.common.errors import ConfigError

BASE = {"pool": {"target": "target"},
        "drafts": [{"name": "general", "path": "self"}, {"name": "code", "path": "small"}]}


def pool_file(tmp: Path, tiny_dir: Path, text: str) -> Path:
    for name in ("target", "self", "random", "small"):
        if not (tmp / name).exists():
            shutil.copytree(tiny_dir / name, tmp / name)
    p = tmp / "pool.toml"
    p.write_text(text)
    return p


GOOD = """
[pool]
target = "target"
K = 2
gamma = 4
policy = "general-static"

[[drafts]]
name = "general"
path = "self"

[[drafts]]
name = "code"
path = "small"
"""


def test_good_pool_loads(tmp_path, tiny_dir):
    pool = load_pool(pool_file(tmp_path, tiny_dir, GOOD))
    assert [d.name for d in pool.drafts] == ["general", "code"]
    assert pool.target == (tmp_path / "target").resolve()
    assert pool.general_draft.path == (tmp_path / "self").resolve()


def test_embedded_default_pool_parses():
    pool = load_pool(None, check=False)
    assert {d.domain for d in pool.drafts} == {"general", "code", "math", "law", "medical"}
    assert (pool.K, pool.gamma, pool.N) == (2, 4, 4)


@pytest.mark.parametrize("edit, needle", [
    ({"K": 0}, "pool.K = 0 is below 1"),
    ({"gamma": 0}, "pool.gamma = 0 is below 1"),
    ({"gamma": "four"}, "pool.gamma must be an integer"),
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"storage": "floppy"}, "unknown storage 'floppy'"),
    ({"colour": 1}, "unknown field pool.colour"),
    ({"general": "nope"}, "pool.general = 'nope' names no draft"),
    ({"rank_horizon": -1}, "pool.rank_horizon = -1 is below 0"),
    ({"rank_horizon": 1.5}, "pool.rank_horizon must be an integer"),
])
def test_bad_fields_name_the_field(edit, needle):
    data = json.loads(json.dumps(BASE))
    data["pool"].update(edit)
    with pytest.raises(ConfigError) as err:
        parse_pool(data, Path("."))
    msg = str(err.value)
    assert needle in msg and ";" in msg and "\n" not in msg  # problem; fix — one line


def test_a_pool_sets_its_own_ranking_horizon_or_takes_the_tuned_one():
    from memspec.procs.decoder.sched.gate import SpecGate

    assert parse_pool(BASE, Path(".")).rank_horizon is None  # the tuned gate.RANK_HORIZON
    data = json.loads(json.dumps(BASE))
    data["pool"]["rank_horizon"] = 64
    assert parse_pool(data, Path(".")).rank_horizon == 64
    assert SpecGate(None, rank_horizon=64).horizon == 64
    assert SpecGate(None).horizon == SpecGate.RANK_HORIZON


def test_duplicate_and_missing_draft_fields():
    data = json.loads(json.dumps(BASE))
    data["drafts"].append({"name": "general", "path": "x"})
    with pytest.raises(ConfigError, match="used twice"):
        parse_pool(data, Path("."))
    data["drafts"] = [{"name": "general"}]
    with pytest.raises(ConfigError, match=r"drafts\[0\].path is missing"):
        parse_pool(data, Path("."))
    with pytest.raises(ConfigError, match="pool.target is missing"):
        parse_pool({"pool": {}}, Path("."))


def test_missing_paths_and_tokenizer_mismatch(tmp_path, tiny_dir):
    p = pool_file(tmp_path, tiny_dir, GOOD.replace('path = "small"', 'path = "nowhere"'))
    with pytest.raises(ConfigError, match="draft 'code' not found at .*nowhere"):
        load_pool(p)
    p.write_text(GOOD.replace('target = "target"', 'target = "gone"'))
    with pytest.raises(ConfigError, match="target model not found"):
        load_pool(p)
    p.write_text(GOOD)
    (tmp_path / "small" / "tokenizer.json").write_text(json.dumps(fake_tokenizer_json(50)))
    with pytest.raises(ConfigError, match="different tokenizer than the target"):
        load_pool(p)
    with pytest.raises(ConfigError, match="not found"):
        load_pool(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("[pool\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_pool(tmp_path / "broken.toml")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memspec.launch.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_one_line_errors(tmp_path, tiny_dir):
    p = pool_file(tmp_path, tiny_dir, GOOD.replace("K = 2", "K = 0"))
    res = run_cli("generate", "--pool", str(p), "hello")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "pool.K = 0 is below 1; set K >= 1" in res.stderr
    res = run_cli("generate", "--pool", str(tmp_path / "absent.toml"), "hello")
    assert res.returncode == 2 and "pool file" in res.stderr and "Traceback" not in res.stderr


def test_memory_budget_derives_k_or_fails_clearly():
    from memspec.common.memory import slots_for_budget

    assert slots_for_budget(20, 8 << 20, 5) == 2
    assert slots_for_budget(1000, 8 << 20, 5) == 5
    with pytest.raises(ConfigError, match="too small for one draft slot"):
        slots_for_budget(4, 8 << 20, 5)


def test_draft_without_tokenizer_files_uses_recorded_fingerprint(tmp_path, tiny_dir):
    from memspec.common.config import tokenizer_fingerprint

    p = pool_file(tmp_path, tiny_dir, GOOD)
    cfg_path = tmp_path / "small" / "config.json"
    (tmp_path / "small" / "tokenizer.json").unlink()
    cfg = json.loads(cfg_path.read_text())
    cfg["memspec_tokenizer_sha256"] = tokenizer_fingerprint(tmp_path / "target")
    cfg_path.write_text(json.dumps(cfg))
    assert load_pool(p).draft("code").path == (tmp_path / "small").resolve()
    cfg["memspec_tokenizer_sha256"] = "0" * 64
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="different tokenizer than the target"):
        load_pool(p)


def test_draft_kind_is_validated_against_the_folder(tmp_path, tiny_dir):
    from tinymodels import make_tiny_head

    data = json.loads(json.dumps(BASE))
    data["drafts"][0]["kind"] = "adapter"
    with pytest.raises(ConfigError, match="draft 'general' has unknown kind 'adapter'"):
        parse_pool(data, Path("."))
    assert parse_pool(BASE, Path(".")).drafts[0].kind == "model"  # the default
    p = pool_file(tmp_path, tiny_dir, GOOD)
    make_tiny_head(tmp_path / "head", seed=1)
    p.write_text(GOOD.replace('path = "small"', 'path = "head"'))
    with pytest.raises(ConfigError) as err:  # a head folder left at the default kind
        load_pool(p)
    msg = str(err.value)
    assert "draft 'code' is kind = \"model\"" in msg and "holds a head" in msg
    assert "set kind = \"head\"" in msg and "\n" not in msg
    p.write_text(GOOD.replace('path = "small"', 'path = "head"\nkind = "head"'))
    assert load_pool(p).draft("code").kind == "head"
    p.write_text(GOOD.replace('path = "small"', 'path = "small"\nkind = "head"'))
    with pytest.raises(ConfigError, match="draft 'code' is kind = \"head\" .* holds a model"):
        load_pool(p)
