"""The ``--config`` flag of ``copejax.main``: absl's ``flags_parser`` that ends any mistake
in one ``error:`` line.

It loads the config file first without the ``--config.a.b=value`` overrides, checks every
override's key against it (``--config.model.postion=cope`` -> "did you mean
'model.position'?"), then parses everything and sets
``--config.model.position_options.<key>=<value>`` (see :mod:`copejax.config.scheme_options`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from absl import flags

from copejax.config import scheme_options
from copejax.config.command_line import did_you_mean, fail, one_line


def _config_file(argv: list[str], name: str) -> str | None:
    for arg in argv:
        if arg.startswith((f"--{name}=", f"-{name}=")):
            return arg.split("=", 1)[1]
    return None


def _is_override(arg: str, name: str) -> bool:
    return arg.lstrip("-").startswith(f"{name}.") and arg.startswith("-")


def _check_override(config: Any, path: str) -> None:
    node = config
    parts = path.split(".")
    for depth, part in enumerate(parts):
        keys = list(node.keys()) if hasattr(node, "keys") else []
        if part not in keys:
            where = ".".join(parts[:depth]) or "the config"
            hint = did_you_mean(part, [str(k) for k in keys])
            known = f" Keys of {where}: {', '.join(sorted(map(str, keys)))}" if keys else ""
            fail(f"unknown config key {path!r} (--config.{path}){hint or '.'}{known}")
        node = node[part]


def parse_flags(
    argv: list[str], name: str = "config", values: flags.FlagValues | None = None
) -> list[str]:
    """absl ``flags_parser``: parses ``argv``, ending any mistake in one ``error:`` line.

    ``values`` defaults to absl's global flags; ``name`` is the config flag's name.
    """
    values = flags.FLAGS if values is None else values
    try:
        kept, options = scheme_options.split_overrides(argv)
    except ValueError as error:
        fail(str(error))
    path = _config_file(kept, name)
    if path is not None and not os.path.isfile(path.split(":", 1)[0]):
        fail(f"config file {path.split(':', 1)[0]!r} not found (from --{name}={path})")
    overrides = [a for a in kept[1:] if _is_override(a, name)]
    base = [a for a in kept if a not in overrides]
    try:
        sys.argv = base  # ml_collections reads its overrides from sys.argv
        values(base)
        config = values[name].value
        for arg in overrides:
            _check_override(config, arg.lstrip("-").split("=", 1)[0].split(".", 1)[1])
        sys.argv = kept
        rest = values(kept)
        config = values[name].value
        for key, raw in options:
            scheme_options.set_option(config, key, scheme_options.parse_value(raw))
    except flags.Error as error:
        fail(one_line(error))
    except (ValueError, TypeError, AttributeError, KeyError, OSError) as error:
        fail(one_line(error))
    return rest
