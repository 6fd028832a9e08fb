"""Flash-style attention: forward and backward without the [T, S] scores."""

from memeff_jax.ops.flash_attention._context import unzigzag
from memeff_jax.ops.flash_attention._context import zigzag
from memeff_jax.ops.flash_attention.api import flash_attention
from memeff_jax.ops.flash_attention.api import flash_attention_backward
from memeff_jax.ops.flash_attention.api import IMPLEMENTATIONS
from memeff_jax.ops.flash_attention.chunked_xla import ChunkedXla
from memeff_jax.ops.flash_attention.masks import MaskSpec
from memeff_jax.ops.flash_attention.mosaic_gpu_backward import MosaicBackwardConfig
from memeff_jax.ops.flash_attention.mosaic_gpu_dq import MosaicDqConfig
from memeff_jax.ops.flash_attention.pallas_mosaic_gpu import MosaicConfig
from memeff_jax.ops.flash_attention.pallas_mosaic_gpu import PallasMosaicGpu
from memeff_jax.ops.flash_attention.pallas_triton import PallasTriton
from memeff_jax.ops.flash_attention.reference import Reference
