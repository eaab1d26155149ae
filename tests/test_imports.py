"""Layers point one way: pallas_kernels <- models <- aither_jax <- serving, with no cycles.

Every import of every project file is read from its syntax tree (imports inside functions
too, since a lazy import is still a dependency), and three rules are checked:
1. no package imports one above it in that order (the one exception: `aither_jax.serve`, the
   documented `python -m aither_jax.serve` entry point, hands over to the server);
2. the graph of packages is acyclic: a subpackage (aither_jax.core, aither_jax.kv, ...) is one
   node, a module directly in a top-level package is a node of its own;
3. the graph of files inside each package is acyclic.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "models", "aither_jax", "serving")
ALLOWED_UPWARD = {("aither_jax.serve", "serving")}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    return {module_name(p, root): p for layer in LAYERS for p in sorted((root / layer).rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules `name` imports (a `from package import module` names the module)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def node_of(module: str, modules: set[str]) -> str:
    """A module's node in the package graph: its package if that is a subpackage of a layer,
    else the module itself."""
    package = module if any(m.startswith(module + ".") for m in modules) else module.rpartition(".")[0]
    return package if package.count(".") >= 1 else module


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def violations(root: pathlib.Path) -> list[str]:
    edges = graph(root)
    found = []
    for src, targets in edges.items():
        for dst in targets:
            up = LAYERS.index(dst.split(".")[0]) > LAYERS.index(src.split(".")[0])
            if up and (src, dst.split(".")[0]) not in ALLOWED_UPWARD:
                found.append(f"upward import: {src} imports {dst}")
    names = set(edges)
    packages: dict[str, set[str]] = {}
    for src, targets in edges.items():
        a = node_of(src, names)
        packages.setdefault(a, set()).update(b for b in (node_of(t, names) for t in targets) if b != a)
    if cycle := find_cycle(packages):
        found.append("circular imports between packages: " + " -> ".join(cycle))
    for package in {m.rpartition(".")[0] for m in names}:
        inside = {
            m: {t for t in edges[m] if t.rpartition(".")[0] == package}
            for m in names
            if m.rpartition(".")[0] == package
        }
        if cycle := find_cycle(inside):
            found.append(f"circular imports between files of {package}: " + " -> ".join(cycle))
    return found


def test_layers_point_one_way():
    assert violations(ROOT) == []


def write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for layer in LAYERS:
        (root / layer).mkdir(exist_ok=True)
        (root / layer / "__init__.py").touch()
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"models/a.py": "def f():\n    from serving import api\n", "serving/api.py": ""}, "upward import: models.a"),
        ({"aither_jax/x.py": "import serving.api\n", "serving/api.py": ""}, "upward import: aither_jax.x"),
        (
            {
                "aither_jax/core/__init__.py": "",
                "aither_jax/core/e.py": "from aither_jax.kv import store\n",
                "aither_jax/kv/__init__.py": "",
                "aither_jax/kv/store.py": "from aither_jax.core.e import X\n",
            },
            "between packages",
        ),
        ({"models/a.py": "from models import b\n", "models/b.py": "from . import a\n"}, "between files of models"),
    ],
)
def test_the_check_finds_what_it_forbids(tmp_path, files, expected):
    found = violations(write(tmp_path, files))
    assert any(expected in v for v in found), found


def test_the_documented_entry_point_may_hand_over_to_the_server(tmp_path):
    files = {"aither_jax/serve.py": "from serving import api\n", "serving/api.py": "from aither_jax import llm\n"}
    files["aither_jax/llm.py"] = ""
    assert violations(write(tmp_path, files)) == []
