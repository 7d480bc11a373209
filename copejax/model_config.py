"""The model's frozen configuration and its validation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from copejax.positions.base import Dims, PositionScheme

BLOCKS = ("llama", "gpt2")
DTYPES = ("float32", "bfloat16")
KERNELS = ("einsum", "dot_product_attention")
# Sites a scheme may use with attention_kernel="dot_product_attention": the kernel takes the
# queries, keys and values the qk site returns and computes the plain masked softmax itself.
KERNEL_SITES = frozenset({"embed", "qk"})


def _freeze(options: Mapping[str, Any] | tuple) -> tuple[tuple[str, Any], ...]:
    if isinstance(options, tuple):
        return options
    items = []
    for key, value in sorted(dict(options).items()):
        items.append((key, tuple(value) if isinstance(value, list) else value))
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer.

    Attributes:
      vocab_size: V.
      d_model: D.
      num_heads: N.
      num_layers: blocks.
      head_dim: H; defaults to D // N.
      mlp_dim: hidden width of the MLP; defaults to 4D (gpt2) or 8D/3 rounded up to 8 (llama).
      block: "llama" (pre-RMSNorm, SwiGLU, no biases) or "gpt2" (LayerNorm, GELU, biases).
      tie_embeddings: share the token embedding with the output layer.
      dropout: residual and embedding dropout rate.
      dtype: compute dtype, "float32" or "bfloat16" (parameters are always float32).
      position: registered scheme name, e.g. "rope" or "cope+rope".
      position_options: options of the scheme (a mapping; stored as sorted pairs).
      max_len: training context length T (learned tables, FIRE's L, YaRN's original length).
      init_std: standard deviation of the weight initialisers.
      attention_kernel: "einsum" (explicit float32 logits, the scheme's bias and normalizer
        sites; attention maps can be read) or "dot_product_attention"
        (``jax.nn.dot_product_attention``: XLA's fused form on CPU/TPU, cuDNN where JAX picks
        it on GPU), for schemes whose only sites are embed and qk (nope, learned, sinusoidal,
        randomized, rope, xpos).
    """

    vocab_size: int
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    head_dim: int | None = None
    mlp_dim: int | None = None
    block: str = "llama"
    tie_embeddings: bool = True
    dropout: float = 0.0
    dtype: str = "float32"
    position: str = "rope"
    position_options: Any = ()
    max_len: int = 512
    init_std: float = 0.02
    attention_kernel: str = "einsum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "position_options", _freeze(self.position_options))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def resolved_mlp_dim(self) -> int:
        if self.mlp_dim is not None:
            return self.mlp_dim
        if self.block == "gpt2":
            return 4 * self.d_model
        return -(-8 * self.d_model // 3 // 8) * 8

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def dims(self) -> Dims:
        return Dims(
            d_model=self.d_model,
            num_heads=self.num_heads,
            head_dim=self.resolved_head_dim,
            num_layers=self.num_layers,
            max_len=self.max_len,
        )

    def scheme(self) -> PositionScheme:
        # The cache key carries each value's type: 1 == True would otherwise return a scheme
        # built (and validated) from the other value.
        typed = tuple((k, type(v).__name__, v) for k, v in self.position_options)
        return _make_scheme(self.position, typed)

    def validate(self) -> ModelConfig:
        """Raises ValueError naming the first bad value and what is allowed; returns self."""
        for key in ("vocab_size", "d_model", "num_heads", "num_layers", "max_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        for key in ("head_dim", "mlp_dim"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"model.{key} must be a positive integer or None, got {value!r}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; choose sizes that divide or set model.head_dim"
            )
        if self.block not in BLOCKS:
            raise ValueError(f"model.block must be one of {BLOCKS}, got {self.block!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention_kernel not in KERNELS:
            raise ValueError(
                f"model.attention_kernel must be one of {KERNELS}, got {self.attention_kernel!r}"
            )
        scheme = self.scheme()
        scheme.validate(self.dims)
        extra_sites = sorted(set(scheme.sites) - KERNEL_SITES)
        if self.attention_kernel == "dot_product_attention" and extra_sites:
            raise ValueError(
                f"model.attention_kernel='dot_product_attention' computes a plain masked softmax "
                f"and allows schemes whose only sites are {sorted(KERNEL_SITES)}; "
                f"{scheme.name!r} also uses {extra_sites}: use attention_kernel='einsum'"
            )
        token_dim = scheme.token_dim(self.d_model)
        if not 0 < token_dim <= self.d_model:
            raise ValueError(
                f"{scheme.name}: token embedding width {token_dim} must be in (0, {self.d_model}]"
            )
        return self


@functools.cache
def _make_scheme(name: str, typed_options: tuple[tuple[str, str, Any], ...]) -> PositionScheme:
    from copejax.positions.registry import make_scheme

    return make_scheme(name, {key: value for key, _, value in typed_options})
