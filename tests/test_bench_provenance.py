"""What a bench result says about where it came from: the commit and a clean tree, the
machine, kernel path, tuned knobs and pool, the
predictor head its Table 2 and its runs used, and caches that never outlive their pool or
code (the real runs' key, the cost model, the pinned pool)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from memspec.bench.evaluation import _cost_model, calibrated_dir, predictor_metrics
from memspec.bench.realruns import pool_copy, run_fingerprint
from memspec.common.config import load_pool
from memspec.common.paths import PACKAGE_ROOT
from memspec.common.plotting import save_outputs
from memspec.common.provenance import provenance, result_provenance
from memspec.procs.predictor.head import FORMAT
from memspec.sim.costmodel import CostModel


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def test_provenance_names_the_commit_and_whether_the_tree_was_clean(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("built/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / "built").mkdir()
    (tmp_path / "built" / "model.bin").write_bytes(b"ignored by git")
    assert provenance(tmp_path) == {"commit": head, "clean": True, "dirty_files": 0}
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")
    got = provenance(tmp_path)
    assert got["commit"] == head and got["clean"] is False and got["dirty_files"] == 2
    bare = provenance(tmp_path / "built")  # inside the checkout: still identified
    assert bare["commit"] == head
    nowhere = tmp_path.parent / f"{tmp_path.name}-not-git"
    nowhere.mkdir()
    assert provenance(nowhere)["commit"] is None and provenance(nowhere)["clean"] is None


def _pool_with_head(tmp_path: Path, head: Path) -> str:
    """The default pool (paths absolute) ranking with `head`."""
    return pool_copy(None, tmp_path / "pool.toml",
                     {"bandwidth_mb_s": "3.5", "predictor_head": f'"{head}"'})


def _head(path: Path, weights: bytes, **info: object) -> Path:
    path.write_bytes(weights)
    path.with_suffix(".json").write_text(json.dumps({"format": FORMAT, **info}))
    return path


def test_a_retrained_head_is_a_new_real_run_key(tmp_path):
    head = _head(tmp_path / "h.safetensors", b"weights one")
    pool = _pool_with_head(tmp_path, head)
    before = run_fingerprint(pool)
    assert run_fingerprint(pool) == before
    head.write_bytes(b"weights two")
    assert run_fingerprint(pool) != before


def test_table_2_is_of_the_head_the_pool_ranks_with(tmp_path):
    evaluation = {s: {"prompt_recent": {"top1": 0.61, "top2": 0.9, "n": 12}}
                  for s in ("dev2", "mixed")}
    pool_path = _pool_with_head(tmp_path, tmp_path / "h.safetensors")
    pool = load_pool(pool_path, check=False)
    from memspec.procs.decoder.oracle.tablefiles import pool_fingerprint

    _head(tmp_path / "h.safetensors", b"w", train_set="train,dev", evaluation=evaluation,
          pool_fingerprint=pool_fingerprint(pool))
    got = predictor_metrics(pool)
    assert got["mixed"]["prompt_recent"]["top1"] == 0.61  # not the committed head's figures
    assert got["dev2"]["prompt_recent"]["n"] == 12
    assert got["head"] == "h.safetensors"  # outside the checkout: its name only
    assert got["head_for_this_pool"] is True
    assert got["head_pool_fingerprint"] == got["pool_fingerprint"]
    _head(tmp_path / "h.safetensors", b"w", evaluation=evaluation,
          pool_fingerprint={"general": "another draft"})
    assert predictor_metrics(pool)["head_for_this_pool"] is False
    _head(tmp_path / "h.safetensors", b"w", evaluation=evaluation)
    assert predictor_metrics(pool)["head_for_this_pool"] is None  # the sidecar does not say
    # a sidecar from before the rename measured dev2 under its old name, "test"
    old = {("test" if s == "dev2" else s): v for s, v in evaluation.items()}
    _head(tmp_path / "h.safetensors", b"w", evaluation=old)
    assert predictor_metrics(pool)["dev2"]["prompt_recent"]["top1"] == 0.61
    committed = predictor_metrics(load_pool(None, check=False))
    assert committed.get("head", "").startswith("predictor/") or "note" in committed
    assert "note" in committed or committed["dev2"]  # predictor/head.json still says "test"


def test_the_cost_model_and_pool_copy_are_never_another_pools(tmp_path):
    home = tmp_path / "bench"
    home.mkdir()
    stale = home / "pool-pinned.toml"  # where an older bench left one, for any pool
    stale.write_text("[pool]\n")
    cost = CostModel(spec_s={"general": 0.09}, target_s=0.04, catchup_base_s=0.002,
                     catchup_per_token_s=1e-5, load_s={"general": 0.24}, predict_s=0.02,
                     snapshot_s=0.0002, sched_s=0.001, mean_iteration_s=0.09)
    cost_file = tmp_path / "cost.json"
    cost_file.write_text(json.dumps({"cost": cost.to_json()}))
    pool = load_pool(None, check=False)
    _, real_pool = _cost_model(pool, None, home, False, cost_file, 64)
    assert real_pool != str(stale)
    keyed = calibrated_dir(home, None)
    assert keyed != calibrated_dir(home, str(PACKAGE_ROOT / "pools" / "small-models.toml"))
    keyed.mkdir(parents=True)
    (keyed / "pool-pinned.toml").write_text(stale.read_text())
    _, real_pool = _cost_model(pool, None, home, False, cost_file, 64)
    assert real_pool == str(keyed / "pool-pinned.toml")


def test_a_result_names_its_isa_tuned_knobs_and_pool(tmp_path, monkeypatch):
    """Two results of one commit differ when the tuned file, a draft's bytes or the kernel
    path did: each of those is in the JSON, and a bench's own record is kept."""
    from memspec.common import isa

    got = result_provenance()
    assert got["isa"] == isa.chosen_isa() and got["isa_native"] == isa.native_isa()
    assert got["tuned"]["file"] == "tuned.json" and len(got["tuned"]["sha256"]) == 16
    assert got["pool"]["file"] == "pool.toml" and len(got["pool"]["drafts_sha256"]) == 16
    assert got["commit"] == provenance()["commit"]
    other = tmp_path / "tuned.json"
    other.write_text((PACKAGE_ROOT / "tuned.json").read_text().replace('"split"', '"split" ', 1))
    monkeypatch.setenv("MEMSPEC_TUNED", str(other))
    assert result_provenance(uses_pool=False)["tuned"]["sha256"] != got["tuned"]["sha256"]
    assert "pool" not in result_provenance(uses_pool=False)
    head = _head(tmp_path / "h.safetensors", b"w")
    moved = tmp_path / "moved"
    moved.mkdir()
    pool = load_pool(_pool_with_head(moved, head), check=False)
    assert result_provenance(pool)["pool"]["sha256"] != got["pool"]["sha256"]  # another file
    missing = result_provenance(tmp_path / "no-such-pool.toml")["pool"]
    assert missing["sha256"] is None and "not found" in missing["error"]  # said, not raised

    class Args:
        json = str(tmp_path / "r.json")
        plots = None
        pool = None

    save_outputs({"provenance": {"commit": "abc", "clean": True}, "x": 1}, Args(), None)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["x"] == 1 and saved["provenance"]["commit"] == "abc"  # the bench's own
    assert saved["provenance"]["tuned"]["sha256"] and saved["provenance"]["pool"]["file"]
