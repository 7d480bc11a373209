"""The API reference (``python3 dev.py docs``, built by ``docs/build_api.py`` with pdoc) builds,
and documents every public name of every public module (the definition is in that script's
docstring; modules added later are found in the source tree, not listed here)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build_api():  # docs/ is not a package: load the script by path
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_api = _build_api()


def test_public_names_follow_the_definition(tmp_path: Path) -> None:
    """``__all__`` wins; without it, the module's own top-level definitions, not imports."""
    package = tmp_path / "copejax"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text('__all__ = ["b", "A"]\nfrom os import path\n')
    (package / "sub" / "_hidden.py").write_text("def f(): pass\n")
    (package / "sub" / "mod.py").write_text(
        "import os\nfrom os import sep\nX, _Y = 1, 2\nZ: int = 3\n"
        "def f(): pass\nclass C: pass\ndef _g(): pass\nif X:\n    W = 4\n"
    )
    original = (build_api.ROOT, build_api.PACKAGE)
    build_api.ROOT, build_api.PACKAGE = tmp_path, package
    try:
        assert build_api.public_modules() == ["copejax", "copejax.sub", "copejax.sub.mod"]
        assert build_api.public_names("copejax.sub") == ["b", "A"]
        assert build_api.public_names("copejax.sub.mod") == ["C", "X", "Z", "f"]
    finally:
        build_api.ROOT, build_api.PACKAGE = original


def test_the_reference_builds_and_covers_every_public_name(tmp_path: Path) -> None:
    # Built in its own interpreter, as `python3 dev.py docs` does: pdoc imports every module,
    # and in a test worker that has already imported a program defining the same absl flags
    # (experiments.demo and copejax.main both define --workdir) the import fails.
    subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build_api.py"), str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    modules = build_api.public_modules()
    assert {"copejax", "copejax.ops.engine", "copejax.model.param_paths"} <= set(modules)
    assert (tmp_path / "index.html").exists()
    missing = []
    for module in modules:
        page = build_api.page_of(tmp_path, module)
        if not page.exists():
            missing.append(f"{module}: no page {page.relative_to(tmp_path)}")
            continue
        anchors = set(re.findall(r'id="([^"]+)"', page.read_text(encoding="utf-8")))
        for name in build_api.public_names(module):  # a submodule in __all__ has its own page
            if name not in anchors and not build_api.page_of(tmp_path, f"{module}.{name}").exists():
                missing.append(f"{module}.{name}")
    assert not missing, "undocumented public names:\n  " + "\n  ".join(missing)
    private = [p for p in tmp_path.rglob("_*.html")]
    assert not private, f"private modules documented: {private}"
