"""No import circle among pydflash's modules (pydflash/ and the converters, pydflash.convert), read from the source
with `ast`: every import counts, also one inside a function (it still ties the two modules together); an import
under `if TYPE_CHECKING:` does not (it never runs)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
PACKAGES = {"pydflash": ROOT / "pydflash", "pydflash.convert": ROOT / "convert"}


def modules() -> dict[str, Path]:
    """module name -> source file."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _runtime_imports(tree: ast.AST):
    """Import nodes that can run: those under `if TYPE_CHECKING:` left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The pydflash modules `name` imports."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = set()
    for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        out |= {t for t in targets if t in known and t != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, result = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_no_import_circle():
    found = modules()
    graph = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    # a package's __init__ importing its own submodules lazily is not a circle a reader has to untangle
    for package in PACKAGES:
        graph[package] = {m for m in graph.get(package, set()) if not m.startswith(package + ".")}
    assert len(found) > 20 and graph["pydflash.server"]  # the modules were found and read
    circles = [" <-> ".join(c) + ": " + "; ".join(f"{m} imports {', '.join(sorted(graph[m] & set(c)))}" for m in c)
               for c in cycles(graph)]
    assert not circles, "\n".join(circles)
