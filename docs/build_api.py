"""Builds copejax's API reference with pdoc into ``docs/api/`` (git-ignored).

    python3 dev.py docs            # runs this script in .venv: docs/api/index.html
    .venv/bin/python docs/build_api.py OUT_DIR

What the reference must cover (``tests/test_api_reference.py`` checks every name):

- the *public modules*: every module of the ``copejax`` package whose dotted name has no part
  starting with an underscore (``copejax.data._corpora`` is private; ``__main__`` is out);
- a public module's *public names*: its ``__all__`` when it defines one; otherwise every name
  its own source binds at the top level with ``def``, ``class`` or an assignment (not the
  names it imports), except those starting with an underscore.

Each public module gets a page (``copejax/ops/engine.html``) and each public name an anchor
on it (``#blockwise_attention``). Docstrings are read in the Google style that copejax uses.
"""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "copejax"
PRIVATE_MODULES = r"!.*\._"  # pdoc's exclusion pattern: any dotted part starting with "_"


def public_modules() -> list[str]:
    """Dotted names of the public modules, read from the source tree (nothing imported)."""
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(part.startswith("_") for part in parts):
            modules.append(".".join(parts))
    return modules


def source_of(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def public_names(module: str) -> list[str]:
    """``module``'s ``__all__``, or the public names its source binds at the top level."""
    tree = ast.parse(source_of(module).read_text(encoding="utf-8"))
    names: list[str] = []
    declared = None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Name) and element.id == "__all__":
                        declared = [str(name) for name in ast.literal_eval(node.value)]
                    elif isinstance(element, ast.Name):
                        names.append(element.id)
    if declared is not None:
        return declared
    return sorted({name for name in names if not name.startswith("_")})


def page_of(out_dir: Path, module: str) -> Path:
    """The HTML page pdoc writes for ``module``."""
    return out_dir.joinpath(*module.split(".")).with_suffix(".html")


def build(out_dir: Path) -> list[str]:
    """Writes the reference into ``out_dir``; returns the public modules it documents.

    pdoc walks a package's submodules unless the package's ``__all__`` leaves them out
    (``copejax``, ``copejax.positions``); those are named to it one by one.
    """
    import pdoc
    import pdoc.extract

    modules = public_modules()
    specs, reached = [], set()
    for module in modules:
        if module not in reached:
            specs.append(module)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reached |= set(pdoc.extract.walk_specs([module]))
    pdoc.render.configure(docformat="google", show_source=False)
    pdoc.pdoc(*specs, PRIVATE_MODULES, output_directory=out_dir)
    return modules


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "api"
    built = build(target)
    print(f"API reference of {len(built)} modules: {target / 'index.html'}")
