"""From one generated token document to a fixed-length Example, and the per-index source.

Shared by the synthetic tasks (flipflop, selective_copy, counting, addition, passkey): each
task draws a document of token ids plus a flag per token saying whether it is scored, and this
module turns it into next-token ``inputs``/``targets`` of the split's length T.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import numpy as np

from copejax.data.base import Example, TaskSource

PAD_ID = 0  # every synthetic vocabulary starts with "<pad>"


def split_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of element ``index`` of ``split``: a pure function of the three.

    The split enters as the CRC32 of its name, so it is stable across processes and options.
    """
    return np.random.default_rng([seed, zlib.crc32(split.encode()), index])


def to_example(
    doc: Sequence[int], scored: Sequence[bool], length: int, truncate_left: bool = False
) -> Example:
    """Turns a document of L tokens into an Example of length T = ``length``.

    ``inputs = doc[:-1]`` and ``targets = doc[1:]``; ``loss_mask[t] = scored[t + 1]``, i.e. a
    position is scored when the token it predicts is. Shorter documents are padded on the right
    (pad id 0, segment 0, position 0, mask 0). Longer ones raise, unless ``truncate_left``: then
    the first L - 1 - T tokens are dropped (the end, where the scored answer is, is kept) and
    positions restart at 0 in the kept window.

    Args:
      doc: L token ids.
      scored: L flags; ``scored[0]`` is ignored (the first token is never a target).
      length: T.
      truncate_left: keep the last T predictions of a too long document.

    Returns:
      The Example: int32 ``inputs``/``targets``/``positions``/``segment_ids`` and float32
      ``loss_mask``, all of shape [T].
    """
    doc_L = np.asarray(doc, np.int32)
    scored_L = np.asarray(scored, bool)
    if doc_L.shape != scored_L.shape or doc_L.ndim != 1:
        raise ValueError(f"doc {doc_L.shape} and scored {scored_L.shape} must be equal 1-D shapes")
    inputs, targets, mask = doc_L[:-1], doc_L[1:], scored_L[1:]
    if len(inputs) > length:
        if not truncate_left:
            raise ValueError(f"document of {len(doc_L)} tokens does not fit length {length}")
        inputs, targets, mask = inputs[-length:], targets[-length:], mask[-length:]
    used, pad = len(inputs), length - len(inputs)
    return {
        "inputs": np.pad(inputs, (0, pad), constant_values=PAD_ID),
        "targets": np.pad(targets, (0, pad), constant_values=PAD_ID),
        "loss_mask": np.pad(mask.astype(np.float32), (0, pad)),
        "positions": np.pad(np.arange(used, dtype=np.int32), (0, pad)),
        "segment_ids": np.pad(np.ones(used, np.int32), (0, pad)),
    }


def decode(vocab: Sequence[str], ids: Sequence[int]) -> str:
    """Whitespace-joined token strings of ``ids``, padding dropped."""
    return " ".join(vocab[int(i)] for i in ids if int(i) != PAD_ID)


class SequenceSource(TaskSource):
    """Random-access source: element ``index`` is ``make(split_rng(seed, split, index))``.

    ``owner`` is the task (a frozen dataclass): its repr makes the source's repr stable and
    option-specific, as grain requires when restoring an iterator.
    """

    def __init__(
        self,
        owner: object,
        split: str,
        seed: int,
        size: int,
        make: Callable[[np.random.Generator, int], Example],
    ) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self._owner, self._split, self._seed, self._size, self._make = (
            owner,
            split,
            seed,
            size,
            make,
        )

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> Example:
        index = int(index)
        if not 0 <= index < self._size:
            raise IndexError(
                f"index {index} out of range for split {self._split!r} of {self._size}"
            )
        return self._make(split_rng(self._seed, self._split, index), index)

    def __repr__(self) -> str:
        return f"SequenceSource({self._owner!r}, split={self._split!r}, seed={self._seed})"


def check_split(split: str, allowed: Sequence[str]) -> None:
    """Raises ValueError for a split name not in ``allowed``."""
    if split not in allowed:
        raise ValueError(f"unknown split {split!r}; allowed splits: {list(allowed)}")


def check_positive(**values: int) -> None:
    """Raises ValueError naming any value that is not a positive integer."""
    for name, value in values.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_probability(**values: float) -> None:
    """Raises ValueError naming any value outside [0, 1)."""
    for name, value in values.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
