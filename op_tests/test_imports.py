"""The package's import graph: no circles, and no import from a lower layer into a higher one.

Every ``import`` / ``from ... import`` of every module of ``amdqb`` (module level and inside
functions: a lazy import is still a dependency) is an edge between modules; a name imported from
a package is an edge to the package's ``__init__`` unless it is a submodule. Layers, lowest
first (a module may import its own layer and the layers below; a package ``__init__`` belongs to
the layer of the package's modules):
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "amdqb"

# (layer, module prefixes): the first prefix a module starts with gives its layer.
LAYERS = [
    ("architecture rules", ("amdqb._arch",)),  # standard library only (setup.py loads it by path)
    ("contract", ("amdqb.backends.calls", "amdqb.backends")),
    ("configs", ("amdqb.configs",)),
    ("devices", ("amdqb.devices",)),
    ("oracles", ("amdqb.ref",)),
    ("kernels", ("amdqb.backends.",)),
    ("dispatch", ("amdqb.dispatch",)),
    ("registration", ("amdqb._library",)),
    ("ops", ("amdqb.ops",)),
    ("api", ("amdqb.balance", "amdqb.serving", "amdqb.compat", "amdqb")),
    ("tools", ("amdqb.demo", "amdqb.bench", "amdqb._cli_types")),
    ("command line", ("amdqb.cli", "amdqb.__main__")),
]
__doc__ += "\n".join(f"    {i}. {name}: {', '.join(p)}" for i, (name, p) in enumerate(LAYERS))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact = module == prefix or module.startswith(prefix + ".")
            if prefix.endswith("."):
                exact = module.startswith(prefix)
            if exact and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} has no layer"
    return best[0]


def _resolve(module: str, path: Path, node) -> list[str]:
    """The amdqb modules one import statement depends on."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        names = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            names.append(sub if sub in MODULES else base)
    out = []
    for name in names:
        while name and name not in MODULES:  # "import amdqb.x.y" names a module
            name = name.rpartition(".")[0]
        if name.startswith("amdqb"):
            out.append(name)
    return out


def edges() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_resolve(module, path, node))
        deps.discard(module)
        graph[module] = deps
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_init_edge(a: str, b: str) -> bool:
    """A package ``__init__`` importing its own submodules (and they it) is how a package
    collects its names, not a circle of the design."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_circles():
    graph = {m: {d for d in deps if not _package_init_edge(m, d)} for m, deps in edges().items()}
    assert _cycles(graph) == []


def test_no_import_runs_up_the_layers():
    upward = [
        f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
        for m, deps in sorted(edges().items())
        for d in sorted(deps)
        if layer(d) > layer(m)
    ]
    assert upward == []


@pytest.mark.parametrize(
    "planted",
    [
        ("amdqb.configs", "amdqb.dispatch"),  # an upward import
        ("amdqb.ref.router", "amdqb.ops.router"),
    ],
)
def test_the_checks_catch_a_planted_import(planted):
    src, dst = planted
    graph = edges()
    graph[src] = graph[src] | {dst}
    assert layer(dst) > layer(src)
    graph[dst] = graph[dst] | {src}
    assert any(src in c and dst in c for c in _cycles(graph))
