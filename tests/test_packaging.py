"""How memspec installs: where artefacts go (a checkout's ./models, else the user's cache),
the pinned model wheels, optional plotting, dependencies that fit Python 3.10 to 3.13, and
the commands that rewrite committed files refusing to run from an installed package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from memspec.common import paths, wheels
from memspec.launch.cli import main as cli

PYPROJECT = tomllib.loads((paths.PACKAGE_ROOT / "pyproject.toml").read_text())


def test_artefacts_go_to_memspec_home_else_the_checkout_else_the_users_cache(
        tmp_path, monkeypatch):
    monkeypatch.delenv("MEMSPEC_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.is_checkout() and paths.memspec_home() == paths.PACKAGE_ROOT / "models"
    monkeypatch.setattr(paths, "is_checkout", lambda root=paths.PACKAGE_ROOT: False)
    assert paths.memspec_home() == tmp_path / "home" / ".cache" / "memspec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.memspec_home() == tmp_path / "xdg" / "memspec"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # as the XDG spec says
    assert paths.memspec_home() == tmp_path / "home" / ".cache" / "memspec"
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "mine"))
    assert paths.memspec_home() == tmp_path / "mine"
    pool = paths.expand_path("$MEMSPEC_HOME/t", tmp_path)
    assert pool == tmp_path / "mine" / "t"
    assert not paths.is_checkout(tmp_path)  # an installed package has no pyproject.toml


def test_model_wheels_are_pinned_in_one_place_that_setup_reads():
    setup = (paths.PACKAGE_ROOT / "launch" / "setup.sh").read_text()
    assert "memspec.common.wheels" in setup
    for name in wheels.MODEL_WHEELS:
        assert name not in setup  # no second, unpinned spelling
    assert all(v.count(".") >= 1 for v in wheels.MODEL_WHEELS.values())
    res = subprocess.run([sys.executable, "-m", "memspec.common.wheels"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0
    installed = [n for n in wheels.MODEL_WHEELS if wheels.pin(n) not in res.stdout.split()]
    for name in installed:  # what is installed here is the pinned version
        from importlib.metadata import version

        assert version(name) == wheels.MODEL_WHEELS[name]


def test_dependencies_fit_every_supported_python_and_plots_are_an_extra():
    project = PYPROJECT["project"]
    deps = " ".join(project["dependencies"])
    assert "matplotlib" not in deps
    assert "tomli>=1.1; python_version < '3.11'" in project["dependencies"]
    torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert ">=" in torch and "<" in torch and "==" not in torch  # a range, never a pin
    extras = project["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    assert any(d.startswith("matplotlib") for d in extras["plots"])
    assert project["requires-python"] == ">=3.10"
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in project["classifiers"]


def test_plots_without_matplotlib_are_one_line_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from memspec.launch.cli import main; "
            f"sys.exit(main(['bench', 'soak', '--plots', {str(tmp_path)!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "memspec: error: plots need matplotlib, which is not installed; install it with "
        "pip install 'memspec[plots]', or run without --plots"]


@pytest.mark.parametrize("argv", [["zoo", "drafts"], ["predictor", "train"],
                                  ["zoo", "corpora", "--prompts"]])
def test_commands_that_rewrite_committed_files_need_a_checkout(argv, monkeypatch, capsys):
    monkeypatch.setattr(paths, "is_checkout", lambda root=paths.PACKAGE_ROOT: False)
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("it ran"))
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("memspec: error: `memspec ") and "installed package" in err
    assert err.count("\n") == 1


def test_the_packaged_files_include_what_an_install_runs():
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "*.sh" in data["memspec.launch"]  # zoo corpora runs install_corpus_sources.sh
    for pattern in data["memspec"]:
        assert list(paths.PACKAGE_ROOT.glob(pattern)), pattern
    assert Path(paths.PACKAGE_ROOT / "launch" / "install_corpus_sources.sh").is_file()
