"""Correlated noise for DP training: banded matrix factorization (BandMF).

`BandedToeplitz(num_bands=b)` is the strategy: a lower-triangular banded
Toeplitz matrix C with normalised columns whose inverse turns i.i.d.
Gaussian noise z into the correlated noise x = C⁻¹ z that each step adds
(streamed with b - 1 buffers). b = 1 is DP-SGD. Its ε comes from
`tf_pxg.accounting` with ``min_separation=b`` (amplified BandMF with cyclic
Poisson sampling). NumPy/SciPy only; no TensorFlow. See
docs/correlated_noise.md.
"""

from tf_pxg.mf.toeplitz import BandedToeplitz
from tf_pxg.mf.toeplitz import choose_num_bands
from tf_pxg.mf.toeplitz import DEFAULT_NUM_BANDS_CANDIDATES
from tf_pxg.mf.toeplitz import METHODS
from tf_pxg.mf.toeplitz import NumBandsChoice
from tf_pxg.mf.toeplitz import optimize_coefs
from tf_pxg.mf.toeplitz import sqrt_coefs

__all__ = [
    "BandedToeplitz",
    "DEFAULT_NUM_BANDS_CANDIDATES",
    "METHODS",
    "NumBandsChoice",
    "choose_num_bands",
    "optimize_coefs",
    "sqrt_coefs",
]
