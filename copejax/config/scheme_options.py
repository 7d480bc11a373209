"""A position scheme's options as config keys: which exist, their values from text, and checks.

Every field of a scheme's dataclass (``copejax/positions/<scheme>.py``) is an option that
``model.position_options`` may hold; a composite (``cope+rope``) takes the options of all its
parts. Two spellings set one from the command line, both resolved here:

    --config=configs/lm.py:smoke,position=cope,p_max=8               (a config argument)
    --config=configs/lm.py:smoke --config.model.position_options.p_max=8

ml_collections cannot override a key that the config does not hold yet (the options start
empty), so ``copejax.main`` takes ``--config.model.position_options.<key>=<value>`` off the
command line and sets it with :func:`set_option` after the config is loaded.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import ml_collections

from copejax.config.command_line import did_you_mean
from copejax.positions import registry

OVERRIDE_PREFIX = "config.model.position_options."


def scheme_defaults(position: str) -> dict[str, Any]:
    """Option name -> default of every part of ``position`` (``"cope+rope"`` joins parts).

    Raises:
      ValueError: an unknown scheme name (listing the known ones).
    """
    defaults: dict[str, Any] = {}
    for part in position.split("+"):
        for field in dataclasses.fields(registry.get(part)):
            defaults.setdefault(field.name, field.default)
    return defaults


def every_option() -> dict[str, list[str]]:
    """Option name -> the schemes that declare it, over the whole registry."""
    owners: dict[str, list[str]] = {}
    for name in registry.names():
        for field in dataclasses.fields(registry.get(name)):
            owners.setdefault(field.name, []).append(name)
    return owners


def parse_value(text: str) -> Any:
    """A command-line value: Python literals (``8``, ``0.5``, ``None``, ``(1, 2)``),
    ``true``/``false`` in any case, anything else kept as the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def coerce(value: Any, default: Any) -> Any:
    """``value`` in the type of the option's default where that is unambiguous: an int for a
    float option becomes a float, the string ``"None"`` becomes None."""
    if value == "None":
        return None
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check(position: str, options: dict[str, Any]) -> None:
    """Raises ValueError when ``options`` holds a key that scheme ``position`` does not take.

    The message names the key, suggests the closest allowed option and lists all of them with
    their defaults.
    """
    defaults = scheme_defaults(position)
    for key in options:
        if key not in defaults:
            listed = ", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "none"
            raise ValueError(
                f"position scheme {position!r} has no option {key!r}"
                f"{did_you_mean(key, list(defaults)) or '.'} Its options (defaults): {listed}"
            )


def set_option(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """Sets ``config.model.position_options[key]``, checked against ``config.model.position``.

    Raises:
      ValueError: the scheme has no such option (see :func:`check`).
    """
    position = config.model.position
    check(position, {key: value})
    value = coerce(value, scheme_defaults(position)[key])
    options = config.model.position_options
    with options.unlocked():  # config_flags locks the config it loads
        if key in options:
            # ConfigDict keeps a key's type; replacing the entry lets e.g. None become a string.
            del options[key]
        options[key] = value


def split_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Takes ``--config.model.position_options.<key>=<value>`` out of ``argv``.

    Returns the other arguments and the (key, raw value) pairs in command-line order.

    Raises:
      ValueError: such an argument without ``=<value>`` or with a dotted key.
    """
    kept, options = [], []
    for arg in argv:
        name, sep, raw = arg.lstrip("-").partition("=")
        if not (arg.startswith("-") and name.startswith(OVERRIDE_PREFIX)):
            kept.append(arg)
            continue
        key = name.removeprefix(OVERRIDE_PREFIX)
        if not sep or not key or "." in key:
            raise ValueError(f"expected --{OVERRIDE_PREFIX}<key>=<value>, got {arg!r}")
        options.append((key, raw))
    return kept, options
