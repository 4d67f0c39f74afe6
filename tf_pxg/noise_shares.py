"""Shares of one Gaussian mechanism's noise among releases of one step.

Releases that see the same sampled batch on disjoint coordinates, each a
Gaussian mechanism of sensitivity 1 after scaling, compose into one
Gaussian mechanism whose noise multiplier σ satisfies σ⁻² = Σ_i σ_i⁻²
(Rényi divergences of Gaussians add in 1/σ²; Andrew et al. 2021,
Theorem 1, for quantile-adaptive clipping's count). The accounting
(`tf_pxg.accounting`) accounts σ; these functions give the shares.
"""

from __future__ import annotations

import math
import numbers


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)

def _check_positive_real(name: str, value) -> float:
  if not _is_real(value) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite number > 0; got {value!r}.")
  return float(value)


def split_noise_multipliers(noise_multiplier: float,
                            count_noise_multiplier: float) -> float:
  """The gradient noise multiplier σ_g left after the clipped count's share.

  Quantile-adaptive clipping (Andrew et al. 2021) releases at every step,
  for the same sampled batch, (1) the sum of gradients clipped to R plus
  Gaussian noise of std σ_g R (sensitivity R) and (2) the count of examples
  with ‖g‖ <= R, each contributing 1[‖g‖ <= R] - 1/2 (sensitivity 1/2
  under adding or removing one example), plus Gaussian noise of std σ_b =
  `count_noise_multiplier`. Scaling (1) by 1/R and (2) by 2 gives two
  Gaussian mechanisms of sensitivity 1 with noise multipliers σ_g and 2σ_b
  on disjoint coordinates; together they are one Gaussian mechanism with
  sensitivity 1 and noise multiplier σ,

      σ⁻² = σ_g⁻² + (2 σ_b)⁻²     (Andrew et al. 2021, Theorem 1),

  exactly (the Rényi divergences of Gaussians add in 1/σ², and both parts
  see the same sampled batch, so Poisson subsampling and BandMF rounds
  apply to the pair as to a single Gaussian: account the run with σ). So
  for the σ that the accounting gives (e.g. `noise_multiplier_for_epsilon`)
  and a chosen σ_b, the gradient gets

      σ_g = (σ⁻² - (2 σ_b)⁻²)^(-1/2)  >  σ.

  TensorFlow Federated's `adaptive_clip_noise_params` computes the same
  σ_g and also rejects σ >= 2 σ_b; Andrew et al. recommend σ_b = B / 20
  (as quoted in TF Privacy's `QuantileAdaptiveClipSumQuery`).

  Args:
    noise_multiplier: σ, the accounted noise multiplier; finite, > 0.
    count_noise_multiplier: σ_b, the std of the noise added to the clipped
      count (in count units, i.e. examples; TF Privacy's
      `clipped_count_stddev`); must be > σ / 2, finite.

  Returns:
    σ_g as a Python float, the noise multiplier to add to the gradient sum.

  Raises:
    ValueError: If an argument is not a finite number > 0, or if
      2 σ_b <= σ (the count alone would use the whole budget); the message
      gives the minimum σ_b.
  """
  sigma = _check_positive_real("noise_multiplier", noise_multiplier)
  sigma_b = _check_positive_real("count_noise_multiplier",
                                 count_noise_multiplier)
  if not 2.0 * sigma_b > sigma:
    raise ValueError(
        f"count_noise_multiplier={sigma_b!r} is too small for "
        f"noise_multiplier={sigma!r}: the count's noise multiplier "
        f"2 * count_noise_multiplier must exceed noise_multiplier, else the "
        f"count uses the whole privacy budget and no gradient noise is "
        f"enough. Use count_noise_multiplier > {sigma / 2!r} (noise_multiplier"
        f" / 2); a few times that leaves most of the budget to the gradient.")
  remainder = sigma**-2 - (2.0 * sigma_b)**-2
  return float(remainder**-0.5)


def combined_noise_multiplier(gradient_noise_multiplier: float,
                              count_noise_multiplier: float) -> float:
  """σ = (σ_g⁻² + (2 σ_b)⁻²)^(-1/2): the inverse of `split_noise_multipliers`.

  The noise multiplier to account a quantile-clipping run with when the
  gradient gets σ_g = `gradient_noise_multiplier` and the count σ_b =
  `count_noise_multiplier` (Andrew et al. 2021, Theorem 1; see
  `split_noise_multipliers`). σ < min(σ_g, 2 σ_b).

  Raises:
    ValueError: If an argument is not a finite number > 0.
  """
  sigma_g = _check_positive_real("gradient_noise_multiplier",
                                 gradient_noise_multiplier)
  sigma_b = _check_positive_real("count_noise_multiplier",
                                 count_noise_multiplier)
  return float((sigma_g**-2 + (2.0 * sigma_b)**-2)**-0.5)
