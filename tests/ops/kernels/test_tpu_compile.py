"""The TPU kernels compile for real TPUs, Mosaic's own passes included, without a TPU.

TPU interpret mode and the export to ``platforms=["tpu"]`` (the other TPU tests) stop before
Mosaic's layout passes, which run only where libtpu compiles the program; they are where a
relayout a TPU generation lacks fails (a (Q, 1) <-> (1, Q) reshape is a sublane gather, which
v4 has not: ``copejax/ops/kernels/tpu_rows.py``). libtpu compiles for compile-only chips of a
named TPU slice on a CPU (``experiments/kernel_tpu.py``). ``python3 dev.py test`` installs the
libtpu that the pinned jax's ``[tpu]`` extra names into ``.libtpu``, outside ``.venv``; the
compiles run in a child process that alone has it on its path. Here: one scheme per kernel
family on v4 in bfloat16 but PaTH (see ``V4_FAMILIES``), with XLA's least optimisation effort
(``FAST_COMPILE``). Slow: the same on v5e with PaTH (over a minute on 2 CPU cores), and every
covered scheme (the registry, so a new scheme is compiled too, or refused by
``kernel_refusal``) on v4, v5e, v5p and v6e in bfloat16 and float32, as a TPU job compiles
them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LIBTPU_DIR = ROOT / ".libtpu"
# One scheme per kernel family: the softmax alone, per-query values with table parameters,
# stick-breaking with parameters, CoPE's carried count, selective attention with per-query
# values, PaTH's levels (a query offset), TAPE's value columns, XL's wider queries, FIRE's MLP,
# Shaw's table (its bands by DMA, the lane rotations, the gradient slab).
FAMILIES = (
    "nope",
    "fox+t5",
    "alibi+stickbreaking",
    "cope",
    "selective+fox",
    "path+fox",
    "tape",
    "transformer_xl",
    "fire",
    "relative_capped",
)


COMPILE_TIMEOUT_S = 30  # per (generation, scheme, dtype) row
# XLA's optimisation effort for the one-scheme-per-family compiles (jax's
# ``exec_time_optimization_effort``, -1 the least). Mosaic lowers and compiles every kernel
# body as before (the layout passes these tests are for); XLA spends less on the program
# around them. On this project's 2-core CPU, the two generations side by side: v5e 105 ->
# 89 s, v4 67 -> 64 s; PaTH-FoX alone 34 -> 17-24 s. The all-scheme test keeps the default
# effort, as a TPU job compiles.
FAST_COMPILE = {"JAX_EXEC_TIME_OPTIMIZATION_EFFORT": "-1"}


def _compile(
    generations: str, schemes: str, dtypes: str, env: dict[str, str] | None = None
) -> list[dict]:
    """Rows of ``experiments.kernel_tpu.compile_rows``, run in a child process with libtpu
    and ``env`` on top of this process's environment."""
    if not (LIBTPU_DIR / "libtpu").is_dir():
        pytest.skip(f"no libtpu in {LIBTPU_DIR}: python3 dev.py test installs it")
    child = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    child.update(
        env or {},
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(LIBTPU_DIR)]),
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",  # pytest-xdist's workers may each hold libtpu
    )
    code = (
        "import sys; from experiments.kernel_tpu import compile_rows; "
        "compile_rows(*(arg.split(',') for arg in sys.argv[1:]))"
    )
    # A compile takes 2-14 s here, more on a loaded machine: the slow test's 208 took over
    # 1800 s beside other work, so the limit grows with the rows instead of being fixed.
    count = len(generations.split(",")) * len(schemes.split(",")) * len(dtypes.split(","))
    done = subprocess.run(
        [sys.executable, "-c", code, generations, schemes, dtypes],
        check=False,
        cwd=ROOT,
        env=child,
        capture_output=True,
        text=True,
        timeout=120 + COMPILE_TIMEOUT_S * count,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and rows, done.stderr[-3000:]
    return rows


def _assert_compiled(rows: list[dict]) -> None:
    failed = [r for r in rows if r["status"] != "ok"]
    assert not failed, "\n".join(
        f"{r['scheme']} {r['generation']} {r['dtype']}: {r}" for r in failed
    )


# PaTH's kernels are the softmax kernels run unchanged with a query offset in their plan
# (``copejax/ops/kernels/offset.py``), with FoX's term: on v4 the other families compile
# every kernel body it runs. Its own compile, about a third of a generation's here, is the
# XLA part of its log2(T / C) levels; it compiles in the slow tests (its lowering to Mosaic
# is test_tpu_path's).
V4_FAMILIES = tuple(family for family in FAMILIES if not family.startswith("path"))


# The default suite compiles for v4: its Mosaic lacks relayouts that later generations have
# (the sublane gather of ``copejax/ops/kernels/tpu_rows.py``), and every family carries such
# per-query rows. On this project's 2-core CPU, beside the suite's other worker: v4 49 s, v5e
# with PaTH 87 s (2026-12-08), over the minute that makes a test slow (pyproject.toml).
@pytest.mark.parametrize(
    ("generation", "families"),
    [pytest.param("v5e", FAMILIES, marks=pytest.mark.slow), ("v4", V4_FAMILIES)],
    ids=["v5e", "v4"],
)
def test_each_kernel_family_compiles(generation: str, families: tuple[str, ...]) -> None:
    rows = _compile(generation, ",".join(families), "bfloat16", env=FAST_COMPILE)
    assert [r["scheme"] for r in rows] == list(families)
    _assert_compiled(rows)
    assert all(r["kernels"] >= 3 for r in rows)  # forward, dq, dk / dv at least


@pytest.mark.slow
def test_every_covered_scheme_compiles_for_four_generations() -> None:
    from experiments.kernel_tpu import covered_schemes

    schemes = covered_schemes()
    rows = _compile("v4,v5e,v5p,v6e", ",".join(schemes), "bfloat16,float32")
    assert len(rows) == 8 * len(schemes)
    _assert_compiled(rows)
