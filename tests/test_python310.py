"""memspec under Python 3.10 (JetPack 6 and Ubuntu 22.04 ship it; pyproject says >= 3.10):
the README's job, in process and few tokens, run by a python3.10 that has torch and this
checkout installed (`PYTHON=python3.10 bash launch/setup.sh`), token for token what this
interpreter decodes. Skipped, with the reason, where there is no such interpreter;
`MEMSPEC_PYTHON310` names one that is not on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_pipeline import _ready_pool

from memspec.common.paths import PACKAGE_ROOT

PROMPT = "Write a Python function that returns the factorial of n."
ARGS = ["generate", "--in-process", "--policy", "target-only", "--max-new-tokens", "8",
        "--json", PROMPT]
PROBE = ("import sys, torch, memspec.common.paths as p; "
         "print(sys.version_info[:2] == (3, 10), p.PACKAGE_ROOT)")


def _candidates() -> list[str]:
    """Where launch/setup.sh looks too: $MEMSPEC_PYTHON310, python3.10 on PATH (a pyenv
    shim there may name no installed version), then pyenv's own 3.10 installs."""
    named = os.environ.get("MEMSPEC_PYTHON310")
    if named:
        return [named]
    found = [shutil.which("python3.10")]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found += sorted(str(p) for p in root.glob("versions/3.10*/bin/python3.10"))
    return [f for f in found if f]


def _probe(exe: str) -> str | None:
    """None when ``exe`` is a Python 3.10 with torch and this checkout; else why not."""
    try:
        res = subprocess.run([exe, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{exe} does not run ({exc})"
    if res.returncode != 0:
        lines = [x.strip() for x in res.stderr.splitlines() if x.strip()] or ["no output"]
        why = next((x for x in reversed(lines) if "Error" in x), lines[0])[:200]
        return (f"{exe} cannot import torch and memspec ({why}); set it up with "
                f"PYTHON={exe} bash launch/setup.sh")
    is310, root = res.stdout.split(maxsplit=1)
    if is310 != "True":
        return f"{exe} is not Python 3.10"
    if root.strip() != str(PACKAGE_ROOT):
        return f"{exe} imports memspec from {root.strip()}, not this checkout"
    return None


def _runs_310(exe: str) -> bool:
    try:
        return subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _python310() -> str:
    """The first Python 3.10 candidate that can run the job, or pytest.skip with why the
    first one cannot."""
    found = _candidates()
    real = [exe for exe in found if _runs_310(exe)]
    if not real:
        pytest.skip(f"no Python 3.10 among {found or 'PATH and pyenv'} "
                    "(set MEMSPEC_PYTHON310 to one)")
    reasons = []
    for exe in real:
        why = _probe(exe)
        if why is None:
            return exe
        reasons.append(why)
    pytest.skip(reasons[0])


def _generate(exe: str) -> dict:
    res = subprocess.run([exe, "-m", "memspec", *ARGS], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE_ROOT.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


@pytest.mark.slow
def test_the_main_job_runs_under_python_310_token_for_token():
    exe = _python310()
    _ready_pool()
    old = _generate(exe)
    assert len(old["token_ids"]) == 8 and old["text"].strip()
    assert old["stats"]["policy"] == "target-only"
    here = _generate(sys.executable)
    assert old["token_ids"] == here["token_ids"], (old["text"], here["text"])


LIGHT_CHECK = """
import compileall, re, sys
import memspec
root = memspec.__path__[0]
assert compileall.compile_dir(root, quiet=2, rx=re.compile(r"/(models|build|tests)/")), "syntax"
import memspec.common.config as config, memspec.common.limits, memspec.common.isa
import memspec.common.messages as m, memspec.common.logs, memspec.common.child
import memspec.procs.decoder.sched.gate, memspec.procs.decoder.sched.policies, memspec.procs.decoder.sched.loop
pool = config.load_pool(check=False)
sub = m.Submit(req_id="r1", prompt="hi", policy="memspec")
assert m.CLIENT_REQUESTS.decode(m.encode(sub)) == sub
print(sys.version_info[:2], pool.policy, len(pool.drafts))
"""


def test_the_core_imports_and_parses_under_python_310(tmp_path):
    """Every module byte-compiles under 3.10, and those that need no torch import and work:
    the pool config (tomllib is 3.11+: tomli on 3.10), the request limits, the kernel-path
    choice, the messages, the scheduling loop and its policies. In the light environment
    `bash launch/setup.sh --dev` makes where a python3.10 is installed (CI included)."""
    from memspec.common.paths import memspec_home

    exe = memspec_home() / "py310-light" / "bin" / "python"
    if not exe.is_file():
        pytest.skip(f"no Python 3.10 light environment at {exe.parent.parent} (made by "
                    "`bash launch/setup.sh --dev` where python3.10 is installed)")
    link = tmp_path / "memspec"
    link.symlink_to(PACKAGE_ROOT, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run([str(exe), "-c", LIGHT_CHECK], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("(3, 10)")
