"""The rules of tests/sweeps.py: the representative schemes cover every site kind, and every
registered scheme stays in the default suite's cheap registry-wide sweeps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from copejax.positions import registry
from tests import sweeps

ROOT = Path(__file__).resolve().parents[1]


def test_representatives_cover_every_site_kind_of_the_registry() -> None:
    used = {site for name in registry.names() for site in registry.make_scheme(name).sites}
    assert used <= set(sweeps.REPRESENTATIVE_BY_SITE), (
        f"site kinds without a representative in tests/sweeps.py: "
        f"{sorted(used - set(sweeps.REPRESENTATIVE_BY_SITE))}"
    )
    for site, name in sweeps.REPRESENTATIVE_BY_SITE.items():
        assert site in registry.make_scheme(name).sites, (site, name)


def test_every_scheme_has_a_default_test() -> None:
    """Collect the default suite (slow tests deselected) and find each scheme in some test id."""
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_scheme_properties.py",
            "tests/test_blockwise_equivalence.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ids = [line for line in collected.splitlines() if "::" in line]

    def covered(name: str) -> bool:
        return any(re.search(rf"\[{re.escape(name)}[\]\-,]", i) for i in ids)

    missing = [name for name in registry.names() if not covered(name)]
    assert not missing, f"schemes with no default test: {missing}"
