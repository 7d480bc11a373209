"""Do the fused kernels compute what the naive path computes, on the machine at hand?

Part ``check`` of ``experiments.bench_kernels_gpu``, run first: a speed measured on a kernel
that lowers but computes something else would be worthless. For each scheme, a one-layer
bfloat16 model (grouped KV heads, two packed documents, a length of several tiles) runs on
``attention_impl="kernel"`` and on the naive path from the same parameters; the record holds
``max |kernel - naive| / max |naive|`` of the logits and of the gradients (the worst leaf's
difference over the whole gradient's largest magnitude), and ``ok`` when both stay within
the bound the interpret-mode tests use for one bfloat16 layer (6 roundings of bfloat16 on
each path: the weights, the output, dS, P, the cotangent, the gradient;
``tests/ops/kernels/tolerances.py``). On a GPU the kernels are
Triton's (compiled), not interpret mode's; the CPU runs them in interpret mode (``--smoke``).

Shape letters: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any

ROUNDINGS = 6  # per path, for one bfloat16 layer: see the module docstring
LENGTH, BLOCK = 160, 32  # five key tiles
HEADS, KV_HEADS, D_MODEL = 4, 2, 128  # head dim 32: a power of two, as Triton needs


def _config(scheme: str, impl: str, kv_heads: int = KV_HEADS) -> Any:
    from copejax.model import checks
    from copejax.model.config import ModelConfig

    return checks.validate(
        ModelConfig(
            vocab_size=32,
            d_model=D_MODEL,
            num_heads=HEADS,
            num_kv_heads=kv_heads,
            num_layers=1,
            max_len=LENGTH,
            position=scheme,
            attention_impl=impl,
            attention_block=BLOCK,
            dtype="bfloat16",
        )
    )


def relative_error(actual: Any, desired: Any) -> float:
    """``max |actual - desired| / max |desired|`` in float64 (0 for two all-zero arrays)."""
    import numpy as np

    actual = np.asarray(actual, np.float64)
    desired = np.asarray(desired, np.float64)
    scale = float(np.max(np.abs(desired), initial=0.0))
    diff = float(np.max(np.abs(actual - desired), initial=0.0))
    return diff / scale if scale else diff


def check(
    scheme: str,
    carry_groups: int | None = None,
    kv_heads: int = KV_HEADS,
    approx_log1p: bool | None = None,
) -> dict:
    """The kernel path of ``scheme`` against its naive path: the logits' and the worst
    gradient leaf's relative errors, the bound, and ``ok``; ``carry_groups``: stick-breaking's
    and CoPE's kernels traced with that many carry groups (``copejax.ops.kernels.
    carry_groups``; 1: the five key tiles in one dk / dv program, which updates its carries in
    place across them), else the default (here one group per key tile); ``kv_heads``: the
    model's key/value heads (``HEADS``: none grouped, where selective attention's backward
    writes dk and dv in the inputs' dtype and sums the selecting head's dk inside);
    ``approx_log1p``: stick-breaking's kernels with the lever ``copejax.ops.kernels.
    triton_params.approx_log1p_for_tracing`` (None: the default)."""
    from copejax.ops.kernels.carry_groups import carry_groups_for_tracing
    from copejax.ops.kernels.triton_params import approx_log1p_for_tracing

    with carry_groups_for_tracing(carry_groups), approx_log1p_for_tracing(approx_log1p):
        record = _check(scheme, kv_heads)
    extra = {} if approx_log1p is None else {"approx_log1p": approx_log1p}
    return {**record, "carry_groups": carry_groups, "kv_heads": kv_heads, **extra}


def _check(scheme: str, kv_heads: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from copejax.model.transformer import Transformer

    rng = np.random.default_rng(0)
    tokens_BT = jnp.asarray(rng.integers(0, 32, (2, LENGTH)), jnp.int32)
    split = LENGTH // 2 + 7  # row 1 packs two documents
    segments_BT = jnp.asarray([[0] * LENGTH, [0] * split + [1] * (LENGTH - split)], jnp.int32)
    positions_BT = jnp.asarray(
        [np.arange(LENGTH), np.r_[np.arange(split), np.arange(LENGTH - split)]], jnp.int32
    )
    naive, kernel = (Transformer(_config(scheme, impl, kv_heads)) for impl in ("naive", "kernel"))
    params = jax.jit(naive.init)(jax.random.key(0), tokens_BT, positions_BT)["params"]
    keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(params)))
    leaves, tree = jax.tree.flatten(params)
    noisy = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    params = jax.tree.unflatten(tree, noisy)  # live zero-initialised terms (CoPE's table)

    def value_and_grad(model: Transformer) -> tuple:
        def loss(p: Any) -> tuple:
            logits_BTV = model.apply({"params": p}, tokens_BT, positions_BT, segments_BT)
            return jnp.mean(jnp.sin(logits_BTV.astype(jnp.float32))), logits_BTV

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, logits_naive), grads_naive = value_and_grad(naive)
    (_, logits_kernel), grads_kernel = value_and_grad(kernel)
    # Against the whole gradient's scale: a leaf that cancels to about 0 (an output bias the
    # softmax ignores) is as exact as the terms it is made of.
    scale = max(
        float(jnp.max(jnp.abs(g.astype(jnp.float32)))) for g in jax.tree.leaves(grads_naive)
    )
    grad_error = max(
        relative_error(k, n) * float(np.max(np.abs(np.asarray(n, np.float64)))) / scale
        for k, n in zip(jax.tree.leaves(grads_kernel), jax.tree.leaves(grads_naive), strict=True)
    )
    bound = ROUNDINGS * float(jnp.finfo(jnp.bfloat16).eps)
    logits_error = relative_error(logits_kernel, logits_naive)
    return {
        "scheme": scheme,
        "logits_rel_error": logits_error,
        "grad_rel_error": grad_error,
        "bound": bound,
        "ok": logits_error <= bound and grad_error <= bound,
    }


def check_run(
    scheme: str,
    carry_groups: int | None = None,
    kv_heads: int | None = None,
    approx_log1p: bool | None = None,
) -> dict:
    """:func:`check` (``kv_heads`` None: its default), or the error that stopped it: part
    ``check`` of ``experiments.bench_kernels_gpu`` records a kernel that fails to lower or
    compile as a finding."""
    kv_heads = KV_HEADS if kv_heads is None else kv_heads
    try:
        return check(scheme, carry_groups, kv_heads, approx_log1p)
    except Exception as error:  # a kernel that fails to lower or compile is a finding
        why = f"{type(error).__name__}: {error}"[:600]
        record = {"scheme": scheme, "carry_groups": carry_groups, "kv_heads": kv_heads}
        extra = {} if approx_log1p is None else {"approx_log1p": approx_log1p}
        return {**record, **extra, "ok": False, "error": why}
