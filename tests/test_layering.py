"""The package's layering (README, "Layout"): no module imports one from a layer above it.

Every module of ``copejax`` must be placed in ``LAYERS``; a new module fails this test until it
is, so the layering is decided when the module is written, not discovered later.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "copejax"

# Bottom to top. A module may import from its own layer and the layers below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("ops", "runtime", "data")),
    ("schemes", ("positions", "terms")),
    ("model and configuration", ("model", "config", "linen", "functional")),
    ("training", ("training",)),
    ("evaluation and interop", ("evaluation", "interop")),
    (
        "programs",
        (
            "main",
            "interop.convert",
            "evaluation.extrapolate",
            "evaluation.sample",
            "plots",
            "positions.__main__",
        ),
    ),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of ``module`` (dotted, without ``copejax.``): its longest listed prefix."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imported_modules(path: Path) -> set[str]:
    """The copejax modules ``path`` imports (``from copejax.x import y`` counts as x.y when
    x/y is a module, else as x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("copejax"):
            base = node.module.removeprefix("copejax").lstrip(".")
            for alias in node.names:
                candidate = f"{base}.{alias.name}".lstrip(".")
                as_path = PACKAGE / candidate.replace(".", "/")
                is_module = as_path.with_suffix(".py").exists() or as_path.is_dir()
                found.add(candidate if is_module else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("copejax."):
                    found.add(alias.name.removeprefix("copejax."))
    return {m for m in found if m}


def test_every_module_has_a_layer() -> None:
    unplaced = [
        module_name(p)
        for p in sorted(PACKAGE.rglob("*.py"))
        if module_name(p) and layer_of(module_name(p)) < 0
    ]
    assert not unplaced, f"place these modules in tests/test_layering.py LAYERS: {unplaced}"


def test_no_module_imports_from_a_layer_above() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if not name:
            continue
        for imported in sorted(imported_modules(path)):
            if layer_of(imported) > layer_of(name):
                upward.append(
                    f"{name} ({LAYERS[layer_of(name)][0]}) imports {imported} "
                    f"({LAYERS[layer_of(imported)][0]})"
                )
    assert not upward, "\n".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a foundations module importing the model is caught."""
    fake = tmp_path / "fake.py"
    fake.write_text(
        "from copejax.model.transformer import Transformer\nfrom copejax.ops import segments\n"
    )
    assert imported_modules(fake) == {"model.transformer", "ops.segments"}
    assert layer_of("model.transformer") > layer_of("ops.segments") == 0


# ----- import circles: copejax/ and experiments/ each form a graph without cycles -----

ROOT = PACKAGE.parent
GRAPH_PACKAGES = ("copejax", "experiments")


def modules_under(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (a folder of ``root``)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``modules`` (an imported attribute of a
    module counts as that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``path`` (module ``name``) imports anywhere in it: at
    the top, inside functions, under ``if TYPE_CHECKING``, absolute or relative."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else _known(base, modules))
    return {m for m in found if m is not None and m != name}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = modules_under(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's
    algorithm): each is a set of modules that import each other round a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def _edges_within(graph: dict[str, set[str]], cycle: list[str]) -> str:
    return "; ".join(f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle)


def test_no_import_cycles() -> None:
    """No module of copejax/ or of experiments/ imports, directly or through others, a module
    that imports it back (at any depth of the file: a function-level import counts)."""
    found = []
    for package in GRAPH_PACKAGES:
        graph = import_graph(ROOT, package)
        assert len(graph) > 10, f"the walk found only {sorted(graph)} in {package}/"
        for cycle in import_cycles(graph):
            found.append(f"{package}: {cycle} ({_edges_within(graph, cycle)})")
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_cycle_checker_sees_a_fabricated_circle(tmp_path: Path) -> None:
    """The checker itself: a circle through a function-level, a relative and a ``from
    package import module`` import is found and named; the same package without the
    closing import has none."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from .c import helper\nimport os\n")
    (package / "sub" / "c.py").write_text("def helper():\n    from pkg import a\n")
    (package / "d.py").write_text("import pkg.a\nfrom pkg.sub.b import thing\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a", "pkg.sub.b"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    (package / "sub" / "c.py").write_text("def helper():\n    import json\n")
    assert import_cycles(import_graph(tmp_path, "pkg")) == []


# ----- small files: every module of copejax/ and experiments/ under MAX_LINES lines -----

MAX_LINES = 400


def test_modules_stay_small() -> None:
    """House style (../shared/STYLE.md, nanodo): one idea per file, every file under 400
    lines; a module that grows past it is split by concern, not given a pass here."""
    offenders = []
    for package in GRAPH_PACKAGES:
        for path in modules_under(ROOT, package).values():
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines >= MAX_LINES:
                offenders.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not offenders, f"modules of {MAX_LINES} lines or more:\n" + "\n".join(offenders)
