"""TensorFlow Probability under DP: distribution heads and variational layers.

Optional: `pip install "tf_pxg[probability]"` (TF 2.16-2.17: see
docs/probability.md for the one command). Importing this package checks
that the installed TensorFlow Probability and tf-keras match TensorFlow
and raises an `ImportError` naming the versions and the fix otherwise
(`tf_pxg.probability._tfp_import`).

* Heads (`heads`): `Normal`, `StudentT`, `Poisson`, `NegativeBinomial`,
  `MixtureDensity`, `CensoredWeibull` map a last layer's `[B, num_params]`
  outputs to a TFP distribution per example.
* `NegativeLogLikelihood(head)` (`losses`): the Keras loss, one value per
  example, for `model.compile(loss=...)` on a `tf_pxg.keras.DPModel`
  (or any Keras model); a head may also be a function
  `params -> tfd.Distribution`.
* `DenseVariational` (`variational`): a mean-field Gaussian variational
  dense layer whose KL to the prior is a weight regularizer, so DP-SGD
  clips the likelihood and adds the KL outside the clip (DP-VI).

Importing it also registers TFP's literal tables (`constants`) so the
engine's example-mixing check does not take them for batches of data.
"""

from tf_pxg.probability._tfp_import import check as check_versions
from tf_pxg.probability import constants as _constants  # Registers lbeta's.
from tf_pxg.probability.heads import CensoredWeibull
from tf_pxg.probability.heads import Head
from tf_pxg.probability.heads import MixtureDensity
from tf_pxg.probability.heads import NegativeBinomial
from tf_pxg.probability.heads import Normal
from tf_pxg.probability.heads import Poisson
from tf_pxg.probability.heads import StudentT
from tf_pxg.probability.losses import NegativeLogLikelihood
from tf_pxg.probability.variational import DenseVariational
from tf_pxg.probability.variational import GaussianKLLoc
from tf_pxg.probability.variational import GaussianKLScale

__all__ = ["CensoredWeibull", "DenseVariational", "GaussianKLLoc",
           "GaussianKLScale", "Head", "MixtureDensity", "NegativeBinomial",
           "NegativeLogLikelihood", "Normal", "Poisson", "StudentT",
           "check_versions"]
