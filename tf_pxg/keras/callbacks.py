"""`PrivacyCallback`: ε in the training logs, and stopping at a budget."""

from __future__ import annotations

import math
from typing import Optional

import keras

from tf_pxg import accounting


class PrivacyCallback(keras.callbacks.Callback):
  """Reports the privacy spent by DP-SGD training and enforces a budget.

  ε is computed with `tf_pxg.accounting.compute_epsilon` (Poisson-subsampled
  Gaussian, sampling rate `batch_size / num_examples`) from
  `model.optimizer.iterations`, the number of optimizer steps taken so far —
  including steps before a checkpoint restore and skipped (non-finite) steps,
  so the figure survives save/resume and stays conservative.

  At each epoch end `logs["epsilon"]` is set (progress bar, `History`,
  TensorBoard show it). With `target_epsilon`, after every batch the callback
  checks whether one more step would exceed the budget and if so sets
  `model.stop_training`, so training never spends more than `target_epsilon`.

  Args:
    num_examples: training set size.
    batch_size: (expected) batch size per global step.
    noise_multiplier: defaults to the model's effective `noise_multiplier`
      (its own or its DPOptimizer's).
    delta: the δ of (ε, δ)-DP.
    target_epsilon: optional budget; training stops before exceeding it.
    accountant: "rdp" or "pld".

  Raises:
    ValueError: at `on_train_begin` when even the next step would exceed
      `target_epsilon` (training would otherwise take one step over budget),
      or when no noise multiplier is known.
  """

  def __init__(self, num_examples: int, batch_size: int,
               noise_multiplier: Optional[float] = None, delta: float = 1e-5,
               target_epsilon: Optional[float] = None,
               accountant: str = "rdp"):
    super().__init__()
    if target_epsilon is not None and not target_epsilon > 0:
      raise ValueError(
          f"target_epsilon must be > 0; got {target_epsilon!r}.")
    self.num_examples = num_examples
    self.batch_size = batch_size
    self.delta = delta
    self.target_epsilon = target_epsilon
    self.accountant = accountant
    self._noise_multiplier = noise_multiplier
    self._max_steps_cache = {}
    # Validate the accounting arguments now rather than after an epoch.
    accounting.compute_epsilon(num_examples, batch_size,
                               noise_multiplier if noise_multiplier is not None
                               else 1.0, steps=0, delta=delta,
                               accountant=accountant)

  @property
  def noise_multiplier(self) -> float:
    if self._noise_multiplier is not None:
      return float(self._noise_multiplier)
    value = getattr(self.model, "noise_multiplier", None)
    if value is None:
      raise ValueError(
          "PrivacyCallback: the model has no `noise_multiplier` (it is not a "
          "tf_pxg DP model, or it has no DP settings); pass "
          "`noise_multiplier=` to the callback.")
    return float(value)

  def steps(self) -> int:
    """Optimizer steps taken so far (`model.optimizer.iterations`)."""
    return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

  def epsilon(self, steps: Optional[int] = None) -> float:
    """ε after `steps` steps (default: the steps taken so far)."""
    return accounting.compute_epsilon(
        self.num_examples, self.batch_size, self.noise_multiplier,
        steps=self.steps() if steps is None else steps, delta=self.delta,
        accountant=self.accountant)

  def max_steps(self) -> Optional[int]:
    """The most steps whose ε stays within `target_epsilon` (None: no target).

    Found by bisection on `compute_epsilon` (ε grows with the step count) and
    cached per noise multiplier, so the per-batch check is an integer compare.
    """
    if self.target_epsilon is None:
      return None
    key = self.noise_multiplier
    if self._max_steps_cache.get("key") != key:
      within = lambda s: self.epsilon(s) <= self.target_epsilon  # noqa: E731
      lo, hi = 0, 1
      while within(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:  # e.g. huge noise: effectively unbounded
          break
      while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
      self._max_steps_cache = {"key": key, "value": lo}
    return self._max_steps_cache["value"]

  def _next_step_over_budget(self) -> bool:
    if self.target_epsilon is None:
      return False
    return self.steps() + 1 > self.max_steps()

  def on_train_begin(self, logs=None):
    self.noise_multiplier  # noqa: B018  (raises now, not after an epoch)
    if self._next_step_over_budget():
      raise ValueError(
          f"PrivacyCallback: the budget target_epsilon={self.target_epsilon} "
          f"would be exceeded by the next step (ε after it: "
          f"{self.epsilon(self.steps() + 1):.4g}, {self.steps()} steps taken). "
          "Raise the budget or the noise_multiplier.")

  def on_train_batch_end(self, batch, logs=None):
    if self._next_step_over_budget():
      self.model.stop_training = True

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      eps = self.epsilon()
      logs["epsilon"] = eps if math.isfinite(eps) else float("inf")
