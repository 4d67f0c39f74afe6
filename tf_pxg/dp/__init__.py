"""DP-SGD building blocks: per-example clipping factors and Gaussian noise.

Small pure functions that the Keras model and the custom-loop API both
compose: norms -> `clip_factors` -> clipped sum (accumulated over the
physical batches of a logical step by `LogicalStepAccumulator`) ->
`step_noise` / `add_gaussian_noise` (with `replica_noise_stddev` under a
strategy) -> divide by the (expected) batch size (`noisy_mean`).
Accounting lives in `tf_pxg.accounting`.
"""

from tf_pxg.dp.accumulation import LogicalStepAccumulator
from tf_pxg.dp.accumulation import noisy_mean
from tf_pxg.dp.accumulation import step_noise
from tf_pxg.dp.clipping import clip_factors
from tf_pxg.dp.noise import add_gaussian_noise
from tf_pxg.dp.noise import box_muller_normal
from tf_pxg.dp.noise import densify
from tf_pxg.dp.noise import make_generator
from tf_pxg.dp.noise import replica_noise_stddev
from tf_pxg.dp.noise import replica_seed
from tf_pxg.dp.sparse_selection import DPAdaFEST
from tf_pxg.dp.sparse_selection import DPFEST

__all__ = [
    "DPAdaFEST",
    "DPFEST",
    "LogicalStepAccumulator",
    "add_gaussian_noise",
    "box_muller_normal",
    "densify",
    "clip_factors",
    "make_generator",
    "noisy_mean",
    "replica_noise_stddev",
    "replica_seed",
    "step_noise",
]
