"""The score each run of a DP search releases, and what it costs.

The search picks its winner by a score, so the score is one of the run's
outputs and must be inside the run's DP event (Papernot and Steinke's Q
outputs the pair (model, score)). Three sources, each stated in the
search's result (`SearchResult.score_source`):

* `NoisyTrainingLoss()`: the last epoch's training `loss` that the run's
  `tf_pxg.keras.NoisyLoss` logged (per-example losses clamped to
  `[0, bound]`, summed, Gaussian-noised once per step): already inside
  the run's σ (`tf_pxg.dp.noisy_loss`), so it costs no extra ε. Lower is
  better.
* `PrivateValidation(x, y, noise_multiplier=z)`: a metric on held-out
  *private* rows, released as

      score = (Σ_i clamp(m_i, 0, bound) + N(0, (z · bound)²)) / n_val

  with `n_val = len(x)` public. Adding or removing one held-out row moves
  the sum by at most `bound`: a Gaussian mechanism of sensitivity `bound`
  and noise multiplier z, `GaussianDpEvent(z)`, composed into the per-run
  event with the training run's (a row is in the training or the held-out
  set; composing both bounds either case). The score's noise std is
  `z · bound / n_val` (`stddev`). Higher is better for "accuracy".
* `PublicValidation(x, y)`: the exact metric on rows the user declares
  public; nothing is added to ε, and the result says the score was
  computed on declared-public data.

Per-example metrics: "accuracy" (argmax of the model's output against an
integer label; 0 or 1, bound 1), "loss" (the model's compiled loss per
example, clamped to `[0, bound]`, score = minus the mean: higher is
better), or a callable `(y_true, y_pred) -> [n]` values in `[0, bound]`
(higher is better).

The validation noise comes from a numpy `Generator` seeded afresh from OS
entropy (`secrets`) for every release, so no generator state is left that
counts the releases (that is, the runs); a `seed` (tests) uses one
generator. (Floating-point attacks on
textbook Gaussian sampling, Mironov 2012, are not defended here; the
training noise has `secure_mode`.)
"""

from __future__ import annotations

import copy
import math
import secrets
from typing import Callable, Optional, Union

import dp_accounting
import numpy as np

__all__ = ["NoisyTrainingLoss", "PrivateValidation", "PublicValidation",
           "Score"]

Metric = Union[str, Callable]


class Score:
  """How a run is scored (module docstring).

  Attributes:
    direction: "max" or "min": which score wins.
    event: the score release's own `DpEvent` (None: inside the training
      run's event, or not a private release).
    source: one line for the result: where the score comes from.
  """

  direction = "max"
  event: Optional[dp_accounting.DpEvent] = None
  source = ""

  def for_run(self) -> "Score":
    """The score one run releases with, in its own process: itself, or,
    seeded (tests), a copy whose generator is seeded from this one's (so
    the runs' noises stay independent, as one generator would make them
    in one process)."""
    rng = getattr(self, "_rng", None)
    if rng is None:
      return self
    run = copy.copy(self)
    run._rng = np.random.default_rng(int(rng.integers(2**63)))  # pylint: disable=protected-access
    return run

  def stddev(self, model=None) -> Optional[float]:
    """The score's noise std (None: not a closed form here)."""
    del model
    return None

  def release(self, model) -> float:
    """The score of a trained run's `model`."""
    raise NotImplementedError

  def better(self, a: float, b: float) -> bool:
    """Whether score `a` beats `b` (a NaN never wins; ties keep `b`)."""
    if math.isnan(a):
      return False
    if math.isnan(b):
      return True
    return a > b if self.direction == "max" else a < b


class NoisyTrainingLoss(Score):
  """The run's own noised training loss (`NoisyLoss`), last epoch.

  The run must train with `noisy_loss=tf_pxg.keras.NoisyLoss(...)` (the
  keras-tuner tuner sets it up for a plain model it makes private).

  Args:
    bound: for a model the tuner makes private: the `NoisyLoss` bound.
    noise_factor: ... and its noise multiplier, as a multiple of the run's
      σ (10: the gradient keeps 99.5 % of the budget).
  """

  direction = "min"
  source = ("noised training loss of the last epoch (tf_pxg.keras.NoisyLoss; "
            "inside each run's ε)")

  def __init__(self, bound: float = 5.0, noise_factor: float = 10.0):
    if not (isinstance(bound, (int, float)) and bound > 0 and
            isinstance(noise_factor, (int, float)) and noise_factor > 1):
      raise ValueError(f"NoisyTrainingLoss: bound must be > 0 and "
                       f"noise_factor > 1; got {bound!r}, {noise_factor!r}.")
    self.bound = float(bound)
    self.noise_factor = float(noise_factor)

  def __repr__(self):
    return (f"NoisyTrainingLoss(bound={self.bound!r}, "
            f"noise_factor={self.noise_factor!r})")

  def release(self, model) -> float:
    history = getattr(getattr(model, "history", None), "history", None) or {}
    losses = history.get("loss")
    if not losses:
      raise ValueError(
          "NoisyTrainingLoss: the run's model logged no training `loss`: a "
          "DP model logs one only with noisy_loss=tf_pxg.keras.NoisyLoss("
          "bound, noise_multiplier) (its noised, accounted loss). Build the "
          "run's model with it, or score on validation data.")
    return float(losses[-1])


