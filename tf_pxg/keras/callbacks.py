"""`PrivacyCallback`: ε in the training logs, and stopping at a budget."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import keras

from tf_pxg import _renamed
from tf_pxg import accounting


def _held_out_hint(counted: int, sampled: int) -> str:
  """The mismatch error's hint when the callback counts more examples than
  fit samples from: rows held out for validation."""
  if counted <= sampled:
    return ""
  return (f" The callback counts {counted - sampled} more examples than fit "
          "trains on: if rows were held out for validation, num_examples "
          "is the number of training rows only (fit(validation_split=...) "
          "is refused under DP: pass validation_data from a held-out set).")


class PrivacyCallback(keras.callbacks.Callback):
  """Reports the privacy spent by DP-SGD training and enforces a budget.

  ε is computed with `tf_pxg.accounting.compute_epsilon` (Poisson-subsampled
  Gaussian, sampling rate `batch_size / num_examples`; with BandMF's b
  bands, `ceil(T / b)` compositions at rate `b batch_size / num_examples`)
  from
  `model.optimizer.iterations`, the number of optimizer steps (logical
  steps, with gradient accumulation) taken so far —
  including steps before a checkpoint restore, so the figure survives
  save/resume. Every step that counts in `iterations` applied an update and
  every update counts (a non-finite example does not skip a step: its clip
  factor is 0).

  The sampler: ε is `event_epsilon(sampler.dp_event(mechanism, sigma,
  T))` for the sampler of the model's plan (`model.dp_plan.sampler`: the
  `tf_pxg.data.samplers.Sampler` of the last `fit`, e.g. Poisson, cyclic
  Poisson, balls-in-bins, Beam shards, users), composed with the model's
  noise mechanism and nothing else; before any `fit` (a custom loop), the
  Poisson sampler at this callback's rate. A sampler that is not
  `certified` (shuffled batches) is refused or labelled (`allow_shuffled`).

  At each epoch end `logs["epsilon"]` is set (progress bar, `History`,
  TensorBoard show it).

  Budget. With `target_epsilon`, `on_train_begin` sets the model's step
  limit (`set_step_limit`) to `max_steps()`, the most logical steps whose ε
  is within the target (an absolute `iterations` count, so a resumed run
  with a restored `iterations` gets the rest of the budget). The compiled
  train step applies an update only while `iterations` is below it: the
  decision is made per physical batch inside the step, from the step
  count alone (data-independent), so no `steps_per_execution`,
  `accumulation_steps`, strategy or number of `fit` calls can take
  training past the budget; `on_train_batch_end` then also stops `fit`
  (Keras checks between executions; batches it still runs change
  nothing). `on_train_end` removes the limit, so a later `fit` without
  the callback is not silently frozen (a later `fit` with it sets it
  again). For a model without `set_step_limit` (not a tf_pxg DP model),
  only the per-execution stop remains, which may overshoot by up to
  `steps_per_execution - 1` steps.

  Args:
    num_examples: training set size (example-level ε).
    batch_size: (expected) batch size per global step (examples, or users
      with `num_users`).
    num_users: instead of `num_examples`, for `fit(user_ids=...,
      examples_per_user=k)`: U users Poisson-sampled at rate
      `batch_size / U`. The ε is then user-level (it bounds what training
      reveals about all of one user's examples together) and is logged
      under the key `epsilon_user_level` instead of `epsilon`.
    noise_multiplier: deprecated for a tf_pxg DP model: the callback reads
      the model's DP plan (`model.dp_plan`, its DPOptimizer's), the one
      place σ lives, and its privacy ledger. Give it only for a model
      without a plan (a custom loop over a plain Keras model); given for a
      DP model it warns (`DeprecationWarning`), and a value other than the
      plan's accounts only the single run it describes.
    delta: the δ of (ε, δ)-DP.
    target_epsilon: optional budget; training stops before exceeding it.
    accountant: "rdp" or "pld"; default (None): the model's plan's
      (`DPOptimizer(accountant=...)`, `model.dp_plan.accountant`; "rdp"
      unless set there). Given here, it wins over the plan's: the plan
      fixes the event (sampler, mechanism, σ, steps), and RDP and PLD each
      give an upper bound on the ε of that same event, so choosing either
      here claims nothing the run does not satisfy (`accountant` shows
      the one in use).
    min_separation: b of the participation the noise mechanism's ε needs
      (BandMF's bands, `tf_pxg.mf.BandedToeplitz`); default and, for a DP
      model, deprecated like `noise_multiplier`: the plan's (1 for
      DP-SGD). With b > 1, `fit` samples cyclically (b groups, step i from
      group i mod b, rate `B b / N`) and ε is that of `ceil(T / b)`
      compositions of the Poisson-subsampled Gaussian at that rate
      (`tf_pxg.accounting.compute_epsilon(..., min_separation=b)`).
      `num_bands` is its deprecated name.

    allow_shuffled: the ε above assumes Poisson sampling, the default data
      path of a DP model's `fit`. If `fit` is called with
      `sampling="shuffled"` (fixed batches), the callback raises at
      `on_train_begin` unless this is True; then it logs the same number
      under the key `epsilon_if_poisson` (not `epsilon`), because it is
      not a guarantee for shuffled batches (Chua et al., ICML 2024, show
      such batches can be much less private), and warns once.

  Raises:
    ValueError: at `on_train_begin` when even the next step would exceed
      `target_epsilon` (training would otherwise take one step over budget),
      when no noise multiplier is known, when `fit` trains on shuffled
      batches and `allow_shuffled` is False, or when `fit` samples with a
      rate other than `batch_size / num_examples`.
  """

  def __init__(self, num_examples: Optional[int] = None,
               batch_size: Optional[int] = None,
               noise_multiplier: Optional[float] = None, delta: float = 1e-5,
               target_epsilon: Optional[float] = None,
               accountant: Optional[str] = None,
               allow_shuffled: bool = False, *,
               num_users: Optional[int] = None,
               min_separation: Optional[int] = None,
               num_bands=_renamed.NOT_GIVEN):
    super().__init__()
    # The name the caller gave b by, for the messages.
    min_separation, self._separation_arg = _renamed.argument(
        min_separation, num_bands, new="min_separation", old="num_bands",
        where="PrivacyCallback", default=None)
    if target_epsilon is not None and not target_epsilon > 0:
      raise ValueError(
          f"target_epsilon must be > 0; got {target_epsilon!r}.")
    if (num_examples is None) == (num_users is None):
      raise ValueError(
          "PrivacyCallback needs exactly one of num_examples (example-level "
          "ε) and num_users (user-level ε, for fit(user_ids=...)).")
    if batch_size is None:
      raise ValueError("PrivacyCallback needs batch_size (the expected "
                       "number of examples, or users, per step).")
    # User-level: the population is the U users, sampled at rate B / U;
    # the ε then bounds what the model reveals about any one user.
    self.user_level = num_users is not None
    self.num_users = num_users
    if self.user_level:
      num_examples = num_users
    self.num_examples = num_examples
    self.batch_size = batch_size
    self.delta = delta
    self.target_epsilon = target_epsilon
    self._accountant = accountant
    self.allow_shuffled = allow_shuffled
    self._log_key = self._base_key()
    # Deprecated overrides of the plan's values (the Args above), read only
    # for a model without a plan or when they differ from it.
    self._noise_multiplier = noise_multiplier
    self._min_separation = min_separation
    self._warned_override = False
    self._max_steps_cache = {}
    # Validate the accounting arguments now rather than after an epoch.
    accounting.compute_epsilon(num_examples, batch_size,
                               noise_multiplier if noise_multiplier is not None
                               else 1.0, steps=0, delta=delta,
                               accountant=accountant or "rdp",
                               min_separation=min_separation or 1)

  @property
  def min_separation(self) -> int:
    """b of the noise mechanism: the plan's (the deprecated override if
    given; 1: DP-SGD)."""
    if self._min_separation is not None:
      return int(self._min_separation)
    plan = self._plan()
    return 1 if plan is None else int(plan.min_separation)

  num_bands = _renamed.alias("num_bands", "min_separation")

  def _warn_overrides(self) -> None:
    """Warns once if σ or b were given for a model with a DP plan."""
    if self._warned_override or self._plan() is None or (
        self._noise_multiplier is None and self._min_separation is None):
      return
    self._warned_override = True
    warnings.warn(
        "PrivacyCallback: noise_multiplier= and min_separation= (num_bands=) "
        "are deprecated for a tf_pxg DP model: the callback reads its DP "
        "plan (model.dp_plan) and privacy ledger, the one place σ and b "
        "live. Drop them; a value other than the plan's accounts only the "
        "single run it describes.", DeprecationWarning, stacklevel=3)

  @property
  def noise_multiplier(self) -> float:
    if self._noise_multiplier is not None:
      return float(self._noise_multiplier)
    plan = self._plan()
    value = None if plan is None else plan.noise_multiplier
    if value is None:
      raise ValueError(
          "PrivacyCallback: the model has no `noise_multiplier` (it is not a "
          "tf_pxg DP model, or it has no DP settings); pass "
          "`noise_multiplier=` to the callback.")
    return float(value)

  def steps(self) -> int:
    """Optimizer steps taken so far (`model.optimizer.iterations`)."""
    return int(self.model.optimizer.iterations.numpy())

  def _mechanism(self):
    """The model's noise mechanism (`dp_plan.mechanism`), else DP-SGD's or
    BandMF's for the given `min_separation`."""
    from tf_pxg.dp import mechanisms  # noqa: PLC0415
    plan = self._plan()
    if plan is not None and plan.min_separation == self.min_separation:
      return plan.mechanism
    if self.min_separation == 1:
      return mechanisms.IndependentGaussian()
    from tf_pxg import mf  # noqa: PLC0415
    return mechanisms.BandMF(mf.BandedToeplitz(self.min_separation))

  def _plan(self):
    """The model's `DPPlan` (None: not a tf_pxg DP model, or no model)."""
    from tf_pxg.dp import plan as dp_plan  # noqa: PLC0415
    plan = getattr(getattr(self, "model", None), "dp_plan", None)
    return plan if isinstance(plan, dp_plan.DPPlan) else None

  def _ledger(self):
    """The model's privacy ledger (None: not a compiled tf_pxg DP model),
    unless this callback is given a σ or a band count other than the
    model's plan (then it accounts the single run it was told about, as a
    custom loop's callback does); given the plan's own values, the ledger
    is read as without them."""
    model = getattr(self, "model", None)
    ledger = getattr(model, "privacy_ledger", None)
    plan = getattr(model, "dp_plan", None)
    if ledger is None or plan is None:
      return None
    if self._noise_multiplier is not None and (
        float(self._noise_multiplier) != plan.noise_multiplier):
      return None
    if self.min_separation != plan.min_separation:
      return None
    return ledger

  def _sampler(self):
    """The plan's `tf_pxg.data.samplers.Sampler` (the model's last `fit`'s
    unless the plan names one), or None (no `fit` yet, a custom loop)."""
    plan = self._plan()
    return None if plan is None else plan.sampler

  @property
  def accountant(self) -> str:
    """The accountant, "rdp" or "pld": the one given, else the plan's."""
    if self._accountant is not None:
      return self._accountant
    plan = self._plan()
    return "rdp" if plan is None else plan.accountant

  def epsilon(self, steps: Optional[int] = None) -> float:
    """ε after `steps` steps (default: the steps taken so far): the
    sampler's event composed with the mechanism's and nothing else
    (`sampler.dp_event(mechanism, ...)` for the sampler `fit` used, else
    cyclic Poisson at this callback's rate,
    `tf_pxg.accounting.mechanism_epsilon`)."""
    steps = self.steps() if steps is None else steps
    ledger = self._ledger()
    if ledger is not None and ledger.open_start is not None:
      # The model's whole history (tf_pxg.dp.ledger): every run's event,
      # the open one's at `steps` of the current optimizer.
      return ledger.epsilon(self.steps(), self.delta, self.accountant,
                            open_steps=steps - ledger.open_start)
    mechanism, sampler = self._mechanism(), self._sampler()
    if sampler is None or not sampler.certified:
      # No sampler known yet (or shuffled batches, `epsilon_if_poisson`):
      # the Poisson sampler at this callback's rate.
      return accounting.mechanism_epsilon(
          mechanism, self.num_examples, self.batch_size,
          self.noise_multiplier, steps, delta=self.delta,
          accountant=self.accountant)
    if steps == 0:
      return 0.0
    if self.noise_multiplier == 0.0:
      return math.inf
    return accounting.event_epsilon(
        sampler.dp_event(mechanism, self.noise_multiplier, steps),
        self.delta, self.accountant)

  def max_steps(self) -> Optional[int]:
    """The most steps whose ε stays within `target_epsilon` (None: no target).

    Found by bisection on `compute_epsilon` (ε grows with the step count) and
    cached per noise multiplier, so the per-batch check is an integer compare.
    """
    if self.target_epsilon is None:
      return None
    ledger = self._ledger()
    key = (self.noise_multiplier, self.min_separation, id(self._sampler()),
           self.accountant, None if ledger is None else ledger.to_json())
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

  def _base_key(self) -> str:
    return "epsilon_user_level" if self.user_level else "epsilon"

  def _check_sampling(self):
    """Matches the accounting to how the model's `fit` samples batches."""
    sampler = self._sampler()
    self._log_key = self._base_key()
    unit = None if sampler is None else sampler.privacy_unit
    if self.user_level and unit == "example":
      raise ValueError(
          "PrivacyCallback(num_users=...) reports user-level ε, but fit "
          "sampled examples, not users: pass user_ids= and "
          "examples_per_user= to fit, or num_examples= to the callback.")
    if not self.user_level and unit == "user":
      raise ValueError(
          "fit samples users (user_ids=...): give PrivacyCallback "
          "num_users=U (the ε is then per user), not num_examples.")
    if sampler is not None and not sampler.certified:
      if not self.allow_shuffled:
        raise ValueError(
            "PrivacyCallback: fit was called with sampling='shuffled' "
            "(fixed batches), but the ε it computes assumes Poisson "
            "sampling, which shuffled batches do not satisfy (they can be "
            "much less private). Use the default sampling='poisson', or pass "
            "allow_shuffled=True to log the Poisson figure as "
            "'epsilon_if_poisson' (not a guarantee).")
      self._log_key = "epsilon_if_poisson"
      warnings.warn(
          "PrivacyCallback: training on shuffled batches; the logged "
          "'epsilon_if_poisson' is the ε of Poisson sampling at rate "
          f"{self.batch_size}/{self.num_examples}, not a guarantee for "
          "these batches.", stacklevel=2)
    elif sampler is not None:
      groups = sampler.min_separation
      if groups != self.min_separation:
        plan = self._plan()
        raise ValueError(
            f"PrivacyCallback: accounts for {self._separation_arg}="
            f"{self.min_separation}, but fit sampled with {groups} cyclic "
            f"group(s) (the model's plan has min_separation="
            f"{1 if plan is None else plan.min_separation}). BandMF's ε "
            "needs b groups for b bands: leave min_separation unset (the "
            "plan's).")
      rate = self.batch_size * self.min_separation / self.num_examples
      if not math.isclose(rate, sampler.sampling_rate, rel_tol=1e-9):
        raise ValueError(
            f"PrivacyCallback: accounts for sampling rate {rate:.6g} "
            f"(batch_size={self.batch_size} * {self._separation_arg}="
            f"{self.min_separation} / "
            f"num_examples={self.num_examples}) but fit samples with rate "
            f"{sampler.sampling_rate:.6g} (batch_size="
            f"{sampler.expected_batch_size:g}, {sampler.num_examples} "
            "examples). Give the callback the same numbers."
            + _held_out_hint(self.num_examples, sampler.num_examples))

  def on_train_begin(self, logs=None):
    self._warn_overrides()
    self.noise_multiplier  # noqa: B018  (raises now, not after an epoch)
    self._check_sampling()
    if self._next_step_over_budget():
      raise ValueError(
          f"PrivacyCallback: the budget target_epsilon={self.target_epsilon} "
          f"would be exceeded by the next step (ε after it: "
          f"{self.epsilon(self.steps() + 1):.4g}, {self.steps()} steps taken). "
          "Raise the budget or the noise_multiplier.")
    if self.target_epsilon is not None and hasattr(self.model,
                                                   "set_step_limit"):
      self.model.set_step_limit(self.max_steps())
    if getattr(self.model, "unprotected_training_metrics", False):
      warnings.warn(
          f"PrivacyCallback: model {self.model.name!r} logs "
          "unprotected_training_metrics (the 'unprotected_*' keys): they are "
          "computed on the private batches without noise and are NOT "
          f"covered by the logged {self._log_key}; do not publish them or "
          "let a callback decide on them. NoisyLoss gives a training loss "
          "inside ε.", stacklevel=2)

  def on_train_batch_end(self, batch, logs=None):
    if self._next_step_over_budget():
      self.model.stop_training = True

  def on_train_end(self, logs=None):
    if self.target_epsilon is not None and hasattr(self.model,
                                                   "set_step_limit"):
      self.model.set_step_limit(None)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      eps = self.epsilon()
      logs[self._log_key] = eps if math.isfinite(eps) else float("inf")
