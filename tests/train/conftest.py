"""The training tests compile the same tiny steps many times: share a compilation cache."""

from __future__ import annotations

import tempfile

import jax

jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="copejax-jit-cache-"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
