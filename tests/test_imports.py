"""The packages' import graph, read with ``ast`` (nothing is imported, so no import side effects): no cycles in
trials/ or orchestrator/, and trials/ (one trial, no Ray) never imports ray or orchestrator.

Every import counts, a function-level one or one under ``TYPE_CHECKING`` too: a lazy import that dodges a cycle
at run time is still a cycle in what each module needs to know of the other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trials", "orchestrator")


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__)."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).with_suffix("")
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


def imported(name: str, path: Path) -> set[str]:
    """Every absolute module name ``name``'s file imports (``from . import x`` yields the package and its x), with
    the packages that enclose each (Python runs their ``__init__`` first)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    # importing a.b.c runs a/__init__ and a/b/__init__ first: each enclosing package is imported too
    out.update(".".join(m.split(".")[:i]) for m in list(out) for i in range(2, m.count(".") + 1))
    return out


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Edges among the packages' own modules. A module's import of its own package (``from . import x`` in
    a child) is no edge: a package's __init__ importing its children is how packages are made."""
    return {m: {t for t in imported(m, f) if t in mods and t != m and not m.startswith(t + ".")}
            for m, f in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of two or more modules (Tarjan's, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
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
                    found.append(sorted(comp))
    return sorted(found)


def test_no_import_cycles():
    found = cycles(graph(modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_trials_imports_neither_ray_nor_orchestrator():
    bad = [f"{m} imports {t}" for m, f in modules(packages=("trials",)).items() for t in sorted(imported(m, f))
           if t.split(".")[0] in ("ray", "orchestrator")]
    assert not bad, "trials/ runs one trial without Ray or the driver:\n" + "\n".join(bad)


def test_the_walk_finds_a_cycle(tmp_path):
    """The checker itself: a function-level import that closes a loop is a cycle; a child importing its own
    package is not."""
    pkg = tmp_path / "trials"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from . import b\nfrom . import helper\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "helper.py").write_text("X = 1\n")
    mods = modules(tmp_path, ("trials",))
    assert cycles(graph(mods)) == [["trials.a", "trials.b"]]
