"""Packing tokenized documents into fixed-length next-token examples.

Every document (``<bos>`` ... ``<eos>``, n tokens, n - 1 predictions) is cut into chunks of at
most T predictions: chunk k holds tokens ``[kT, kT + T]`` (T + 1 tokens, overlapping the next
chunk by one), so every token after ``<bos>`` is a target exactly once. Chunks are placed in
rows of T slots greedily in document order; a chunk that does not fit closes the row (the rest
is padding). Within a row each chunk is a *segment*: ids 1, 2, ... (0 = padding), positions
restart at 0, and attention stays inside it, so a chunk that continues a long document is
modelled without the earlier context, exactly like a new document.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from copejax.data._tokenizers import PAD_ID
from copejax.data.base import Example


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each row's segments come from.

    Attributes:
      length: T, slots per row.
      tokens: all documents' ids concatenated, int32 [total].
      row_starts: segments of row r are ``row_starts[r]:row_starts[r + 1]``, int64 [rows + 1].
      seg_token: offset in ``tokens`` of each segment's first input, int64 [segments].
      seg_len: predictions of each segment (>= 1), int64 [segments].
      seg_slot: slot of each segment's first input in its row, int64 [segments].
    """

    length: int
    tokens: np.ndarray
    row_starts: np.ndarray
    seg_token: np.ndarray
    seg_len: np.ndarray
    seg_slot: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    @property
    def num_predictions(self) -> int:
        return int(self.seg_len.sum())

    def example(self, row: int) -> Example:
        """Row ``row`` as an Example (see ``copejax.data.base``), all arrays of shape [T]."""
        length = self.length
        inputs = np.full(length, PAD_ID, np.int32)
        targets = np.full(length, PAD_ID, np.int32)
        positions = np.zeros(length, np.int32)
        segment_ids = np.zeros(length, np.int32)
        for k, seg in enumerate(range(self.row_starts[row], self.row_starts[row + 1])):
            start, n, slot = self.seg_token[seg], self.seg_len[seg], self.seg_slot[seg]
            inputs[slot : slot + n] = self.tokens[start : start + n]
            targets[slot : slot + n] = self.tokens[start + 1 : start + n + 1]
            positions[slot : slot + n] = np.arange(n)
            segment_ids[slot : slot + n] = k + 1
        return {
            "inputs": inputs,
            "targets": targets,
            "loss_mask": (segment_ids > 0).astype(np.float32),
            "positions": positions,
            "segment_ids": segment_ids,
        }


def pack(documents: list[np.ndarray], length: int) -> Packing:
    """Plans the rows of length ``length`` for ``documents`` (each ``<bos>`` ... ``<eos>``).

    Documents with fewer than 2 tokens have nothing to predict and are skipped.
    """
    if length < 1:
        raise ValueError(f"sequence length must be >= 1, got {length}")
    docs = [np.asarray(d, np.int32) for d in documents if len(d) >= 2]
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    offsets = np.cumsum([0] + [len(d) for d in docs])
    row_starts, seg_token, seg_len, seg_slot = [0], [], [], []
    fill = 0
    for doc, offset in zip(docs, offsets[:-1], strict=True):
        predictions = len(doc) - 1
        for start in range(0, predictions, length):
            n = min(length, predictions - start)
            if fill + n > length:
                row_starts.append(len(seg_len))
                fill = 0
            seg_token.append(offset + start)
            seg_len.append(n)
            seg_slot.append(fill)
            fill += n
    if fill:
        row_starts.append(len(seg_len))
    as_int = lambda values: np.asarray(values, np.int64)
    return Packing(
        length=length,
        tokens=tokens,
        row_starts=as_int(row_starts),
        seg_token=as_int(seg_token),
        seg_len=as_int(seg_len),
        seg_slot=as_int(seg_slot),
    )
