"""DP-SGD building blocks: per-example clipping factors and Gaussian noise.

Small pure functions that the Keras model and the custom-loop API both
compose: norms -> `clip_factors` -> clipped sum -> `add_gaussian_noise` (with
`replica_noise_stddev` under a strategy) -> divide by the batch size.
Accounting lives in `tf_pxg.accounting`.
"""

from tf_pxg.dp.clipping import clip_factors
from tf_pxg.dp.noise import add_gaussian_noise
from tf_pxg.dp.noise import box_muller_normal
from tf_pxg.dp.noise import make_generator
from tf_pxg.dp.noise import replica_noise_stddev
from tf_pxg.dp.noise import replica_seed

__all__ = [
    "add_gaussian_noise",
    "box_muller_normal",
    "clip_factors",
    "make_generator",
    "replica_noise_stddev",
    "replica_seed",
]
