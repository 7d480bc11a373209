"""copejax: position encoding in transformers, in JAX/Flax."""
