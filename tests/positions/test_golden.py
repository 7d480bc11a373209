"""Golden numbers for every registered position scheme (STYLE.md: "golden numbers carry a
message"), as gemma tests RoPE: each scheme's pure core on a fixed input (``golden_cases.py``)
must give the literals below, and so must the float64 formula written there from the paper.

The literals were computed once from those references and the cheapest of each scheme checked
by hand against the paper's formula (e.g. ALiBi's -m_0 (i - j) = -(1/16) 3 = -0.1875; T5's
bucket of distance 9 with 8 causal buckets, max_distance 16: 4 + floor(4 ln(9/4) / ln 4) = 6).
"""

from __future__ import annotations

import pytest

from copejax.positions import registry
from tests.positions.golden_cases import CASES

GOLDEN: dict[str, dict[str, float]] = {
    "alibi": {
        "h0_i3_j0": -0.1875,
        "h1_i3_j1": -0.0078125,
    },
    "cope": {
        "gate_h0_i3_j2": 0.4158095,
        "pos_h0_i3_j2": 1.107919,
        "term_h0_i3_j2": 1.489634,
        "term_h0_i3_j0": 1.029841,
    },
    "dape": {
        "h0_i3_j1": 0.6752092,
        "h1_i3_j1": 0.710968,
    },
    "fire": {
        "h0_i3_j1": 1.373822,
        "h1_i3_j1": -1.341175,
    },
    "fox": {
        "h0_i3_j0": -1.090644,
        "h1_i2_j1": -0.05129325,
        "h1_i3_j3": 0.0,
    },
    "kerple": {
        "log_h0_i3_j0": -1.374436,
        "power_h0_i3_j1": -2.12132,
        "power_h1_i2_j0": -2.0,
    },
    "learned": {
        "pos4_d1": -0.98,
        "pos2_d2": -0.92,
    },
    "nope": {
        "i2_j0": 0.1117802,
        "i2_j3": 0.0,
    },
    "path": {
        "h0_i3_j0": -0.7836421,
        "h1_i2_j1": -1.844985,
        "h1_i3_j3": 1.3296,  # q_3 . k_3: the empty product
    },
    "randomized": {
        "pos2_label": 40.0,
        "pos1_sin0": -0.9613975,
        "pos3_cos1": 0.9171208,
    },
    "relative": {
        "h1_i3_j2": 0.2655,
        "h1_i3_j0": 0.0,
    },
    "relative_capped": {
        "h1_i3_j2": 0.2655,
        "h1_i3_j0": 1.04655,
    },
    "rope": {
        "t3_f0": 0.1105256,
        "t3_f3": -0.49337,
        # (1 - g) 0.1 / 8 + g 0.1, g = (64 / (20 pi) - 1) / 3 = 0.0061979: 0.0130423 by hand.
        "llama3_theta2": 0.01304226,
        # 2/3 theta_1 + 1/3 theta_1 / 8, theta_1 = 10^-0.5: 0.210819 + 0.013176 = 0.223995.
        "yarn_index_theta1": 0.2239947,
    },
    "selective": {
        "relu_i4_j1": 1.77,
        "relu_i4_j0": 0.0,
        "sigmoid_i4_j2": 0.4255575,
        "pruned_i4_j1": -1e30,
        "budget_evicts_j0_at": 2.0,
        "budget_evicts_j1_at": 3.0,
        "budget_evicts_j2_at": 4.0,
        "budget_keeps_j3": 2.0**30,
    },
    "sinusoidal": {
        "pos3_d0": 0.14112,
        "pos2_d3": 0.9998,
    },
    "stickbreaking": {
        "i3_j2": 0.4378235,
        "i3_j0": 0.1759027,
        "leftover_i3": 0.2350812,
    },
    "t5": {
        "h0_d5": 8.0,
        "h1_d9": 13.0,
        "h0_d20": 14.0,
    },
    "tape": {
        "qk_t3_f0": 0.1105256,
        "mix_t2_m0_l0_r1": 0.7988464,
        "update_t2_m0_l1_r0": -0.4227366,
    },
    "transformer_xl": {
        "h1_i3_j1": 0.9366396,
    },
    "xpos": {
        "q_t3_f0": 0.04319286,
        "k_t2_f2": 1.469079,
    },
}

MESSAGE = (
    "golden number {scheme}/{label} changed: got {got!r}, pinned {pinned!r}. If the change is "
    "intended (a fix of the formula or of a default), recompute the value from the reference "
    "in tests/positions/golden_cases.py, check one by hand against the paper, and update "
    "GOLDEN in tests/positions/test_golden.py in the same commit, saying why. Otherwise a "
    "refactor changed the numbers: find out which."
)


def test_every_registered_scheme_has_golden_numbers() -> None:
    assert set(registry.names()) == set(GOLDEN) == set(CASES), (
        "a scheme was added or removed: give it a case in golden_cases.py and literals here"
    )


@pytest.mark.parametrize("scheme", sorted(GOLDEN))
def test_golden_numbers(scheme: str) -> None:
    values = CASES[scheme]()
    assert set(values) == set(GOLDEN[scheme])
    for label, (got, reference) in values.items():
        pinned = GOLDEN[scheme][label]
        message = MESSAGE.format(scheme=scheme, label=label, got=got, pinned=pinned)
        assert got == pytest.approx(pinned, rel=2e-6, abs=1e-7), message
        # The reference is float64 from the paper's formula; the core computes in float32.
        assert reference == pytest.approx(pinned, rel=2e-6, abs=1e-6), "reference: " + message
