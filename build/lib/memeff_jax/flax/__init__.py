"""Flax layers: `memeff_jax.flax.linen` and `memeff_jax.flax.nnx`.

Both have `FusedLMHead` (parameters laid out exactly like `Dense`/`Linear`, so checkpoints
move either way) and `flash_attention_fn`, a drop-in `attention_fn` for the attention
modules.
"""
