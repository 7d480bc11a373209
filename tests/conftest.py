"""Shared fixtures: tiny model configs and inputs."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from importlib import metadata

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles well over a thousand tiny programs, whose LLVM optimisation costs more
# than it saves: without it, test_decode.py and test_blockwise_equivalence.py take 24% less
# time on a 2-core CPU (205 s -> 156 s). Only code generation changes (XLA's HLO passes, and
# so fusion and buffer sizes, still run); the environment variable reaches the programs the
# tests start as subprocesses too. JAX_DISABLE_MOST_OPTIMIZATIONS=0 restores the default.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA's CPU fusion emitters (MLIR) take about twice as long to compile a tiny program as its
# older LLVM IR emitters: without them, six of test_blockwise_equivalence.py's tests take 25 s
# instead of 65 s on a 2-core CPU. Again only code generation changes, for the subprocesses
# too; XLA_FLAGS=--xla_cpu_use_fusion_emitters=true restores the default. jaxlib 0.11 (the GPU
# machine's) no longer has the flag and aborts on it ("Unknown flag in XLA_FLAGS"): not there.
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and tuple(
    int(part) for part in metadata.version("jaxlib").split(".")[:2]
) < (0, 11):
    FLAGS = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = FLAGS.strip()
# XLA splits each CPU program's LLVM module into parts that it compiles in parallel; for the
# suite's tiny programs, on 2 cores that pytest-xdist's two workers already keep busy, the
# splitting costs more than it saves: one part each takes 10-15% less XLA compile time
# (test_decode.py + test_scheme_properties.py, two interleaved rounds on a 2-core CPU: compile
# 50.9 / 47.8 s -> 43.1 / 43.9 s, wall 124 / 120 s -> 116 / 116 s). Code generation only;
# jaxlib 0.11 has the flag too. XLA_FLAGS=--xla_cpu_parallel_codegen_split_count=N overrides.
if "xla_cpu_parallel_codegen_split_count" not in os.environ.get("XLA_FLAGS", ""):
    FLAGS = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_parallel_codegen_split_count=1"
    os.environ["XLA_FLAGS"] = FLAGS.strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.model import checks
from copejax.model.config import ModelConfig

jax.config.update("jax_default_matmul_precision", "highest")


def host_devices_env(devices: int) -> dict[str, str]:
    """The environment for a test's subprocess with ``devices`` CPU devices: this process's,
    with the XLA flags set above and the device count after them."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())


def tiny_config(position: str, **overrides: object) -> ModelConfig:
    """A 2-layer, 2-head, D=32 model: small enough to compile in about a second."""
    kwargs: dict[str, object] = dict(
        vocab_size=13, d_model=32, num_heads=2, num_layers=2, max_len=16, position=position
    )
    kwargs.update(overrides)
    return checks.validate(ModelConfig(**kwargs))


def tokens_and_positions(batch: int = 2, length: int = 8, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    tokens_BT = jnp.asarray(rng.integers(0, 13, (batch, length)), jnp.int32)
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return tokens_BT, positions_BT


# A packed batch: row 0 is one document; row 1 packs three (boundaries at 3 and 5).
PACKED_SEGMENTS_BT = np.array([[1] * 8, [1, 1, 1, 2, 2, 3, 3, 3]], np.int32)
PACKED_POSITIONS_BT = np.array([list(range(8)), [0, 1, 2, 0, 1, 0, 1, 2]], np.int32)


def perturbed(params: object, scale: float = 0.1, seed: int = 1) -> object:
    """Every parameter plus scale * N(0, 1) noise, so that zero-initialised terms (CoPE's
    table, TAPE's W2, ...) are live in equivalence tests."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, noisy)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def decode_in_chunks(
    model: object,
    params: object,
    tokens_BT: jax.Array,
    positions_BT: np.ndarray,
    segments_BT: np.ndarray | None,
    *,
    chunks: Sequence[int],
    max_len: int | None = None,
) -> np.ndarray:
    """Logits of decoding ``tokens_BT`` with the KV cache (``max_len`` slots, default T),
    ``chunks`` tokens per call (a prefill, then steps or further chunks), concatenated over
    the calls: (B, T, V). ``segments_BT=None``: the calls pass no segment ids."""
    from copejax.model import decode

    max_len = tokens_BT.shape[1] if max_len is None else max_len
    cache = decode.init_cache(model.cfg, tokens_BT.shape[0], max_len)
    # Compiled once per chunk width: faster than dispatching each call's ops eagerly.
    step = jax.jit(functools.partial(model.apply, decode=True, mutable=["cache"]))
    outputs, start = [], 0
    for size in chunks:
        end = start + size
        logits_BTV, variables = step(
            {"params": params, "cache": cache},
            tokens_BT[:, start:end],
            jnp.asarray(positions_BT[:, start:end]),
            None if segments_BT is None else jnp.asarray(segments_BT[:, start:end]),
        )
        cache, start = variables["cache"], end
        outputs.append(np.asarray(logits_BTV))
    assert start == tokens_BT.shape[1], f"chunks {chunks} do not cover {tokens_BT.shape[1]} tokens"
    return np.concatenate(outputs, axis=1)


@pytest.fixture
def jax_state_kept() -> Iterator[None]:
    """The environment and JAX's persistent-cache settings as they were before the test
    (``experiments.bench_kernels_gpu.main`` sets both in its process, for its children)."""
    from jax._src import compilation_cache

    from experiments.bench_kernels_warm import CACHE_OPTIONS

    environ = dict(os.environ)
    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
