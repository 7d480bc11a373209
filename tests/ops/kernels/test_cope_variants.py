"""CoPE's paper variants in the fused kernels (arXiv 2405.18719): gates on sep-keys' k' or on
the values, and the ALiBi (eq. 10) and MLP (Appendix C) position terms.

Values against NumPy in float64 and gradients (q, k, v, the gate keys, the table, slopes or
MLP weights) against ``jax.grad`` of the dense float32 maths, both written here from the
paper's equations; grouped KV heads, packed segments, a window with sinks, positions that
reach the cap. The Triton kernels run in interpret mode and lower to Triton; the TPU kernels
export to Mosaic TPU (their interpret-mode runs and the model comparisons are slow). The
whole model on the kernels equals the naive path with each variant (``cope+rope`` too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from copejax.ops.kernels.attention import fused_attention
from copejax.ops.kernels.cope import CopeStatic, CopeTerm
from copejax.ops.kernels.cope_terms import erf_f32, mlp_units_QK, mlp_units_vjp
from copejax.ops.kernels.gpu_lowering import lower_for_gpu
from tests.conftest import tiny_config
from tests.ops.kernels.reference import attention_jnp, attention_numpy, mask_BTS
from tests.ops.kernels.tolerances import assert_close

B, N, G, H = 2, 4, 2, 16
P_MAX, F = 4, 6  # segments of 6 to 32 keys: the cap is reached
SMALL = (32, 16, 16)  # T, block_q, block_k: 2 x 2 tiles
TPU = (200, 64, 128)  # the TPU kernels' key tiles have 128 keys: 2 of them
WINDOW, SINKS = 10, 2
QUICK = {"xla_backend_optimization_level": 0}  # interpret mode: compile time dominates
SLOW = pytest.mark.slow
GATE_OPERAND = {"keys": None, "sep_keys": "gk", "values": "v"}  # the kernels' gate keys
GATE_KEYS = {"keys": "k", "sep_keys": "gk", "values": "v"}  # what the gates read


def _layout(length: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions: row 0 one document, row 1 three packed."""
    cuts = [length * 7 // 16, length * 3 // 8]
    sizes = [cuts[0], cuts[1], length - sum(cuts)]
    segments = np.array([[0] * length, np.repeat([0, 1, 2], sizes)], np.int32)
    positions = np.array([np.arange(length), np.concatenate([np.arange(s) for s in sizes])])
    return segments, positions


def _inputs(length: int, dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    x = {key: normal(B, length, heads, H) for key, heads in [("q", N), ("k", G), ("v", G)]}
    x["gk"] = normal(B, length, G, H)
    x = {key: jnp.asarray(value, dtype) for key, value in x.items()}
    x["table"] = jnp.asarray(normal(P_MAX, H))
    x["slopes"] = jnp.asarray(normal(N))
    x["mlp"] = tuple(jnp.asarray(a) for a in (3 * normal(F), normal(F), normal(F, H)))
    return x


def _params(x: dict, term: str):
    return {"interpolate": x["table"], "alibi": x["slopes"], "mlp": x["mlp"]}[term]


def _kernel(x: dict, gates: str, term: str, length_blocks: tuple, backend: str, **kw):
    length, block_q, block_k = length_blocks
    segments, positions = _layout(length)
    gate_k = None if GATE_OPERAND[gates] is None else x[GATE_OPERAND[gates]]
    unit_gates = kw.pop("unit_gates", False)
    static = CopeStatic(
        P_MAX, unit_gates=unit_gates, position_term=term, mlp_units=F, mlp_scale=1.0 / P_MAX
    )
    return fused_attention(
        x["q"],
        x["k"],
        x["v"],
        q_positions_BT=jnp.asarray(positions),
        k_positions_BT=jnp.asarray(positions),
        segment_ids_BT=jnp.asarray(segments),
        window=kw.pop("window", WINDOW),
        sink_tokens=SINKS,
        k_rank_BT=jnp.asarray(positions, jnp.int32),
        block_q=block_q,
        block_k=block_k,
        cope=CopeTerm(_params(x, term), static, gate_k),
        backend=backend,
        **kw,
    )


def cope_variant_term(x: dict, gates: str, term: str, allowed_BTS, *, xp, erf):
    """CoPE's term for every pair (eq. 4-10, Appendix C) in ``xp`` (NumPy float64 or jnp
    float32): gates sigmoid(q . g / sqrt(H)) with g = k, k' or v over allowed keys, suffix
    sums capped at p_max - 1, then q . e[p] interpolated, m_h p, or q . MLP(p / p_max)."""
    groups = N // G
    q = xp.asarray(x["q"])
    gate_k = xp.repeat(xp.asarray(x[GATE_KEYS[gates]]), groups, 2)
    logits = xp.einsum("btnh,bsnh->bnts", q, gate_k) / np.sqrt(H)
    gates_BNTS = xp.where(allowed_BTS[:, None], 1.0 / (1.0 + xp.exp(-logits)), 0.0)
    p = xp.minimum(xp.cumsum(gates_BNTS[..., ::-1], axis=-1)[..., ::-1], P_MAX - 1.0)
    if term == "alibi":
        return xp.asarray(x["slopes"])[None, :, None, None] * p
    if term == "mlp":
        w_in, b_in, w_out = (xp.asarray(a) for a in x["mlp"])
        a = p[..., None] / P_MAX * w_in + b_in
        hidden = a * (1.0 + erf(a / np.sqrt(2.0))) / 2.0
        return xp.einsum("bntsf,btnf->bnts", hidden, xp.einsum("btnh,fh->btnf", q, w_out))
    z = xp.einsum("btnh,ph->bntp", q, xp.asarray(x["table"]))
    low = xp.floor(p).astype(np.int32)
    high = xp.minimum(low + 1, P_MAX - 1)
    frac = p - xp.floor(p)
    read = lambda index: xp.take_along_axis(z, index, axis=-1)
    return (1.0 - frac) * read(low) + frac * read(high)


def _check(gates: str, term: str, dtype: str, length_blocks: tuple, *, backend: str, window):
    x = _inputs(length_blocks[0], jnp.dtype(dtype))
    segments, positions = _layout(length_blocks[0])
    allowed = mask_BTS(segments, window, SINKS, positions.astype(np.int32))
    cot = jnp.asarray(np.random.default_rng(5).normal(size=x["q"].shape), jnp.float32)
    kernel = functools.partial(
        _kernel, gates=gates, term=term, length_blocks=length_blocks, backend=backend
    )

    @functools.partial(jax.jit, compiler_options=QUICK)
    def values_and_grads(x: dict, cot: jax.Array) -> tuple:
        y, pull = jax.vjp(lambda x: kernel(x, window=window).astype(jnp.float32), x)
        return y, pull(cot)[0]

    def dense(x: dict) -> jax.Array:
        x = jax.tree.map(lambda a: a.astype(jnp.float32), x)
        bias = cope_variant_term(x, gates, term, allowed, xp=jnp, erf=jax.scipy.special.erf)
        return attention_jnp(x["q"], x["k"], x["v"], bias, allowed)

    y, grads = values_and_grads(x, cot)
    y_ref, pull_ref = jax.vjp(dense, x)
    (grads_ref,) = pull_ref(cot)
    if dtype == "float32":
        x64 = jax.tree.map(lambda a: np.asarray(a, np.float64), x)
        bias64 = cope_variant_term(x64, gates, term, allowed, xp=np, erf=scipy.special.erf)
        expected = attention_numpy(x["q"], x["k"], x["v"], bias64, allowed)
        assert_close(y, expected, dtype=dtype, summands=length_blocks[0], roundings=0)
    assert_close(y, y_ref, dtype=dtype, summands=length_blocks[0], roundings=2)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(grads_ref))
    pairs = B * length_blocks[0] ** 2
    # Through the carried count a token's gradient sums the pulls of its rows' pairs: the
    # GPU kernels take the gates' cotangent X = D - S - d_c, a difference of sums over a
    # row's key tiles (copejax.ops.kernels.cope_backward), so length^2 / 2 summands
    row_pairs = length_blocks[0] ** 2 // 2
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
        name = jax.tree_util.keystr(path)
        per_token = any(key in name for key in ("'q'", "'k'", "'v'", "'gk'"))
        summands = row_pairs if per_token else pairs
        assert_close(
            grad, flat_ref[path], dtype=dtype, summands=summands, roundings=4, err_msg=name
        )


VARIANTS = [("sep_keys", "interpolate"), ("values", "alibi"), ("keys", "mlp")]


@pytest.mark.parametrize(("gates", "term"), VARIANTS)
def test_triton_kernels_equal_reference(gates: str, term: str) -> None:
    _check(gates, term, "float32", SMALL, backend="triton", window=WINDOW)


@SLOW
@pytest.mark.parametrize(
    ("gates", "term", "dtype", "window"),
    [
        ("sep_keys", "mlp", "float32", None),
        ("values", "interpolate", "float32", None),
        ("keys", "alibi", "float32", None),
        ("sep_keys", "mlp", "bfloat16", WINDOW),
        ("values", "alibi", "bfloat16", None),
    ],
)
def test_triton_kernels_equal_reference_more(gates, term, dtype, window) -> None:
    _check(gates, term, dtype, SMALL, backend="triton", window=window)


@SLOW
@pytest.mark.parametrize(("gates", "term"), [*VARIANTS, ("sep_keys", "mlp")])
def test_tpu_kernels_equal_reference(gates: str, term: str) -> None:
    _check(gates, term, "float32", TPU, backend="tpu", window=WINDOW)


@pytest.mark.parametrize(
    ("gates", "term", "unit_gates"),
    [("sep_keys", "mlp", False), ("values", "alibi", False), ("keys", "interpolate", True)],
)
def test_lowers_to_triton_and_mosaic_tpu(gates: str, term: str, unit_gates: bool) -> None:
    """Forward and both backward kernels pass Pallas's Triton lowering (for CUDA) and Mosaic
    TPU export, from the CPU. With unit gates nothing of the positions is differentiated in
    the dk / dv kernel, so the custom pull-backs (which lower only where an input is) stay
    out of it."""
    x = _inputs(SMALL[0], jnp.bfloat16)

    def loss(x, backend, length_blocks):
        y = _kernel(x, gates, term, length_blocks, backend, interpret=False, unit_gates=unit_gates)
        return jnp.sum(y.astype(jnp.float32))

    gpu = jax.jit(jax.grad(functools.partial(loss, backend="triton", length_blocks=SMALL)))
    text = lower_for_gpu(gpu, x).as_text()
    for name in ("forward", "dq", "dkdv"):
        assert f"copejax_attention_{name}" in text
    tpu = jax.jit(jax.grad(functools.partial(loss, backend="tpu", length_blocks=SMALL)))
    text = jax.export.export(tpu, platforms=["tpu"])(x).mlir_module()
    assert text.count("tpu_custom_call") == 3


def test_erf_is_float32_accurate() -> None:
    """The kernels' erf (Triton lowers no lax.erf) is within 4e-7 of erf everywhere."""
    x = np.linspace(-9.0, 9.0, 100_001, dtype=np.float32)
    got = np.asarray(erf_f32(jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, scipy.special.erf(x.astype(np.float64)), rtol=0, atol=4e-7)


def test_mlp_pullback_recomputes_the_units_exactly() -> None:
    """The MLP term's custom pull-back (no stored (F, Q, K) residuals) equals autodiff of the
    same sum, and its value equals ``jax.nn.gelu``'s."""
    rng = np.random.default_rng(2)
    qw_QF = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    p_QK = jnp.asarray(rng.uniform(0, 7, (8, 12)), jnp.float32)
    vec_2F = jnp.asarray(rng.normal(size=(2, 16)) * [[3.0], [1.0]], jnp.float32)
    g_QK = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)

    def autodiff(qw, p, vec):
        a = (p * 0.125)[..., None] * vec[0, :F] + vec[1, :F]
        return jnp.einsum("qkf,qf->qk", jax.nn.gelu(a, approximate=False), qw[:, :F])

    @jax.jit
    def both(args: tuple, g_QK: jax.Array) -> tuple:
        value, pull = jax.vjp(lambda *a: mlp_units_vjp(*a, F, 0.125), *args)
        value_ref, pull_ref = jax.vjp(autodiff, *args)
        plain = mlp_units_QK(*args, F, 0.125)
        return (value, pull(g_QK)), (value_ref, pull_ref(g_QK)), plain

    (value, grads), (value_ref, grads_ref), plain = both((qw_QF, p_QK, vec_2F), g_QK)
    np.testing.assert_allclose(value, value_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(value, plain, rtol=0, atol=0)
    for got, want in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize(
    "options",
    [
        {"gates": "sep_keys"},
        {"gates": "values", "position_term": "mlp"},
        {"position_term": "alibi", "alibi_slopes": "press", "p_max": None},
        {"position_term": "mlp", "p_max": None},
    ],
)
def test_model_takes_every_variant(options: dict) -> None:
    """No variant is refused (ALiBi's and the MLP's term take any p_max: no table loop)."""
    tiny_config("cope", attention_impl="kernel", position_options=options, max_len=512)


MODEL_VARIANTS = [
    ("cope", {"gates": "sep_keys"}),
    ("cope", {"gates": "values", "position_term": "alibi"}),
    ("cope", {"position_term": "alibi", "alibi_slopes": "press"}),
    ("cope", {"position_term": "mlp", "mlp_hidden": 8}),
    ("cope+rope", {"gates": "sep_keys", "position_term": "mlp", "mlp_hidden": 8}),
    ("cope+rope", {"gates": "values"}),
    ("cope", {"force_unit_gates": True, "position_term": "mlp", "mlp_hidden": 8}),
]


@SLOW
@pytest.mark.parametrize(("position", "options"), MODEL_VARIANTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_on_kernels_equals_naive(position: str, options: dict, dtype: str) -> None:
    """The whole model on the Triton kernels (interpret mode) equals the naive path: values
    and every parameter's gradient (W of sep-keys, slopes, the MLP's weights), GQA, packed
    segments, a window with sinks."""
    from tests.ops.kernels.test_kernel_registry import _compare

    _compare(position, dtype, window=12, sinks=2, position_options=options)


@SLOW
@pytest.mark.parametrize(("position", "options"), MODEL_VARIANTS[::2])
def test_model_on_tpu_kernels_equals_naive(position: str, options: dict, monkeypatch) -> None:
    """The same on the TPU kernels (TPU interpret mode), float32."""
    from tests.ops.kernels.test_kernel_registry import _compare
    from tests.ops.kernels.test_tpu_kernels import _on_tpu_kernels

    traced = _on_tpu_kernels(monkeypatch)
    _compare(position, "float32", window=12, sinks=2, position_options=options)
    assert traced