def _per_example(metric: Metric, model, x, y) -> np.ndarray:
  """`[n]` per-example metric values (module docstring)."""
  if callable(metric):
    return np.asarray(metric(y, model.predict(x, verbose=0)),
                      dtype=np.float64).reshape(-1)
  if metric == "accuracy":
    pred = np.asarray(model.predict(x, verbose=0))
    return (pred.argmax(-1).reshape(-1) ==
            np.asarray(y).reshape(-1)).astype(np.float64)
  if metric == "loss":
    from tf_pxg.keras import losses as pe_losses  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    values = pe_losses.per_example_losses(
        model, tf.convert_to_tensor(y), model(x, training=False))
    return -np.asarray(values, dtype=np.float64).reshape(-1)
  raise ValueError(f"unknown metric {metric!r}: use 'accuracy', 'loss' or "
                   "a callable (y_true, y_pred) -> per-example values.")


def _check_data(x, y, where: str) -> int:
  n = len(x)
  if n < 1 or len(y) != n:
    raise ValueError(f"{where}: x and y must hold the same number (>= 1) of "
                     f"rows; got {n} and {len(y)}.")
  return n


class PrivateValidation(Score):
  """A noised metric on private held-out rows (module docstring).

  Args:
    x, y: the held-out rows (numpy arrays), not used for training.
    noise_multiplier: z; the release's noise std is `z * bound / len(x)`.
    metric: "accuracy" (default), "loss" or a callable.
    bound: each example's metric is clamped to `[0, bound]` ("loss":
      `[-bound, 0]`).
    seed: seeds the noise (tests); default OS entropy.

  Raises:
    ValueError: z not > 0, bound not > 0, or x and y of other lengths.
  """

  def __init__(self, x, y, noise_multiplier: float, metric: Metric =
               "accuracy", bound: float = 1.0, seed: Optional[int] = None):
    if not (isinstance(noise_multiplier, (int, float)) and
            math.isfinite(noise_multiplier) and noise_multiplier > 0):
      raise ValueError(f"PrivateValidation: noise_multiplier must be a "
                       f"finite number > 0; got {noise_multiplier!r}.")
    if not (isinstance(bound, (int, float)) and bound > 0):
      raise ValueError(f"PrivateValidation: bound must be > 0; got "
                       f"{bound!r}.")
    self.num_examples = _check_data(x, y, "PrivateValidation")
    self._x, self._y = x, y
    self.metric, self.bound = metric, float(bound)
    self.noise_multiplier = float(noise_multiplier)
    self.event = dp_accounting.GaussianDpEvent(self.noise_multiplier)
    self.source = (f"{metric} on {self.num_examples} private held-out rows, "
                   f"clamped to [0, {self.bound:g}], Gaussian noise "
                   f"(multiplier {self.noise_multiplier:g}) inside each "
                   "run's ε")
    # Seeded (tests): one generator. Else a fresh OS-entropy seed per
    # release, so no generator state counts the releases (the runs).
    self._rng = None if seed is None else np.random.default_rng(seed)

  def __repr__(self):
    return (f"PrivateValidation(<{self.num_examples} rows>, noise_multiplier"
            f"={self.noise_multiplier!r}, metric={self.metric!r}, "
            f"bound={self.bound!r})")

  def stddev(self, model=None) -> float:
    del model
    return self.noise_multiplier * self.bound / self.num_examples

  def noised_mean(self, values: np.ndarray) -> float:
    """The release for per-example `values` (clamped, summed, noised,
    divided by the public count)."""
    sign = -1.0 if self.metric == "loss" else 1.0
    clamped = np.clip(sign * values, 0.0, self.bound)
    rng = self._rng or np.random.default_rng(secrets.randbits(128))
    noise = rng.normal(0.0, self.noise_multiplier * self.bound)
    return sign * float((clamped.sum() + noise) / self.num_examples)

  def release(self, model) -> float:
    return self.noised_mean(_per_example(self.metric, model, self._x,
                                         self._y))


class PublicValidation(Score):
  """The exact metric on rows the user declares public (not covered by ε:
  the result says so).

  Args:
    x, y: the public rows.
    metric: "accuracy" (default), "loss" or a callable.
  """

  def __init__(self, x, y, metric: Metric = "accuracy"):
    self.num_examples = _check_data(x, y, "PublicValidation")
    self._x, self._y, self.metric = x, y, metric
    self.source = (f"{metric} on {self.num_examples} rows DECLARED PUBLIC by "
                   "the user (exact, not noised; ε assumes they are not "
                   "private)")

  def __repr__(self):
    return (f"PublicValidation(<{self.num_examples} rows>, "
            f"metric={self.metric!r})")

  def stddev(self, model=None) -> float:
    del model
    return 0.0

  def release(self, model) -> float:
    return float(np.mean(_per_example(self.metric, model, self._x, self._y)))
