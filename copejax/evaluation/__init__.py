"""Evaluation programs and helpers: perplexity per position (``lm_eval``), length
extrapolation (``extrapolate``) and sampling (``sample``)."""
