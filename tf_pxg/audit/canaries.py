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
* Gradient ("Dirac") canaries, which put a chosen gradient into one
  coordinate at every step, give the tightest bounds in Steinke et al.
  but need access to the training step's gradients, not the model's
  inputs; they are not offered here.

**Scores.** `score="loss"` scores a canary by minus its loss under the
final model; `score="loss_change"` by its loss before training minus its
loss after (removes each canary's own starting point). Higher means
"looks included". The loss is the model's compiled loss per example
(`tf_pxg.keras.losses.per_example_losses`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import numpy as np

from tf_pxg.audit.auditor import CanaryScoreAuditor

__all__ = ["CanaryCallback"]

_SCORES = ("loss", "loss_change")


class CanaryCallback(keras.callbacks.Callback):
  """m canaries, each included with probability 1/2, scored after `fit`.

  Args:
    x, y: the m canaries (arrays with the data's structure; `y` labels).
    score: "loss" (minus the final loss) or "loss_change" (initial minus
      final loss).
    seed: seeds the inclusion coin flips (tests); default OS entropy.
    batch_size: rows per batch when scoring.

  Attributes:
    included: bool `[m]`, which canaries `insert` adds.
    auditor: the `CanaryScoreAuditor` built at `on_train_end` (None before).
    scores: the scores `[m]` (None before).

  Raises:
    ValueError: fewer than 2 canaries, an unknown `score`, or `x`/`y`
      lengths that differ.
  """

  def __init__(self, x, y, *, score: str = "loss",
               seed: Optional[int] = None, batch_size: int = 512):
    super().__init__()
    x = np.asarray(x)
    y = np.asarray(y)
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
    self.scores = None
    self.auditor = None
    self._initial_losses = None

  @property
  def num_canaries(self) -> int:
    return len(self.x)

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

  def insert(self, x, y):
    """`(x, y)` with the included canaries appended (N grows by
    `num_included`; pass the new length to the accountant)."""
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
    returns (and stores) the auditor."""
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
    if self.score == "loss_change":
      self._initial_losses = self.losses(self.model)

  def on_train_end(self, logs=None):
    self.audit(self.model)
