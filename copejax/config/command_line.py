"""What the programs share on the command line: a mistake ends in one ``error:`` line (no
traceback), a misspelt name gets a suggestion, logging stays quiet, and tools exit with one
line on errors. The ``--config`` flag's parser is :mod:`copejax.config.config_flag`.
"""

from __future__ import annotations

import difflib
import functools
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
            fail(one_line(error))

    return wrapped


def one_line(error: BaseException) -> str:
    """The message of ``error`` without a quoted repr or an embedded traceback (ml_collections
    puts the config file's traceback into its flag error: its last line is the cause)."""
    text = str(error).strip()
    if "Traceback (most recent call last)" in text:
        cause = text.splitlines()[-1]
        text = cause.split(": ", 1)[1] if re.match(r"^\w+(Error|Exception): ", cause) else cause
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return text
