"""The import graph of the three packages: no circles, and no layer imports one above it.

Read from the source (``ast``), so it costs no imports and sees the imports
inside functions too: a lazy import still ties two modules, and a circle of
lazy imports is still a circle.

Layers, lowest first (``docs/design/layers.md``): ``attn_kernels`` and
``groupcomm`` import nothing of ``gpusolver`` (nor of each other); inside
``gpusolver`` a module may import its own layer or the ones below it. The
modules that tie the kernels and the collectives are the runtime, the CLI
(which drives the runtime) and ``gpusolver.errors``, which installs the error
sinks both report to.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attn_kernels", "groupcomm", "gpusolver")

# gpusolver's layers, lowest first: a module of layer i imports only layers <= i. A module is
# placed by its longest listed prefix ("gpusolver" itself is the package's __init__ only).
LAYERS = (
    ("gpusolver.limits", "gpusolver.problem", "gpusolver.nvtx", "gpusolver.support", "gpusolver.step_model",
     "gpusolver._flag_kernel", "gpusolver.transfers", "gpusolver.config", "gpusolver.topology",
     "gpusolver.capacity"),
    ("gpusolver.masks", "gpusolver.metrics"),
    ("gpusolver.plan",),
    ("gpusolver.errors", "gpusolver.areas", "gpusolver.baselines", "gpusolver.bounds"),
    ("gpusolver.solver",),
    ("gpusolver.assign", "gpusolver.ops"),
    ("gpusolver.sparse_solve", "gpusolver.solve", "gpusolver.sim"),
    ("gpusolver.runtime",),
    ("gpusolver.packing",),
    ("gpusolver.integrations",),
    ("gpusolver.viz", "gpusolver.cli", "gpusolver.__main__", "gpusolver"),
)
TIES = ("gpusolver.runtime", "gpusolver.cli", "gpusolver.errors")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that importing ``name`` loads (its longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(filter(None, (_resolve(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:  # ``from pkg import submodule`` imports the submodule
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _resolve(base)
                if target:
                    found.add(target)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(name: str) -> str:
    return name.partition(".")[0]


def _layer(name: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            inside = name == p or (p != "gpusolver" and name.startswith(p + "."))
            if inside and p.count(".") > depth:
                best, depth = i, p.count(".")
    if best is None:
        raise AssertionError(f"{name} is in no layer of tests/test_imports.py: place it in LAYERS")
    return best


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_graph_is_read():
    # the checks below mean something only if the walk finds the packages and their imports
    assert {"gpusolver.solve", "attn_kernels.flex_attn.op", "groupcomm._base"} <= set(GRAPH)
    assert "gpusolver.plan.meta" in GRAPH["gpusolver.plan.build"]
    assert "gpusolver.masks.validation" in GRAPH["gpusolver.masks.slices"]  # an import inside a method counts


def test_circles_are_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    circles = _circles(GRAPH)
    detail = "; ".join(" <-> ".join(c) for c in circles)
    assert not circles, f"import circles: {detail}"


@pytest.mark.parametrize("package", ["attn_kernels", "groupcomm"])
def test_lower_packages_import_nothing_of_ours(package):
    others = set(PACKAGES) - {package}
    bad = sorted((m, t) for m, ts in GRAPH.items() if _top(m) == package for t in ts if _top(t) in others)
    assert not bad, f"{package} must import nothing of {sorted(others)}: {bad}"


def test_no_layer_imports_a_higher_one():
    bad = sorted((m, t) for m, ts in GRAPH.items() if _top(m) == "gpusolver"
                 for t in ts if _top(t) == "gpusolver" and _layer(t) > _layer(m))
    assert not bad, "lower layers import higher ones (module, imported): " + ", ".join(map(str, bad))


def test_only_the_runtime_ties_kernels_and_collectives():
    tying = sorted(m for m, ts in GRAPH.items()
                   if {"attn_kernels", "groupcomm"} <= {_top(t) for t in ts} and _top(m) == "gpusolver")
    bad = [m for m in tying if not any(m == p or m.startswith(p + ".") for p in TIES)]
    assert not bad, f"only {TIES} may import both attn_kernels and groupcomm; also: {bad}"
