"""The package's shape holds: no import circle anywhere (function-local imports counted),
no module reaching into another's private names, the scheduling core free of the forward
and the drafts, and the decoder's top level kept to its process shell."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"models", "tests", ".git", ".venv", "build"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT)
        if SKIP & set(rel.parts[:-1]) or any(part.startswith(".") for part in rel.parts):
            continue
        name = ".".join(("memspec", *rel.with_suffix("").parts))
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the package's modules it imports (anywhere in it), and every
    `from A import _name` of one module from another."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memspec"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in mods else node.module
                    if target in mods and target != m:
                        edges[m].add(target)
                    if a.name.startswith("_") and full not in mods and node.module != m:
                        private.append(f"{m}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods and a.name != m)
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_anywhere_in_the_package():
    edges, _ = _imports(_modules())
    assert _cycles(edges) == []


def test_a_cycle_is_found_where_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_private_names():
    _, private = _imports(_modules())
    assert private == []


def test_the_scheduling_core_never_imports_the_forward_or_the_drafts():
    edges, _ = _imports(_modules())
    sched = "memspec.procs.decoder.sched"
    bad = [(m, t) for m, ts in edges.items() if m.startswith(sched) for t in ts
           if t.startswith(("memspec.procs.decoder.forward", "memspec.procs.decoder.drafts"))]
    assert bad == []


def test_the_decoders_top_level_is_its_process_shell():
    top = sorted(p.name for p in (ROOT / "procs" / "decoder").glob("*.py"))
    assert len(top) <= 12, top
    for role in ("forward", "drafts", "sched", "oracle"):
        assert (ROOT / "procs" / "decoder" / role / "__init__.py").is_file()
