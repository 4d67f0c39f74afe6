"""`PrivacyCallback`: ε in the training logs, and stopping at a budget."""

from __future__ import annotations

import json
import math
import warnings
from typing import Optional

import dp_accounting
import keras

from tf_pxg import _renamed
from tf_pxg import accounting
from tf_pxg import risk as risk_lib


# Where a DP model's value of each argument is set (the error's hint).
_WHERE_SET = {
    "noise_multiplier": "DPSGD(..., noise_multiplier={!r}), or the model's "
                        "noise_multiplier=",
    "min_separation": "noise_mechanism=tf_pxg.mf.BandedToeplitz({!r})",
    "accountant": "DPOptimizer(..., accountant={0!r}) or DPSGD(..., "
                  "accountant={0!r})",
}


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
  TensorBoard show it). With `log_risk=True` the same events are also
  logged in attack terms (`risk()`, `tf_pxg.risk`): `logs["mu_gdp"]` (μ
  of μ-GDP: exact for Gaussian compositions, else the dominating fit at
  `delta`) and `logs["tpr_at_fpr_0.001"]`, `logs["tpr_at_fpr_0.01"]` (the
  best membership attack's TPR at that FPR), with the ε key's suffix
  (`_user_level`, `_if_poisson`). They are computed with dp-accounting's
  PLD (a second or so per epoch for a run of ten thousand steps), so
  they are off by default.

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

  A DP model's `fit` adds one (`with_privacy_log`) unless one is given,
  so ε is logged with no callback; give one for the rest of its options.

  Args:
    num_examples: training set size (example-level ε). With neither it nor
      `num_users` nor `batch_size`, all three come from the sampler of the
      model's `fit` at `on_train_begin` (its N, expected batch size and
      privacy unit): give them only outside a DP model's `fit` (a custom
      loop), where there is no sampler.
    batch_size: (expected) batch size per global step (examples, or users
      with `num_users`); given with `num_examples` or `num_users`.
    num_users: instead of `num_examples`, for `fit(user_ids=...,
      examples_per_user=k)`: U users Poisson-sampled at rate
      `batch_size / U`. The ε is then user-level (it bounds what training
      reveals about all of one user's examples together) and is logged
      under the key `epsilon_user_level` instead of `epsilon`.
    noise_multiplier: only for a model without a DP plan (a custom loop
      over a plain Keras model), where it is the one source of σ. A
      tf_pxg DP model's σ is its plan's (`model.dp_plan`, owned by its
      `DPOptimizer`): the callback accounts the noise that plan adds and
      has no settings of its own. Given for a DP model it must equal the
      plan's (then it is redundant: a `DeprecationWarning`, it will be
      removed); another value raises (set it on the model or the
      optimizer, `DPSGD(..., noise_multiplier=...)`).
    delta: the δ of (ε, δ)-DP.
    target_epsilon: optional budget; training stops before exceeding it.
    accountant: "rdp" or "pld". For a DP model, its plan's
      (`DPOptimizer(accountant=...)`, `model.dp_plan.accountant`); given
      here it must equal it, like `noise_multiplier`. Without a plan,
      this one (default "rdp").
    min_separation: b of the participation the noise mechanism's ε needs
      (BandMF's bands, `tf_pxg.mf.BandedToeplitz`). For a DP model, its
      plan's (1 for DP-SGD; set with
      `noise_mechanism=tf_pxg.mf.BandedToeplitz(b)`); given here it must
      equal it, like `noise_multiplier`. Without a plan, this one
      (default 1). With b > 1, `fit` samples cyclically (b groups, step i
      from group i mod b, rate `B b / N`) and ε is that of `ceil(T / b)`
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
    log_risk: also log μ-GDP and the best attack's TPR at FPR 1e-3 and
      1e-2 at each epoch end (above). Default False.

  Raises:
    ValueError: `batch_size` without `num_examples` or `num_users`, or
      the converse, or both of those; the sampler's N needed (ε outside a
      DP model's `fit`, without a ledger) and none given;
      when `noise_multiplier`, `min_separation` or `accountant`
      is given and differs from the DP model's plan (at the first read of
      the plan: `on_train_begin`, before any step, or `epsilon()` /
      `max_steps()` after `set_model`); at `on_train_begin` when even the
      next step would exceed `target_epsilon` (training would otherwise
      take one step over budget), when no noise multiplier is known
      (neither a plan's nor the callback's), when `fit` trains on
      shuffled batches and `allow_shuffled` is False, or when `fit`
      samples with a rate other than `batch_size / num_examples`.
  """

  def __init__(self, num_examples: Optional[int] = None,
               batch_size: Optional[int] = None,
               noise_multiplier: Optional[float] = None, delta: float = 1e-5,
               target_epsilon: Optional[float] = None,
               accountant: Optional[str] = None,
               allow_shuffled: bool = False, *,
               num_users: Optional[int] = None,
               min_separation: Optional[int] = None,
               num_bands=_renamed.NOT_GIVEN,
               log_risk: bool = False):
    super().__init__()
    if not isinstance(log_risk, bool):
      raise TypeError(f"PrivacyCallback: log_risk must be True or False; "
                      f"got {log_risk!r}.")
    self.log_risk = log_risk
    # The name the caller gave b by, for the messages.
    min_separation, self._separation_arg = _renamed.argument(
        min_separation, num_bands, new="min_separation", old="num_bands",
        where="PrivacyCallback", default=None)
    if target_epsilon is not None and not target_epsilon > 0:
      raise ValueError(
          f"target_epsilon must be > 0; got {target_epsilon!r}.")
    # Neither N nor B: both from the sampler of the model's `fit`.
    self._from_sampler = (num_examples is None and num_users is None and
                          batch_size is None)
    if not self._from_sampler:
      if num_examples is not None and num_users is not None:
        raise ValueError(
            "PrivacyCallback takes one of num_examples (example-level ε) "
            "and num_users (user-level ε, for fit(user_ids=...)), not both.")
      if num_examples is None and num_users is None:
        raise ValueError(
            f"PrivacyCallback: batch_size={batch_size!r} without "
            "num_examples (or num_users): give both, or neither (then both "
            "are the sampler's of the model's fit).")
      if batch_size is None:
        raise ValueError(
            "PrivacyCallback: num_examples (or num_users) without "
            "batch_size (the expected number of examples, or users, per "
            "step): give both, or neither (then both are the sampler's of "
            "the model's fit).")
    # User-level: the population is the U users, sampled at rate B / U;
    # the ε then bounds what the model reveals about any one user. From
    # the sampler: its privacy unit (`_check_sampling`).
    self.user_level = num_users is not None
    self.num_users = num_users
    if self.user_level:
      num_examples = num_users
    self.num_examples = num_examples
    self.batch_size = batch_size
    # Added by `fit` (`with_privacy_log`), not by the user: on shuffled
    # batches it logs nothing rather than raise.
    self._added_by_fit = False
    self.delta = delta
    self.target_epsilon = target_epsilon
    self.allow_shuffled = allow_shuffled
    self._log_key = self._base_key()
    # The values given, by argument name and plan attribute: the only
    # source without a plan; with one, checked against it (`_plan`).
    self._noise_multiplier = noise_multiplier
    self._min_separation = min_separation
    self._accountant = accountant
    self._given = [(name, value, attribute) for name, value, attribute in (
        ("noise_multiplier", noise_multiplier, "noise_multiplier"),
        (self._separation_arg, min_separation, "min_separation"),
        ("accountant", accountant, "accountant")) if value is not None]
    self._warned_redundant = False
    self._max_steps_cache = {}
    # Validate the accounting arguments now rather than after an epoch.
    accounting.compute_epsilon(num_examples or 1, batch_size or 1,
                               noise_multiplier if noise_multiplier is not None
                               else 1.0, steps=0, delta=delta,
                               accountant=accountant or "rdp",
                               min_separation=min_separation or 1)

  @property
  def min_separation(self) -> int:
    """b of the noise mechanism: the plan's, else the one given (1:
    DP-SGD)."""
    plan = self._plan()
    if plan is not None:
      return int(plan.min_separation)
    return 1 if self._min_separation is None else int(self._min_separation)

  num_bands = _renamed.alias("num_bands", "min_separation")

  @property
  def noise_multiplier(self) -> float:
    """σ: the plan's, else the one given."""
    plan = self._plan()
    value = self._noise_multiplier if plan is None else plan.noise_multiplier
    if value is None:
      raise ValueError(
          "PrivacyCallback: no noise_multiplier: the model is not a tf_pxg "
          "DP model (then pass `noise_multiplier=` to the callback) or has "
          "no DP settings yet (give them to the model or compile it with a "
          "tf_pxg.keras.DPOptimizer).")
    return float(value)

  def steps(self) -> int:
    """Optimizer steps taken so far (`model.optimizer.iterations`)."""
    return int(self.model.optimizer.iterations.numpy())

  def _mechanism(self):
    """The model's noise mechanism (`dp_plan.mechanism`), else DP-SGD's or
    BandMF's for the given `min_separation`."""
    from tf_pxg.dp import mechanisms  # noqa: PLC0415
    plan = self._plan()
    if plan is not None:
      return plan.mechanism
    if self.min_separation == 1:
      return mechanisms.IndependentGaussian()
    from tf_pxg import mf  # noqa: PLC0415
    return mechanisms.BandMF(mf.BandedToeplitz(self.min_separation))

  def _plan(self):
    """The model's `DPPlan` (None: not a tf_pxg DP model, or no model),
    after checking the values given to the callback against it: equal,
    they are redundant (warned once); different, they raise."""
    from tf_pxg.dp import plan as dp_plan  # noqa: PLC0415
    plan = getattr(getattr(self, "model", None), "dp_plan", None)
    if not isinstance(plan, dp_plan.DPPlan):
      return None
    for name, value, attribute in self._given:
      planned = getattr(plan, attribute)
      if value != planned:
        raise ValueError(
            f"PrivacyCallback: {name}={value!r} differs from the model's DP "
            f"plan, {attribute}={planned!r}. The callback accounts the noise "
            "the model's DPOptimizer plan adds and has no settings of its "
            f"own: drop `{name}=` from the callback, or set it on the model "
            f"or its DPOptimizer ({_WHERE_SET[attribute].format(value)}).")
    if self._given and not self._warned_redundant:
      self._warned_redundant = True
      given = ", ".join(f"{name}={value!r}" for name, value, _ in self._given)
      warnings.warn(
          f"PrivacyCallback: {given} equal the model's DP plan "
          "(model.dp_plan), which the callback reads: the arguments are "
          "redundant and will be removed; drop them.", DeprecationWarning,
          stacklevel=3)
    return plan

  def _ledger(self):
    """The model's privacy ledger (None: not a compiled tf_pxg DP model)."""
    if self._plan() is None:
      return None
    return getattr(self.model, "privacy_ledger", None)

  def _sampler(self):
    """The plan's `tf_pxg.data.samplers.Sampler` (the model's last `fit`'s
    unless the plan names one), or None (no `fit` yet, a custom loop)."""
    plan = self._plan()
    return None if plan is None else plan.sampler

  @property
  def accountant(self) -> str:
    """The accountant, "rdp" or "pld": the plan's, else the one given
    (default "rdp")."""
    plan = self._plan()
    if plan is not None:
      return plan.accountant
    return self._accountant or "rdp"

  def epsilon(self, steps: Optional[int] = None) -> float:
    """ε after `steps` steps (default: the steps taken so far): the
    sampler's event composed with the mechanism's and nothing else
    (`sampler.dp_event(mechanism, ...)` for the sampler `fit` used, else
    cyclic Poisson at this callback's rate,
    `tf_pxg.accounting.mechanism_dp_event`; with a model's privacy
    ledger, its whole history): `_event(steps)`'s ε (0 for no steps, inf
    without noise)."""
    steps = self.steps() if steps is None else steps
    ledger = self._ledger()
    if ledger is not None and ledger.open is not None:
      return ledger.epsilon(self.delta, self.accountant,
                            extra_steps=steps - self.steps())
    if steps == 0:
      return 0.0
    if self.noise_multiplier == 0.0:
      return math.inf
    return accounting.event_epsilon(self._event(steps), self.delta,
                                    self.accountant)

  def risk(self, steps: Optional[int] = None) -> risk_lib.PrivacyRisk:
    """The events of `epsilon(steps)` in attack terms
    (`tf_pxg.risk.event_risk` at this callback's δ): μ-GDP and the best
    attack's TPR at FPR 1e-3 and 1e-2."""
    steps = self.steps() if steps is None else steps
    return risk_lib.event_risk(self._event(steps), self.delta)

  def _event(self, steps: int):
    """The composed DP event after `steps` steps (None: no ε claimed)."""
    ledger = self._ledger()
    if ledger is not None and ledger.open is not None:
      # The whole history behind the weights (tf_pxg.dp.ledger, settled
      # at the current count): every run's event, the open one's with the
      # steps up to `steps` of the current optimizer.
      return ledger.event(extra_steps=steps - self.steps())
    if steps == 0:
      return dp_accounting.NoOpDpEvent()
    mechanism, sampler = self._mechanism(), self._sampler()
    if sampler is None or not sampler.certified:
      # No sampler known yet (or shuffled batches, `epsilon_if_poisson`):
      # the Poisson sampler at this callback's rate.
      if self.num_examples is None:
        raise ValueError(
            "PrivacyCallback() takes num_examples and batch_size from the "
            "sampler of the model's fit, and the model has none (a custom "
            "loop, or no fit yet): pass num_examples= and batch_size=.")
      return accounting.mechanism_dp_event(
          mechanism, self.num_examples, self.batch_size,
          self.noise_multiplier, steps)
    return sampler.dp_event(mechanism, self.noise_multiplier, steps)

  def max_steps(self) -> Optional[int]:
    """The most steps whose ε stays within `target_epsilon` (None: no target).

    Found by bisection on `compute_epsilon` (ε grows with the step count) and
    cached per noise multiplier, so the per-batch check is an integer compare.
    """
    if self.target_epsilon is None:
      return None
    ledger = self._ledger()
    key = (self.noise_multiplier, self.min_separation, id(self._sampler()),
           self.accountant, _history_key(ledger, self))
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

  def _from_fit(self, sampler) -> None:
    """N, B and the privacy unit from `sampler` (the model's `fit`'s), for
    a callback given neither N nor B.

    Raises:
      ValueError: no sampler (not in a DP model's `fit`).
    """
    if sampler is None:
      raise ValueError(
          "PrivacyCallback() takes num_examples and batch_size from the "
          "sampler of a tf_pxg DP model's fit; this model has none (not a "
          "tf_pxg DP model, or a custom loop): pass num_examples= and "
          "batch_size=.")
    self.user_level = sampler.privacy_unit == "user"
    self.num_users = sampler.num_examples if self.user_level else None
    self.num_examples = sampler.num_examples
    self.batch_size = (sampler.expected_batch_size
                       if sampler.expected_batch_size is not None else
                       getattr(sampler, "batch_size", None))

  def _check_sampling(self):
    """Matches the accounting to how the model's `fit` samples batches
    (given neither N nor B, takes them from its sampler: `_from_fit`)."""
    sampler = self._sampler()
    if self._from_sampler:
      self._from_fit(sampler)
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
      if self._added_by_fit and self.target_epsilon is None:
        self._log_key = None  # no ε is claimed: log none
        return
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
    elif sampler is not None and not self._from_sampler:
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
    if (getattr(self.model, "unprotected_training_metrics", False) and
        self._log_key is not None):
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
    if logs is not None and self._log_key is not None:
      eps = self.epsilon()
      logs[self._log_key] = eps if math.isfinite(eps) else float("inf")
      if self.log_risk:
        logs.update(self.risk().logs(
            suffix=self._log_key[len("epsilon"):]))


