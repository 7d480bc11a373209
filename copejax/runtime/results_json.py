"""Results files in strict JSON: every program's results go through :func:`write_json`.

Python's json writes ``NaN`` and ``Infinity`` by default, which strict parsers reject; a
scheme that cannot run a length, or a diverged seed, is written as null instead.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def json_safe(tree: Any) -> Any:
    """``tree`` with every non-finite float as None and tuples as lists."""
    if isinstance(tree, dict):
        return {key: json_safe(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [json_safe(value) for value in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Writes ``data`` as indented strict JSON (non-finite numbers as null)."""
    Path(path).write_text(json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n")
