"""Bridges to other frameworks: `memeff_jax.interop.torch` (PyTorch)."""
