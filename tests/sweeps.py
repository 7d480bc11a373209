"""Which cases of a registry-wide sweep run in the default suite.

The default suite (``python3 dev.py test``) must fit about 10 minutes on an idle 2-core machine
(issue 46). A registry-wide sweep whose cases cost seconds each runs, by default, one scheme
per site kind (``REPRESENTATIVE``: the sites of ``copejax.positions.base``) and CoPE, whose
count is carried across key blocks; its other cases are marked slow and run with
``python3 dev.py test-slow``. Every registered scheme keeps default coverage through the cheap
sweeps that take every scheme at one small shape (``tests/test_scheme_properties.py``,
``tests/test_blockwise_equivalence.py``, ``tests/test_decode.py``); ``tests/test_sweeps.py``
checks both rules.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from copejax.positions import registry

# One scheme for each site kind a scheme may use.
REPRESENTATIVE_BY_SITE = {
    "embed": "learned",
    "qk": "rope",
    "bias": "alibi",
    "normalizer": "stickbreaking",
    "output": "fox",
    "carry": "tape",
}
# Beyond the site kinds: the bias whose state is carried across key blocks.
REPRESENTATIVE = (*REPRESENTATIVE_BY_SITE.values(), "cope")


def schemes(names: Iterable[str] | None = None, fast: Iterable[str] = REPRESENTATIVE) -> list:
    """``pytest.param`` per scheme name (default: the whole registry), slow unless in
    ``fast``."""
    fast = set(fast)
    return [
        pytest.param(name, marks=() if name in fast else (pytest.mark.slow,), id=name)
        for name in (registry.names() if names is None else names)
    ]
