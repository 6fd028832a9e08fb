"""Fused linear cross-entropy: the LM head's matmul and loss without the logits."""

from memeff_jax.ops.linear_cross_entropy.api import Aux
from memeff_jax.ops.linear_cross_entropy.api import IMPLEMENTATIONS
from memeff_jax.ops.linear_cross_entropy.api import Int64Labels
from memeff_jax.ops.linear_cross_entropy.api import linear_cross_entropy
from memeff_jax.ops.linear_cross_entropy.chunked_xla import ChunkedXla
from memeff_jax.ops.linear_cross_entropy.triton_softmax import SoftmaxKernelConfig
from memeff_jax.ops.linear_cross_entropy.pallas_mosaic_gpu import PallasMosaicGpu
from memeff_jax.ops.linear_cross_entropy.reference import Reference
