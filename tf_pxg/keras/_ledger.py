"""How a DP model's training writes its privacy ledger (`tf_pxg.dp.ledger`).

The ledger lives in the compiled `DPOptimizer`'s `DPState` (saved with it
by every saving path). Three moments write it:

* `compile` with a new DP optimizer (`hand_over`): the old optimizer's open
  run is closed at the old optimizer's `iterations` and the whole ledger
  moves to the new optimizer, whose counter starts again. So a recompile
  can neither reset ε nor restart a budget.
* `fit`, once its sampler is built (`begin_fit`): the run it trains is the
  open run if it releases the same event, else a new run (the open one is
  closed at the current step count; correlated noise refuses, see
  `PrivacyLedger.begin`).
* the end of `fit` and every Keras save of the optimizer (`snapshot`): the
  open run's event at the current count is stored, for a process that
  reads the ledger without rebuilding the sampler.

The run's event is the one `PrivacyCallback` composes for a single fit:
`sampler.dp_event(plan.mechanism, plan.noise_multiplier, T)`, the plan
being the optimizer's (`tf_pxg.dp.plan.DPPlan`).
"""

from __future__ import annotations

from typing import Optional


from tf_pxg.data import samplers
from tf_pxg.dp import ledger as ledger_lib


def dp_optimizer(optimizer):
  """The DPOptimizer of `optimizer` (inside a LossScaleOptimizer), else
  None (`tf_pxg.keras.optimizers.dp_optimizer_of`)."""
  from tf_pxg.keras.optimizers import dp_optimizer_of  # noqa: PLC0415
  return dp_optimizer_of(optimizer)


def ledger_of(optimizer) -> Optional[ledger_lib.PrivacyLedger]:
  """The ledger of a compiled optimizer (None: no DPOptimizer)."""
  dp = dp_optimizer(optimizer)
  return None if dp is None else dp.dp_state.privacy_ledger


def hand_over(old, new) -> None:
  """Moves the ledger of optimizer `old` (closed at its step count) to
  `new` at compile. Nothing to do when either is not a DPOptimizer or
  they are one object (a recompile with the same optimizer continues)."""
  old_dp, new_dp = dp_optimizer(old), dp_optimizer(new)
  if old_dp is None or new_dp is None or old_dp is new_dp:
    return
  ledger = old_dp.dp_state.privacy_ledger
  ledger.close(old_dp.step_count())
  old_dp.dp_state.write_ledger()
  new_dp.dp_state.set_privacy_ledger(ledger)


def run_for(plan, sampler) -> ledger_lib.Run:
  """The ledger's `Run` of `sampler` under `plan`."""
  mechanism, sigma = plan.mechanism, plan.noise_multiplier

  def event_fn(t: int):
    try:
      return sampler.dp_event(mechanism, sigma, t)
    except samplers.NotCertifiedError:
      return None  # shuffled batches: no ε claimed for this run

  settings = {
      "sampler": type(sampler).__name__,
      "sampling_rate": sampler.sampling_rate,
      "expected_batch_size": sampler.expected_batch_size,
      "num_examples": sampler.num_examples,
      "privacy_unit": sampler.privacy_unit,
      "noise_multiplier": sigma,
      "mechanism": repr(mechanism),
      "l2_norm_clip": plan.l2_norm_clip,
  }
  if plan.unprotected_training_metrics:
    # Logged un-noised on every private batch: outside every ε (the key is
    # only there when on, so older ledgers' runs keep their keys).
    settings["unprotected_training_metrics"] = "logged, not covered by ε"
  return ledger_lib.Run(event_fn, settings, stateful=mechanism.stateful)


def begin_fit(model, sampler) -> None:
  """Records the run `fit` is about to train (module docstring).

  Raises:
    tf_pxg.dp.ledger.ComposeError: it cannot follow the open run.
  """
  dp = dp_optimizer(getattr(model, "optimizer", None))
  if dp is None or sampler is None:
    return
  ledger = dp.dp_state.privacy_ledger
  ledger.begin(run_for(dp.plan, sampler), dp.step_count())
  dp.dp_state.write_ledger()


def snapshot(optimizer) -> None:
  """Stores the open run's event at the optimizer's current count."""
  dp = dp_optimizer(optimizer)
  if dp is not None:
    dp.snapshot_ledger()