def appended(callbacks, callback):
  """`callbacks` (None, a list or a `keras.callbacks.CallbackList`, as
  `fit` takes them) with `callback` last."""
  if callbacks is None:
    return [callback]
  if isinstance(callbacks, keras.callbacks.CallbackList):
    callbacks.append(callback)
    return callbacks
  return list(callbacks) + [callback]


def with_privacy_log(callbacks, delta: Optional[float] = None,
                     target_epsilon: Optional[float] = None):
  """`callbacks` with ε logged: a DP model's `fit` logs ε (and stops at
  `target_epsilon`) with no callback given.

  If `callbacks` holds a `PrivacyCallback`, they are returned as they are
  (that callback logs ε, at its δ). Otherwise a `PrivacyCallback(delta=
  delta, target_epsilon=target_epsilon)` is added last: N, the batch size
  and the privacy unit are the sampler's of the `fit` (`_from_fit`), ε is
  the model's privacy ledger's (the whole history behind the weights),
  logged as `epsilon` (`epsilon_user_level` for users) at each epoch end,
  so the progress bar and `History` show it. On shuffled batches (no ε
  claimed) it logs nothing, unless `target_epsilon` is given (then it
  raises, as `PrivacyCallback` does: no budget holds for them). `delta`
  None: `PrivacyCallback`'s default, 1e-5 (as `model.epsilon()`).

  Raises:
    ValueError: `delta` or `target_epsilon` given while `callbacks` holds
      a `PrivacyCallback` (two places for one setting: give it to the
      callback).
  """
  given = (callbacks.callbacks if isinstance(
      callbacks, keras.callbacks.CallbackList) else callbacks) or []
  if any(isinstance(c, PrivacyCallback) for c in given):
    if delta is not None or target_epsilon is not None:
      raise ValueError(
          "fit: delta= and target_epsilon= set the ε that fit logs when no "
          "PrivacyCallback is given; a PrivacyCallback is among the "
          "callbacks: give them to it instead (PrivacyCallback(delta=..., "
          "target_epsilon=...)).")
    return callbacks
  added = PrivacyCallback(target_epsilon=target_epsilon,
                          **({} if delta is None else {"delta": delta}))
  added._added_by_fit = True  # pylint: disable=protected-access
  return appended(callbacks, added)


def _history_key(ledger, callback):
  """What the budget's step count depends on in `ledger` (None: no model
  ledger): its closed runs and where its open run started on the
  callback's counter (unchanged while `fit` trains it, so the bisection
  runs once per fit)."""
  if ledger is None:
    return None
  start = None if ledger.open is None else (
      ledger.open["id"], callback.steps() - ledger.open["steps"])
  return (json.dumps(ledger.closed, sort_keys=True), start)
