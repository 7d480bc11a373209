"""README's "Use copejax in your own model" section runs: its python blocks, between the
section's two markers, are executed in order in one namespace, and the decoded outputs equal
one full call."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- own-model snippets:", "<!-- own-model snippets end -->"


def section_snippets() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index(START) : text.index(END)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_every_snippet_runs() -> None:
    snippets = section_snippets()
    assert len(snippets) >= 4, "the section lost its plain-JAX, Linen, NNX and decode snippets"
    namespace: dict = {"__name__": "readme"}
    for snippet in snippets:
        exec(compile(snippet, str(README), "exec"), namespace)
    cf, q, k, v, x = (namespace[n] for n in ("cf", "q", "k", "v", "x"))
    full = cf.attention(q, k, v, scheme="fox", params=namespace["fox"], x=x)
    np.testing.assert_allclose(namespace["y_prompt"], full[:, :6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(namespace["y_t"], full[:, -1:], rtol=1e-5, atol=1e-5)
    assert set(namespace["params"]) == {"q", "k", "v", "cope", "o"}
    assert namespace["y"].shape == q.shape and jnp.isfinite(namespace["y"]).all()
