"""Canaries for a one-run audit of a real `fit`: `CanaryCallback`.

    canaries = tf_pxg.audit.CanaryCallback.out_of_distribution(
        m=1000, input_shape=(8, 8, 1), num_classes=10)
    x_all, y_all = canaries.insert(x_train, y_train)     # N = len(x_all)
    model.fit(x_all, y_all, batch_size=B, epochs=E, callbacks=[
        canaries, dpk.PrivacyCallback(num_examples=len(x_all), ...)])
    auditor = canaries.auditor          # scored when training ended
    auditor.epsilon_one_run(significance=0.05, delta=δ)

**Inclusion.** Each of the m canaries is in the training set independently
with probability 1/2 (`included`, drawn from OS entropy unless `seed` is
given), the randomisation the one-run theorem needs
(`tf_pxg.audit.auditor`). `insert` appends the included ones to the data;
the accountant must count them (`num_examples=len(x_all)`), since DP
protects them as it protects every other example. The sampling rate
`q = batch_size / N` then depends on how many were drawn (one more canary
changes q by a factor (N+1)/N), as it does for any data set whose size is
treated as public; the accounting's add/remove adjacency takes q as given.

**Which canaries.** Through the public model API the auditor sees only the
final model (black box), so a canary is an input and a label:

* `out_of_distribution` (the default of `examples/audit_digits.py`):
  inputs drawn uniformly from the data's value range, each with a random
  label. No real example resembles them, so nothing but the canary itself
  pulls the model towards its label: an included canary's loss falls, an
  excluded one's stays at the chance level. This gives the cleanest
  separation of the kinds here — in the digits example with the noise
  removed, OOD canaries (m = 250) gave a two-sided one-run bound of 2.55
  and AUROC 0.97 where mislabelled test images (m = 360) gave 1.11 and
  0.82 (see `docs/auditing.md`).
* `mislabelled`: real inputs with a wrong label. The other examples of the
  true class pull against the canary, so it is memorised only late and
  partly.

**Gradient canaries** (`CanaryCallback.gradient`, white box): per-example
gradients set directly inside the train step (a Dirac vector on a random
coordinate, or a random direction, of norm ≥ C), each canary "in" with
probability 1/2 and then Poisson-sampled into logical steps as an example
is. They audit the mechanism (clip, noise, sampling, accounting), not the
model's memorisation: see `tf_pxg.audit.gradient_canaries`. Nothing is
inserted into the data; the accountant's N and q are the data's. The score
is the released update's projection on the canary's direction, read from
the weights after every logical step: with plain SGD (no momentum) the
weight change is `-lr` times the released noisy mean gradient, so the
projection is exactly the released gradient's; with another optimizer it is
a post-processing of it (still a valid score, a weaker one).

**Scores.** Input canaries: `score="loss"` scores a canary by minus its
loss under the final model; `score="loss_change"` by its loss before
training minus its loss after (removes each canary's own starting point).
The loss is the model's compiled loss per example
(`tf_pxg.keras.losses.per_example_losses`). Gradient canaries:
`score="sum"` is `Σ_t x_t`, the projections summed over the logical steps;
`score="likelihood"` is `Σ_t log(1 - q + q exp(μ₁ z_t - μ₁²/2))`, the
log-likelihood ratio of a Poisson-sampled Gaussian step under the claim
(μ₁ = 1/σ: a clipped canary of norm C against noise σC; `z_t = x_t` over
the projections' standard deviation), which weighs the steps where a
canary stands out. Any score is valid (a function of the released
updates); the likelihood is the most powerful one against the claimed
mechanism. Higher means "looks included".
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import numpy as np

from tf_pxg import _renamed
from tf_pxg.audit import gradient_canaries as gc
from tf_pxg.audit.auditor import CanaryScoreAuditor

__all__ = ["CanaryCallback"]

_SCORES = ("loss", "loss_change")
_GRADIENT_SCORES = ("sum", "likelihood")


class CanaryCallback(keras.callbacks.Callback):
  """m canaries, each included with probability 1/2, scored after `fit`.

  Args:
    x, y: the m input canaries (arrays with the data's structure; `y`
      labels); or None with `gradient`.
    gradient: `tf_pxg.audit.gradient_canaries.GradientCanaries` instead of
      inputs (made by `CanaryCallback.gradient`).
    score: input canaries: "loss" (minus the final loss) or "loss_change"
      (initial minus final loss); gradient canaries: "sum" or
      "likelihood" (module docstring).
    seed: seeds the inclusion coin flips (tests); default OS entropy.
    batch_size: rows per batch when scoring input canaries.
    noise_multiplier: σ of the claim, for `score="likelihood"`.

  Attributes:
    included: bool `[m]`, which canaries are in (`insert` adds them, or
      the train step adds their gradients).
    auditor: the `CanaryScoreAuditor` built at `on_train_end` (None before).
    scores: the scores `[m]` (None before).
    projections: gradient canaries: float32 `[T, m]`, each logical step's
      released update projected on each canary's signed direction.

  Raises:
    ValueError: fewer than 2 canaries, an unknown `score`, `x`/`y` lengths
      that differ, or both or neither of inputs and `gradient`.
  """

  def __init__(self, x=None, y=None, *, score: Optional[str] = None,
               seed: Optional[int] = None, batch_size: int = 512,
               gradient: Optional[gc.GradientCanaries] = None,
               noise_multiplier: Optional[float] = None):
    super().__init__()
    self.gradient_canaries = gradient
    self.scores = None
    self.auditor = None
    self.projections = None
    self._initial_losses = None
    if gradient is not None:
      if x is not None or y is not None:
        raise ValueError("give input canaries (x, y) or gradient canaries, "
                         "not both.")
      self._init_gradient(gradient, score or "sum", noise_multiplier)
      return
    x = np.asarray(x)
    y = np.asarray(y)
    score = score or "loss"
    if len(x) != len(y) or len(x) < 2:
      raise ValueError(f"need at least 2 canaries with one label each; got "
                       f"{len(x)} inputs and {len(y)} labels.")
    if score not in _SCORES:
      raise ValueError(f"score must be one of {_SCORES}; got {score!r}.")
    self.x, self.y = x, y
    self.score = score
    self.batch_size = batch_size
    rng = np.random.default_rng(seed)
    self.included = rng.random(len(x)) < 0.5

  def _init_gradient(self, gradient, score, noise_multiplier):
    if score not in _GRADIENT_SCORES:
      raise ValueError(f"gradient canaries' score must be one of "
                       f"{_GRADIENT_SCORES}; got {score!r}.")
    if score == "likelihood" and not noise_multiplier:
      raise ValueError("score='likelihood' needs the claimed "
                       "noise_multiplier (σ > 0).")
    self.score = score
    self.noise_multiplier = noise_multiplier
    self.included = gradient.included

  @property
  def num_canaries(self) -> int:
    return len(self.included)

  @property
  def num_included(self) -> int:
    return int(self.included.sum())

  # Construction ----------------------------------------------------------------

  @classmethod
  def out_of_distribution(cls, m: int, input_shape: Sequence[int],
                          num_classes: int, low: float = 0.0,
                          high: float = 1.0, *, seed: Optional[int] = None,
                          **kwargs) -> "CanaryCallback":
    """m inputs uniform on [low, high]^input_shape, random labels."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(low, high, (m, *input_shape)).astype("float32")
    y = rng.integers(0, num_classes, m).astype("int32")
    return cls(x, y, seed=None if seed is None else seed + 1, **kwargs)

  @classmethod
  def mislabelled(cls, x_pool, y_pool, m: int, num_classes: int, *,
                  seed: Optional[int] = None, **kwargs) -> "CanaryCallback":
    """m examples of `(x_pool, y_pool)` (drawn without replacement; keep
    them out of the training data) each with a wrong label, uniform over
    the other `num_classes - 1`."""
    rng = np.random.default_rng(seed)
    if m > len(x_pool):
      raise ValueError(f"m={m} canaries from a pool of {len(x_pool)}.")
    pick = rng.choice(len(x_pool), m, replace=False)
    y_true = np.asarray(y_pool)[pick].astype("int32")
    shift = rng.integers(1, num_classes, m).astype("int32")
    y = (y_true + shift) % num_classes
    return cls(np.asarray(x_pool)[pick], y,
               seed=None if seed is None else seed + 1, **kwargs)

  @classmethod
  def gradient(cls, m: int, norm: float, sampling_probability: float, *,
               min_separation: int = 1, direction: str = "dirac",
               score: str = "sum", noise_multiplier: Optional[float] = None,
               seed: Optional[int] = None,
               num_bands=_renamed.NOT_GIVEN) -> "CanaryCallback":
    """m gradient canaries (`tf_pxg.audit.gradient_canaries`).

    Args:
      m: the number of canaries.
      norm: each canary's gradient norm; give more than the clip C (e.g.
        100 C), so that a run that does not clip shows it.
      sampling_probability: q per logical step, as the accountant uses it.
      min_separation: BandMF's b (cyclic sampling), 1 for DP-SGD
        (`num_bands`: its deprecated name).
      direction: "dirac" (a random coordinate each, m ≤ parameters) or
        "random" (a random unit direction each).
      score: "sum" or "likelihood" (module docstring).
      noise_multiplier: the claimed σ, for `score="likelihood"`.
      seed: seeds everything random (tests); default OS entropy.
    """
    min_separation, _ = _renamed.argument(
        min_separation, num_bands, new="min_separation", old="num_bands",
        where="CanaryCallback.gradient", default=1)
    return cls(gradient=gc.GradientCanaries(
        m, norm, sampling_probability, min_separation=min_separation,
        direction=direction, seed=seed), score=score,
               noise_multiplier=noise_multiplier)

  def insert(self, x, y):
    """`(x, y)` with the included canaries appended (N grows by
    `num_included`; pass the new length to the accountant)."""
    if self.gradient_canaries is not None:
      raise ValueError("gradient canaries are not examples: nothing to "
                       "insert (the train step adds them).")
    keep = self.included
    return (np.concatenate([np.asarray(x), self.x[keep].astype(
        np.asarray(x).dtype)]),
            np.concatenate([np.asarray(y), self.y[keep].astype(
                np.asarray(y).dtype)]))

  # Scoring ---------------------------------------------------------------------

  def losses(self, model: keras.Model) -> np.ndarray:
    """Each canary's loss under `model`'s compiled loss, `[m]`."""
    import tensorflow as tf  # noqa: PLC0415
    from tf_pxg.keras import losses as pe_losses  # noqa: PLC0415
    out = []
    for start in range(0, len(self.x), self.batch_size):
      xb = self.x[start:start + self.batch_size]
      yb = tf.constant(self.y[start:start + self.batch_size])
      y_pred = model(xb, training=False)
      out.append(np.asarray(
          pe_losses.per_example_losses(model, yb, y_pred, None)))
    return np.concatenate(out).astype(np.float64)

  def audit(self, model: Optional[keras.Model] = None) -> CanaryScoreAuditor:
    """Scores the canaries under `model` (default: the callback's) and
    returns (and stores) the auditor. Gradient canaries: the auditor of
    the last `fit` (their scores come from its updates, not a model)."""
    if self.gradient_canaries is not None:
      if self.projections is None:
        raise ValueError("gradient canaries are scored from the updates of "
                         "the fit they were passed to; none has ended yet.")
      return self.auditor
    model = model if model is not None else self.model
    final = self.losses(model)
    if self.score == "loss":
      scores = -final
    else:
      if self._initial_losses is None:
        raise ValueError("score='loss_change' needs the losses before "
                         "training: pass the callback to fit.")
      scores = self._initial_losses - final
    # A canary memorised to a loss of exactly 0 (or an overflow) must not
    # make the score non-finite.
    scores = np.nan_to_num(scores, nan=-1e30, posinf=1e30, neginf=-1e30)
    self.scores = scores
    self.auditor = CanaryScoreAuditor(scores[self.included],
                                      scores[~self.included])
    return self.auditor

  def on_train_begin(self, logs=None):
    if self.gradient_canaries is not None:
      self._weights = _flat_weights(self.model)
      self._iterations = _iterations(self.model)
      self._steps = []
    elif self.score == "loss_change":
      self._initial_losses = self.losses(self.model)

  def on_train_batch_end(self, batch, logs=None):
    if self.gradient_canaries is None:
      return
    iterations = _iterations(self.model)
    if iterations == self._iterations:  # no update (mid logical step)
      return
    weights = _flat_weights(self.model)
    # SGD: w' - w = -lr g / normaliser, so -Δw projects like the gradient;
    # times the step's canary signs (tf_pxg.audit.gradient_canaries.signs).
    # float32 storage: [T, m] is 200 MB for m = 54 410 canaries over 899
    # steps (float64 would double it); the difference is taken in float64.
    step_signs = gc.signs(self.gradient_canaries, self._iterations).numpy()
    self._steps.append((step_signs * self.gradient_canaries.project(
        self._weights - weights)).astype(np.float32))
    self._weights, self._iterations = weights, iterations

  def on_train_end(self, logs=None):
    if self.gradient_canaries is None:
      self.audit(self.model)
      return
    gc.detach(self.model)
    if not self.gradient_canaries.traced:
      raise RuntimeError(
          "the gradient canaries never entered a train step: the model must "
          "be a tf_pxg DP model (DPModel, DPSequential, make_dp_model_class) "
          "trained with fit, with this callback passed to that fit.")
    self.projections = np.array(self._steps, dtype=np.float32).reshape(
        -1, self.num_canaries)
    self._steps = []
    self._score_gradient()

  def set_model(self, model):
    super().set_model(model)
    if self.gradient_canaries is not None:
      if not model.trainable_variables:
        raise ValueError("gradient canaries need a built model (its "
                         "trainable variables fix the directions): build "
                         "it, e.g. with keras.Input, before fit.")
      gc.attach(model, self.gradient_canaries)

  def _score_gradient(self):
    x = self.projections
    if self.score == "sum":
      scores = x.sum(axis=0, dtype=np.float64)
    else:
      q = self.gradient_canaries.sampling_probability
      mu = 1.0 / self.noise_multiplier
      scale = max(float(np.std(x, dtype=np.float64)), 1e-30)
      scores = np.zeros(x.shape[1])
      for step in x:   # one step at a time: no [T, m] float64 temporaries
        z = step.astype(np.float64) / scale
        scores += np.logaddexp(np.log1p(-q) if q < 1 else -np.inf,
                               np.log(q) + mu * z - mu * mu / 2)
    scores = np.nan_to_num(scores, nan=-1e30, posinf=1e30, neginf=-1e30)
    self.scores = scores
    self.auditor = CanaryScoreAuditor(scores[self.included],
                                      scores[~self.included])


def _flat_weights(model) -> np.ndarray:
  return np.concatenate([np.asarray(v.value.numpy(), np.float64).ravel()
                         for v in model.trainable_variables])


def _iterations(model) -> int:
  optimizer = model.optimizer
  optimizer = getattr(optimizer, "inner_optimizer", optimizer)
  return int(optimizer.iterations.numpy())
