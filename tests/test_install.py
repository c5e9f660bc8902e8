"""A plain (non-editable) `pip install .` into a fresh virtual environment: `memspec zoo
target` and `memspec generate` run from an unrelated directory, build their artefacts in
the user's cache (common/paths.py) and write nothing under site-packages, whose memspec
folder is made read-only. The environment reuses this interpreter's packages
(`--system-site-packages`, `--no-index`), so nothing is downloaded; the wheel is built
from a copy of the checkout, so the checkout gets no build/ folder. About two minutes."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_pipeline import _ready_pool

from memspec.common.paths import PACKAGE_ROOT

PROMPT = "Write a Python function that returns the factorial of n."
COPY_IGNORE = shutil.ignore_patterns("models", ".git", "build", "dist", "*.egg-info",
                                     "__pycache__", ".pytest_cache", ".ruff_cache", ".venv")


def _run(cmd: list[str | Path], timeout: float, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         timeout=timeout, **kw)
    assert res.returncode == 0, f"{cmd[:4]}: {res.stderr[-3000:]}{_logs(res.stderr)}"
    return res


def _logs(stderr: str) -> str:
    """The tails of the processes' logs a failed run names (a start that hung says where)."""
    m = re.search(r"see the logs in (\S+)", stderr)
    if not m:
        return ""
    return "".join(f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace")
                                                      .splitlines()[-25:])
                   for log in sorted(Path(m.group(1)).glob("*.log")))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime: what a write would change (the
    tests run as root, which a read-only mode does not stop)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns)
    return out


def _read_only(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames + [""]:
            p = os.path.join(dirpath, name)
            os.chmod(p, os.lstat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.mark.slow
def test_pip_install_runs_from_anywhere_and_writes_only_the_users_cache(tmp_path):
    _ready_pool()  # the model wheels are installed here (the venv sees them)
    src, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    shutil.copytree(PACKAGE_ROOT, src, ignore=COPY_IGNORE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
          "--no-index", "-q", "-w", dist, src], 300)
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], 120)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "-q",
          *dist.glob("memspec-*.whl")], 300)
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     60).stdout.strip())
    pkg = site / "memspec"
    assert (pkg / "pool.toml").is_file() and not (pkg / "pyproject.toml").exists()
    assert (pkg / "tuned.json").is_file()  # the knobs the runtime reads
    _read_only(pkg)
    before = _tree(venv)

    home, work = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEMSPEC_HOME", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(HOME=str(home), PATH=f"{venv / 'bin'}:{env['PATH']}",
               PYTHONDONTWRITEBYTECODE="1",  # Python's own caches are not memspec's writes
               MEMSPEC_NATIVE="0")  # the C++ build would add minutes; its home is the same
    where = _run([py, "-c", "import memspec, memspec.common.paths as p; "
                  "print(memspec.__file__); print(p.memspec_home())"], 60, env=env, cwd=work)
    module, artefacts = where.stdout.split()
    assert Path(module).is_relative_to(pkg) and Path(artefacts) == home / ".cache" / "memspec"

    _run([venv / "bin" / "memspec", "zoo", "target"], 600, env=env, cwd=work)
    out = _run([venv / "bin" / "memspec", "generate", "--json", "--max-new-tokens", "8",
                PROMPT], 600, env=env, cwd=work)
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 8 and result["text"].strip()
    assert (home / ".cache" / "memspec" / "smollm2-135m-instruct" / "model.safetensors").is_file()
    assert _tree(venv) == before  # nothing written under the environment, site-packages included
    assert sorted(p.name for p in work.iterdir()) == []  # nor where it ran
