"""A DP model's `fit` (Poisson batches by default, ε logged) and the
logical-step accumulator of custom loops: `FitMixin`, a base of
`tf_pxg.keras.models._DPTrainingMixin`.

It reads the model's DP plan (`dp_plan`, `_dp_plan`), its run state
(`_dp_run_state`) and its checks (`_set_unprotected_metrics`,
`_check_trainable_for_dp`), which the DP model class defines; Keras' own
`fit` is the next class in the model's MRO.
"""

from __future__ import annotations

from typing import Optional

from tf_pxg import _compat
from tf_pxg.keras import _ledger
from tf_pxg.keras import _validation
from tf_pxg.keras import callbacks as dp_callbacks
from tf_pxg.keras import losses as pe_losses


class FitMixin:
  """`fit`, `build_accumulator` (see each)."""

  def build_accumulator(self):
    """Creates the logical-step accumulator (custom loops).

    `fit` does this itself. A custom loop that feeds Poisson batches
    (`tf_pxg.data.poisson_dataset`) to `train_step` under a strategy must
    call it once in `strategy.scope()`, after the model is built.
    """
    return self._dp_accumulator_for(list(self.trainable_variables))

  def _dp_accumulator_for(self, variables, num_scalars=None):
    """The run's `LogicalStepAccumulator` for `variables` and the step's
    `num_scalars` side releases (default: the plan's count), kept in the
    DPOptimizer's `step_state` (made if needed: in the strategy scope by
    `fit`, else lifted out of the traced function, which works without a
    strategy; not model state, never saved).

    Raises:
      ValueError: the model is not compiled with a DPOptimizer.
    """
    optimizer = _ledger.dp_optimizer(getattr(self, "optimizer", None))
    if optimizer is None:
      raise ValueError(
          f"Model {self.name!r}: a logical step over Poisson batches keeps "
          "its running sums in the DPOptimizer's step state; compile the "
          "model first (a DP model's compile wraps the optimizer).")
    # The side releases' sums (adaptive clipping's unclipped count, the
    # noisy loss's, ...) are accumulated with the gradient's.
    scalars = (self.dp_plan.num_step_releases if num_scalars is None
               else num_scalars)
    return optimizer.step_state.accumulator("gradient", variables, scalars)

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto",
          callbacks=None, validation_split=0.0, validation_data=None,
          shuffle=True, class_weight=None, sample_weight=None,
          initial_epoch=0, steps_per_epoch=None, validation_steps=None,
          validation_batch_size=None, validation_freq=1, *,
          sampling=None, accumulation_steps: int = 1,
          physical_batch_size: Optional[int] = None,
          max_batch_size: Optional[int] = None,
          sampling_seed: Optional[int] = None, augmult: int = 1,
          user_ids=None, examples_per_user: Optional[int] = None,
          unprotected_training_metrics: Optional[bool] = None,
          target_epsilon: Optional[float] = None,
          delta: Optional[float] = None):
    """Keras `fit`, by default on Poisson-sampled logical batches, logging ε.

    The sampling is the DP plan's (`DPOptimizer(sampling=...)`) when it
    chose one, else this `sampling=` argument, else "poisson".

    With `sampling="poisson"` (the default) `x`, `y` and `sample_weight`
    must be arrays (or nests of arrays, or an unbatched finite
    `tf.data.Dataset` of `(x, y[, sample_weight])`, which is read into
    memory). Every logical step includes each of the N examples
    independently with probability `q = batch_size / N`; an epoch is
    `steps_per_epoch` (default `ceil(N / batch_size)`) logical steps, and
    by default the run stops after `tf_pxg.accounting.steps_for(N, B,
    epochs)` = `ceil(epochs * N / B)` logical steps, the count the
    accountant assigns to `epochs` epochs (so the last epoch may be
    shorter). A
    logical step is fed as `accumulation_steps` physical batches of
    `physical_batch_size` rows (default
    `tf_pxg.data.default_physical_batch_size`), padded with masked rows, and
    more on overflow (never dropped); noise is added once per logical step
    and the sum divided by `q N`. `optimizer.iterations` counts logical
    steps. `shuffle` is ignored (the sampling is random). Keras' epochs and
    progress bar count `k * steps_per_epoch` physical batches of an endless
    stream, so after an overflow a logical step may straddle an epoch end;
    one still unfinished when training ends is completed with its remaining
    physical batches (discarded, uncounted, if training was stopped early,
    e.g. by a privacy budget). Keras runs whole executions: if
    `steps_per_execution` does not divide `k * steps_per_epoch`, an epoch
    holds the next multiple of it physical batches (more logical steps than
    `N / B`; ε, computed from `optimizer.iterations`, counts them all). See
    `tf_pxg.data.poisson` for the derivation and `tf_pxg.keras._poisson_fit`
    for the stream.

    `sampling="shuffled"` is Keras' own data path (shuffled fixed batches,
    or the batches of the given dataset/generator), divided by the realised
    batch size. The ε that `tf_pxg.accounting` computes does not hold for
    it; `PrivacyCallback` refuses it unless told otherwise.

    Args:
      sampling: None (the plan's choice, `DPOptimizer(sampling=...)`, else
        "poisson"), a name of `tf_pxg.data.samplers.SAMPLINGS` ("poisson",
        "shuffled", or a registered one), or a sampler class
        (`tf_pxg.data.samplers.ShuffledSampler`, or a `PoissonSampler`
        subclass, e.g. `tf_pxg.data.balls_in_bins.BallsInBinsSampler`,
        built with `PoissonSampler`'s arguments), or an instance of one
        (drawn from as it is, after checking that it fits the data and
        the model; raises naming the mismatch). `fit` asks the class for
        its input (`tf_pxg.keras._poisson_fit.fit_input`) and keeps the
        sampler as `dp_plan.sampler`; its `dp_event` is what
        `PrivacyCallback` composes (with `augmult` or `user_ids`, a
        `tf_pxg.data.samplers.PrivacyUnits` over it). When the plan has
        chosen a sampling, this must be None, the same class or its name,
        or an instance of that class: anything else raises (the model
        keeps no second copy of the choice).
      accumulation_steps: k physical batches per logical step.
      physical_batch_size: rows per physical batch (global).
      max_batch_size: B_max, truncated Poisson sampling (and implies
        `sampling="truncated_poisson"` when neither this `sampling=` nor
        the plan chose one): every logical step is exactly ONE physical
        batch of `max_batch_size` rows (no accumulation, no carried
        overflow batches: one fixed shape per step); a Poisson draw larger
        than that keeps a uniformly random `max_batch_size` of its
        examples. Noise std stays σC, the sum is still divided by
        `batch_size`, and ε is dp-accounting's
        `TruncatedSubsampledGaussianDpEvent` per step, accounted with PLD
        (RDP has no analysis of it; `tf_pxg.data.truncated_poisson`).
        With `sampling="truncated_poisson"` and no `max_batch_size`,
        B_max is `physical_batch_size`, by default ceil(B + 4 sqrt(B)).
        Raises ValueError with a sampling that does not truncate, or a
        different `physical_batch_size`.
      sampling_seed: seeds the sampler (tests); default OS entropy.
      augmult: K, augmentation multiplicity: each sampled example appears
        K times in its physical batch (the model's random augmentation
        layers draw per copy); the K copies' losses are averaged and the
        mean gradient clipped. Physical batches hold
        `physical_batch_size * K` rows. ε is unchanged.
      user_ids: `[N]` ints or strings, for user-level DP: users are
        Poisson-sampled (`batch_size` is then the expected number of users
        per step, q = B / U), each sampled user contributes up to
        `examples_per_user` of their examples, chosen at random, and the
        mean of their gradients is clipped. ε is then per user
        (`PrivacyCallback(num_users=U, ...)`). See docs/privacy_units.md.
      examples_per_user: k, required with `user_ids`.
      unprotected_training_metrics: True logs the compiled loss and metrics
        of the private batches as `unprotected_<name>` (not covered by ε);
        False logs none; None (default) keeps the model's setting
        (`unprotected_training_metrics` of the constructor, default
        False). Validation metrics are logged as in Keras either way.
      target_epsilon: a privacy budget: training stops before ε at `delta`
        would exceed it (the step limit of `PrivacyCallback`).
      delta: the δ of the ε that `fit` logs (default 1e-5, as
        `epsilon()`).
      (others: as `keras.Model.fit`; `batch_size` is the expected logical
      batch size, default min(32, N); `steps_per_epoch` counts logical
      steps.)

    ε is logged with no callback: unless `callbacks` holds a
    `tf_pxg.keras.PrivacyCallback` (which then logs it, at its δ, and holds
    the budget), `fit` adds one with `delta` and `target_epsilon`, whose
    N, batch size and privacy unit are this `fit`'s sampler's. At each
    epoch end `epsilon` (`epsilon_user_level` with `user_ids`) is the ε
    of the privacy ledger (the whole history behind the weights, as
    `epsilon(delta)`), in the progress bar and the `History`. On shuffled
    batches no ε is claimed and none is logged
    (`tf_pxg.keras.callbacks.with_privacy_log`).

    `validation_split` is refused (it would hold out rows of the private
    `x` and log un-noised `val_*` values on them): pass `validation_data`
    from a held-out set (`_validation.check_no_validation_split`).

    Raises:
      ValueError: `validation_split` set (first, before any other check or
        callback); unknown `sampling`, or one that differs from the plan's
        (`DPOptimizer(sampling=...)`); data that cannot be Poisson-sampled
        (a batched dataset, a generator, a `PyDataset`); a `batch_size`
        larger than the dataset; `delta` or `target_epsilon` with a
        `PrivacyCallback` among the callbacks (give them to it).
    """
    # First: before the data is read and before any callback's check.
    _validation.check_no_validation_split(self, validation_split)
    self._set_unprotected_metrics(unprotected_training_metrics)
    if getattr(self, "optimizer", None) is not None:
      self._check_trainable_for_dp(self.optimizer)  # before building
    if _compat.compile_loss(self) is None:
      pe_losses.per_example_losses(self, None, None)  # raises, names fix
    callbacks = dp_callbacks.with_privacy_log(callbacks, delta,
                                              target_epsilon)
    from tf_pxg.keras import _poisson_fit  # noqa: PLC0415
    if max_batch_size is not None:
      from tf_pxg.data import truncated_poisson  # noqa: PLC0415
      sampling, physical_batch_size = truncated_poisson.fit_sampling(
          sampling if sampling is not None else self._dp_plan(
              getattr(self, "optimizer", None)).sampling,
          max_batch_size, physical_batch_size)
    sampling = self._dp_fit_sampling(sampling)
    run = _poisson_fit.fit_input(self, sampling, _poisson_fit.FitData(
        x=x, y=y, batch_size=batch_size, epochs=epochs,
        initial_epoch=initial_epoch, callbacks=callbacks,
        validation_split=validation_split, validation_data=validation_data,
        validation_batch_size=validation_batch_size, shuffle=shuffle,
        class_weight=class_weight, sample_weight=sample_weight,
        steps_per_epoch=steps_per_epoch,
        accumulation_steps=accumulation_steps,
        physical_batch_size=physical_batch_size,
        sampling_seed=sampling_seed, augmult=augmult, user_ids=user_ids,
        examples_per_user=examples_per_user))
    # The run's sampler (typed): `dp_plan.sampler`, whose event
    # PrivacyCallback composes; in the DPOptimizer's unsaved step state.
    self._dp_run_state().sampler = run.sampler
    _ledger.begin_fit(self, run.sampler)  # before any callback reads ε
    try:
      history = super().fit(
          epochs=epochs, verbose=verbose, validation_freq=validation_freq,
          initial_epoch=initial_epoch, validation_steps=validation_steps,
          **run.keras_args)
      # A logical step still open when Keras' loop ended is completed here
      # with the run's own batches: its steps are the run's.
      run.finish(self)
    finally:
      _ledger.end_fit(self)
    return history

  def _dp_fit_sampling(self, sampling):
    """`fit`'s sampling: the plan's choice (`DPPlan.sampling`) when it has
    one, else `sampling`, else "poisson".

    Raises:
      ValueError: `sampling` names another class than the plan's (both
        named, and which to change).
    """
    from tf_pxg.data import samplers  # noqa: PLC0415
    chosen = self._dp_plan(getattr(self, "optimizer", None)).sampling
    if sampling is None:
      return "poisson" if chosen is None else chosen
    if chosen is None:
      return sampling
    given = samplers.resolve(sampling if isinstance(sampling, (str, type))
                             else type(sampling))
    if given is not chosen:
      raise ValueError(
          f"Model {self.name!r}.fit got sampling={sampling!r} "
          f"({given.__name__}), but its DP plan chose sampling="
          f"{chosen.__name__} (DPOptimizer(sampling=...), or the model's "
          "sampling=). The plan holds the sampling in one place: drop "
          "fit's `sampling=` to use the plan's, or create the DPOptimizer "
          f"(or the model) with sampling={given.__name__}, or without "
          "`sampling` to choose it in fit.")
    return sampling
