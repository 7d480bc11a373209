"""Logical axis names for parameters and activations, and the default rules to mesh axes.

Every parameter and activation in copejax is annotated with these names (maxtext's recipe);
the rules in a config map them to the device mesh axes ``data``, ``fsdp`` and ``tensor``.
"""

from __future__ import annotations

BATCH = "batch"
LENGTH = "length"
KV_LENGTH = "kv_length"
EMBED = "embed"
HEADS = "heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
POSITIONS = "positions"  # rows of position tables (learned, relative, CoPE's e[p], T5 buckets)
POS_EMBED = "pos_embed"  # width of position-table rows
POS_MLP = "pos_mlp"  # hidden units of position MLPs (FIRE, CoPE-MLP, TAPE's psi)
LAYERS = "layers"

# (logical name, mesh axis or axes or None). Position-scheme parameters are small: replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (KV_LENGTH, None),
    (EMBED, "fsdp"),
    (HEADS, "tensor"),
    (HEAD_DIM, None),
    (MLP, "tensor"),
    (VOCAB, "tensor"),
    (POSITIONS, None),
    (POS_EMBED, None),
    (POS_MLP, None),
    (LAYERS, None),
)
