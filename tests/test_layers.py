"""The layering rules, checked on the source: every import statement, also inside functions.

- the runtime (common/, procs/) never imports the offline side (zoo/, sim/, bench/);
- the scheduling loop and the pure logic the simulator shares with the runtime import no
  torch, no ZeroMQ and no clock, so the very same code runs on a simulated clock.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memspec.common.paths import PACKAGE_ROOT

RUNTIME = ("common", "procs")
OFFLINE = ("memspec.zoo", "memspec.sim", "memspec.bench")
PURE = ("procs/decoder/sched/loop.py", "procs/decoder/sched/policies.py", "procs/decoder/sched/cache_manager.py",
        "procs/decoder/sched/residency.py", "procs/decoder/oracle/replay.py", "common/metrics.py",
        "common/messages.py")
IMPURE = ("torch", "zmq", "time", "socket", "transformers", "threading", "asyncio")


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE_ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["memspec", *parts])


def imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    module = module or _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out += [(node.lineno, f"{base}.{a.name}" if base else a.name) for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", "")) in ("import_module", "__import__"):
            out += [(node.lineno, a.value) for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def _files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (PACKAGE_ROOT / f).rglob("*.py"))


def test_the_runtime_imports_nothing_from_the_offline_side():
    bad = [f"{p.relative_to(PACKAGE_ROOT)}:{line} imports {mod}"
           for p in _files(*RUNTIME) for line, mod in imports(p)
           if mod.startswith(OFFLINE)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("rel", PURE)
def test_shared_logic_is_free_of_models_sockets_and_clocks(rel):
    bad = [f"{rel}:{line} imports {mod}" for line, mod in imports(PACKAGE_ROOT / rel)
           if mod.split(".")[0] in IMPURE]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_function_local_and_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n"
                     "def f():\n    from memspec.sim import simulate\n"
                     "    from ...zoo import tables\n    from memspec import bench\n"
                     "    import importlib\n    importlib.import_module('memspec.bench.report')\n")
    found = sorted(m for _, m in imports(probe, "memspec.procs.decoder.probe"))
    assert found == ["importlib", "memspec.bench", "memspec.bench.report",
                     "memspec.sim.simulate", "memspec.zoo.tables", "os"]
    assert [m for m in found if m.startswith(OFFLINE)] == found[1:5]
