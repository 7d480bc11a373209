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
    ("schemes", ("positions",)),
    ("model and configuration", ("model", "config")),
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
