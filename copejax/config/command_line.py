"""What the programs share on the command line: flag parsing that ends a mistake in one
``error:`` line (no traceback), quiet logging, and tools that exit with one line on errors.

``parse_flags`` is absl's ``flags_parser`` for ``copejax.main``. It loads the config file
first without the ``--config.a.b=value`` overrides, checks every override's key against it
(``--config.model.postion=cope`` -> "did you mean 'model.position'?"), then parses everything
and sets ``--config.model.position_options.<key>=<value>`` (see ``copejax.config.scheme_options``).
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from absl import flags, logging


def fail(message: str, code: int = 1) -> NoReturn:
    """Prints ``error: <message>`` on stderr and exits."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def did_you_mean(word: str, choices: list[str]) -> str:
    """``"; did you mean 'p_max'?"`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def quiet_logging() -> None:
    """absl WARNING unless ``--verbosity`` was given: orbax logs every file operation at INFO."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def one_line_errors(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
    """Wraps a tool's ``main`` so that a ValueError or OSError ends it with one ``error:`` line
    (a path that is not a run, a read-only directory...) instead of a traceback."""

    @functools.wraps(main)
    def wrapped(argv: list[str]) -> Any:
        quiet_logging()
        try:
            return main(argv)
        except (ValueError, OSError) as error:
            fail(_one_line(error))

    return wrapped


def _one_line(error: BaseException) -> str:
    """The message of ``error`` without a quoted repr or an embedded traceback (ml_collections
    puts the config file's traceback into its flag error: its last line is the cause)."""
    text = str(error).strip()
    if "Traceback (most recent call last)" in text:
        cause = text.splitlines()[-1]
        text = cause.split(": ", 1)[1] if re.match(r"^\w+(Error|Exception): ", cause) else cause
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text


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
    from copejax.config import scheme_options  # the scheme registry: only for the training program

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
        fail(_one_line(error))
    except (ValueError, TypeError, AttributeError, KeyError, OSError) as error:
        fail(_one_line(error))
    return rest
