"""The registry from scheme name to scheme class, and the one constructor used by the model."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from copejax.positions.base import PositionScheme

_REGISTRY: dict[str, type[PositionScheme]] = {}


def register(cls: type[PositionScheme]) -> type[PositionScheme]:
    """Class decorator: registers a scheme under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"position scheme {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """All registered scheme names, sorted."""
    _load_all()
    return sorted(_REGISTRY)


def get(name: str) -> type[PositionScheme]:
    """The scheme class registered as ``name``; a ValueError lists the known names."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown position scheme {name!r}; known schemes: {', '.join(names())}")
    return _REGISTRY[name]


def option_names(cls: type[PositionScheme]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def make_scheme(name: str, options: Mapping[str, Any] | None = None) -> PositionScheme:
    """Builds the scheme ``name`` with ``options``.

    ``name`` may join several schemes with ``+`` (``"cope+rope"``): their sites are applied in
    order (qk transforms chained, biases summed). Each option goes to the part that declares it;
    an option declared by no part, or by several, is an error.
    """
    options = dict(options or {})
    parts = name.split("+")
    if len(parts) > 1:
        from copejax.positions.composite import Composite

        classes = [get(part) for part in parts]
        per_part: list[dict[str, Any]] = [{} for _ in parts]
        for key, value in options.items():
            owners = [i for i, cls in enumerate(classes) if key in option_names(cls)]
            if len(owners) != 1:
                where = "no part" if not owners else "several parts"
                raise ValueError(
                    f"option {key!r} of {name!r} is declared by {where}; options per part: "
                    + "; ".join(
                        f"{p}: {option_names(c)}" for p, c in zip(parts, classes, strict=True)
                    )
                )
            per_part[owners[0]][key] = value
        return Composite(parts=tuple(_build(c, o) for c, o in zip(classes, per_part, strict=True)))
    return _build(get(name), options)


def _build(cls: type[PositionScheme], options: dict[str, Any]) -> PositionScheme:
    allowed = option_names(cls)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for position scheme {cls.name!r}; allowed: {allowed}"
        )
    return cls(**options)


@functools.cache
def _load_all() -> None:
    """Imports every module of ``copejax.positions`` so that each registers its schemes."""
    import importlib
    import pkgutil

    # The folder, not the package object: the package imports this module.
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not info.name.startswith("_"):
            importlib.import_module(f"copejax.positions.{info.name}")
