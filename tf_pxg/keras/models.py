"""Keras models that train with DP-SGD through `model.fit`.

`DPModel` (functional), `DPSequential`, `make_dp_model_class(cls)` (any model
class, e.g. subclassed) and `make_private(model)` share one `train_step`
(`tf_pxg.keras._train_step.dp_train_step`): per-example losses from the
compiled loss, flat per-example clipping, Gaussian noise once per global
step, division by the global batch size, and the compiled optimizer.
`evaluate`, `predict`, callbacks and saving are Keras'.

The DP model class (`_DPTrainingMixin`) holds the settings, `compile` and
the train step; its bases hold the rest, one module each: `fit` and the
logical-step accumulator (`tf_pxg.keras._fit.FitMixin`), the privacy
ledger's methods and the weights paths that carry it
(`tf_pxg.keras._ledger.LedgerMixin`), and the config with the DP settings
(`tf_pxg.keras._config.ConfigMixin`).
"""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg import _renamed
from tf_pxg.dp import plan as dp_plan
from tf_pxg.dp import step as dp_step
from tf_pxg.dp import step_state
from tf_pxg.keras import _config
from tf_pxg.keras import _fit
from tf_pxg.keras import _ledger
from tf_pxg.keras import _validation
from tf_pxg.keras import _train_step
from tf_pxg.keras.optimizers import DPOptimizer

# Where eager callers' traced steps are cached on the model
# (`tf_pxg.keras._train_step.traced_step`).
_TRACED_TRAIN_STEP = "_dp_traced_train_step"
_TRACED_GRADIENTS = "_dp_traced_gradients"


def _check_bool(value, name: str, where: str) -> bool:
  if not isinstance(value, bool):
    raise TypeError(f"{where}: {name} must be True or False; got "
                    f"{value!r}.")
  return value


def _check_seed(secure_mode: bool, seed, where: str) -> None:
  """Raises if secure mode comes with a seed."""
  if secure_mode and seed is not None:
    raise ValueError(
        f"{where}: secure_mode=True draws every noise key (and the "
        f"sampler's randomness) from the OS CSPRNG, so it cannot be "
        f"reproducible; got seed={seed!r}. Drop the seed, or use "
        "secure_mode=False for reproducible tests.")


def _loss_scale_optimizer(optimizer):
  """`optimizer` if it is a `LossScaleOptimizer` (Keras wraps the compiled
  optimizer in one under the mixed_float16 policy), else None."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer
  return None


def _unscaled(optimizer):
  """The optimizer a `LossScaleOptimizer` wraps, else `optimizer`: where the
  DP settings (a `DPOptimizer`) are."""
  scaled = _loss_scale_optimizer(optimizer)
  return optimizer if scaled is None else scaled.inner_optimizer


def _applying(optimizer):
  """The Keras optimizer that applies the DP step's noisy gradients (both
  wrappers removed: the step unscales, clips and noises itself)."""
  optimizer = _unscaled(optimizer)
  if isinstance(optimizer, DPOptimizer):
    return optimizer.inner_optimizer
  return optimizer


class _DPTrainingMixin(_fit.FitMixin, _ledger.LedgerMixin,
                       _config.ConfigMixin):
  """DP-SGD `train_step` and DP settings for a Keras model class.

  DP keyword arguments (both or neither; neither means "take them from the
  `DPOptimizer` passed to `compile`"):
    l2_norm_clip: each example's gradient, over all trainable variables
      together, is scaled to L2 norm at most this (`float('inf')`: no
      clipping).
    noise_multiplier: Gaussian noise with std `noise_multiplier *
      l2_norm_clip` is added to the summed clipped gradients once per global
      step (under a distribution strategy with R replicas, each replica adds
      std `noise_multiplier * l2_norm_clip / sqrt(R)` and the all-reduce sums
      them), then the sum is divided by the global batch size.
    seed: seeds the noise generator (tests only); by default it is seeded
      from OS entropy. Neither the seed nor the generator's state is saved
      with the model or in a `tf.train.Checkpoint`, so a reloaded or
      resumed model draws fresh noise and never replays the noise of a
      previous run (a seeded model does, in a new process: seeds are for
      tests).
    clipping: a `tf_pxg.clipping` policy (default flat clipping to
      `l2_norm_clip`; `Automatic()`, `QuantileAdaptive(...)`); see
      `tf_pxg.keras.DPOptimizer`.
    noise_mechanism: None (DP-SGD) or `tf_pxg.mf.BandedToeplitz(b)`
      (BandMF correlated noise with cyclic Poisson sampling in `fit`); see
      `tf_pxg.keras.DPOptimizer`. `compile` wraps a plain optimizer in a
      `DPOptimizer` built from these settings, which then owns the plan,
      the mechanism's state and the privacy ledger (`privacy_ledger`).
    sampling: how `fit` draws batches (None: `fit`'s argument decides,
      "poisson" by default; a `tf_pxg.data.samplers.SAMPLINGS` name or a
      sampler class); see `tf_pxg.keras.DPOptimizer`. Like the settings
      above it is a request: with a plain optimizer it goes into the
      wrapping `DPOptimizer`'s plan; a
      `DPOptimizer` without a sampling takes it at `compile`, one with
      another raises. Saved in the config. (The accountant is chosen on
      the `DPOptimizer` or on `PrivacyCallback`.)
    noisy_loss: a `tf_pxg.keras.NoisyLoss(bound, noise_multiplier)`: log
      a private training `loss` (per-example losses clamped to `[0,
      bound]`, summed, Gaussian-noised once per step, divided as the
      gradient), covered by the model's ε: the gradient's noise takes the
      rest of the budget (`tf_pxg.dp.noisy_loss`). Default None: no
      training loss is logged. Saved in the config. Like the settings
      above, a request for the `DPOptimizer`'s plan.
    side_releases: more private side releases on each step's batch
      (`tf_pxg.dp.releases.SideRelease`s, each logged under its name; see
      `tf_pxg.keras.DPOptimizer`). Saved in the config.
    unprotected_training_metrics: log the compiled loss and metrics on
      the private batches, un-noised and not covered by ε, under
      `unprotected_<name>` keys (default False: no batch values logged;
      see "Logs" below). Saved in the config.
    secure_mode: draw every step's noise keys from the OS CSPRNG (no
      generator state, nothing to replay) and sum four Gaussians per
      coordinate against floating-point attacks (`tf_pxg.dp.secure`); the
      Poisson sampler of `fit` reads `_dp_secure_mode` too. Works eagerly
      and in `tf.function`, not under XLA: `jit_compile="auto"` then
      compiles without XLA and `jit_compile=True` raises. Saved in the
      config. A `DPOptimizer(secure_mode=True)` turns it on at `compile`.

  Data: `fit` samples Poisson batches by default (each example joins each
  logical step with probability `q = batch_size / N`, the sampling that
  `tf_pxg.accounting` analyses), padded to fixed physical batches with a
  mask, optionally over `accumulation_steps` physical batches per logical
  step; the noisy sum is divided by the expected batch size `qN`. With
  `fit(..., sampling="shuffled")`, `train_on_batch` or a custom loop on
  plain batches, a batch is one step divided by its realised global size.
  See `fit` and `tf_pxg.data`.

  Non-finite examples: an example whose loss or gradient norm is NaN or inf
  gets clip factor 0 (exactly zero contribution, by a select) and the step
  is applied as usual: skipping it would make whether the weights move
  depend on one example, an unbounded leak (see `tf_pxg.dp.clipping`). No
  count of such examples is logged (it is data-dependent, not private).
  Non-finite parameters or weight-regulariser gradients (not any example's)
  propagate as in plain Keras.

  Logs: the train step logs nothing computed from the private batch (no
  un-noised training `loss` or metrics: one example would move them
  without bound, and callbacks reading them, such as `TerminateOnNaN` or
  `ReduceLROnPlateau`, would make the number of steps or the learning rate
  depend on it). `noisy_loss=NoisyLoss(...)` logs a noised `loss` covered
  by ε. `PrivacyCallback` logs ε; validation metrics are Keras'.
  `unprotected_training_metrics=True` (here or in `fit`) logs the compiled
  loss and metrics on the private batch as `unprotected_<name>`, not
  covered by ε (non-finite examples excluded). See docs/threat_model.md.

  Step limit: updates are applied only while `optimizer.iterations` is below
  the model's step limit (`set_step_limit`; `PrivacyCallback(
  target_epsilon=...)` sets it), decided inside the compiled step.

  Raises at construction: ValueError if `secure_mode=True` and `seed` are
  both given.

  Raises (at `compile`, or at the first training step, before any update):
    ValueError: trainable BatchNormalization layers (they mix examples:
      use GroupNormalization/LayerNormalization), activity regularizers,
      missing DP settings, settings that differ between the model and its
      `DPOptimizer`, losses that do not give per-example values.
  """

  def __init__(self, *args, l2_norm_clip: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               seed: Optional[int] = None, secure_mode: bool = False,
               clipping=None, noise_mechanism=None, sampling=None,
               unprotected_training_metrics: bool = False,
               noisy_loss=None, side_releases=(), **kwargs):
    where = type(self).__name__
    # The constructor's request: handed to the optimizer at `compile` (see
    # `_dp_plan`), saved in the config; the step reads the optimizer's.
    request = dp_plan.DPPlan.validated(
        where, l2_norm_clip, noise_multiplier, required=False,
        clipping=clipping, noise_mechanism=noise_mechanism,
        secure_mode=secure_mode, sampling=sampling, noisy_loss=noisy_loss,
        side_releases=side_releases,
        unprotected_training_metrics=unprotected_training_metrics)
    _check_seed(request.secure_mode, seed, where)
    super().__init__(*args, **kwargs)
    self._dp_request = request
    # A test-only seed of the run's noise generator, which the compiled
    # DPOptimizer's `step_state` holds (made at `compile`, `_dp_run_state`):
    # never saved, so a reloaded or resumed model draws fresh noise.
    self._dp_seed = seed
    # The privacy ledger belongs to the weights: held here, carried by
    # every weights path (tf_pxg.keras._ledger).
    _ledger.state_of(self)

  # Settings -----------------------------------------------------------------

  @property
  def dp_plan(self):
    """The `tf_pxg.dp.plan.DPPlan` in use: the compiled `DPOptimizer`'s,
    else the model's own (constructor) settings; its `sampling` is the
    optimizer's choice (None: `fit`'s argument decides) and its `sampler`
    the `tf_pxg.data.samplers.Sampler` instance the last `fit` built
    (what `PrivacyCallback` composes)."""
    optimizer = getattr(self, "optimizer", None)
    plan = self._dp_plan(optimizer)
    dp = _ledger.dp_optimizer(optimizer)
    sampler = None if dp is None else dp.step_state.sampler
    if plan.sampler is None and sampler is not None:
      plan = plan.replace(sampler=sampler)
    return plan

  def _dp_plan(self, optimizer, strict: bool = False):
    """The plan of `optimizer` if it is a DPOptimizer (the one owner;
    `compile` has checked that the model's request agrees), else the
    model's request; `strict` raises when it has no clip and sigma."""
    optimizer = _unscaled(optimizer)
    if isinstance(optimizer, DPOptimizer):
      return optimizer.plan
    request = self._dp_request
    if strict and request.l2_norm_clip is None:
      raise ValueError(
          f"Model {self.name!r} has no DP settings: pass `l2_norm_clip` and "
          "`noise_multiplier` to the model, or compile it with a "
          "tf_pxg.keras.DPOptimizer (e.g. tf_pxg.keras.DPSGD(...)).")
    return request

  @property
  def _dp_secure_mode(self) -> bool:
    return bool(self.dp_plan.secure_mode)

  @property
  def l2_norm_clip(self) -> Optional[float]:
    """The effective clip (the plan's)."""
    return self.dp_plan.l2_norm_clip

  @property
  def noise_multiplier(self) -> Optional[float]:
    """The effective noise multiplier (the plan's)."""
    return self.dp_plan.noise_multiplier

  @property
  def secure_mode(self) -> bool:
    """Whether the noise keys come from the OS CSPRNG (`tf_pxg.dp.secure`)."""
    return self._dp_secure_mode

  @property
  def clipping(self):
    """The effective `tf_pxg.clipping` policy."""
    return self.dp_plan.clipping

  @property
  def noise_mechanism(self):
    """The effective noise mechanism setting (None: DP-SGD)."""
    return self.dp_plan.noise_mechanism

  @property
  def min_separation(self) -> int:
    """b of the b-min-separation participation the noise mechanism's ε
    needs (BandMF's bands; 1: DP-SGD)."""
    return self.dp_plan.min_separation

  num_bands = _renamed.alias("num_bands", "min_separation")

  @property
  def unprotected_training_metrics(self) -> bool:
    """Whether training logs hold un-noised values of the private batch
    (the plan's `unprotected_training_metrics`)."""
    return bool(self.dp_plan.unprotected_training_metrics)

  def _set_unprotected_metrics(self, value: Optional[bool]) -> None:
    """`fit`'s override (None: keep), written into the DPOptimizer's plan
    (the ledger's next run records it); retraces the train function on a
    change (the flag is read when the step is traced)."""
    if value is None:
      return
    value = _check_bool(value, "unprotected_training_metrics",
                        f"Model {self.name!r}.fit")
    dp = _ledger.dp_optimizer(getattr(self, "optimizer", None))
    if dp is not None and value != dp.plan.unprotected_training_metrics:
      dp._set_unprotected_metrics(value)  # pylint: disable=protected-access
      self.train_function = None
      self._forget_traced_steps()

  def _dp_run_state(self, optimizer=None):
    """The run's `tf_pxg.dp.step_state.StepState`, held by the compiled
    `DPOptimizer` (or `optimizer`'s): its noise generator (seeded with
    the model's test-only `seed`) and step limit are made in this model's
    strategy scope if missing.

    Raises:
      ValueError: the model is not compiled with a DPOptimizer.
    """
    if optimizer is None:
      optimizer = getattr(self, "optimizer", None)
    dp = _ledger.dp_optimizer(optimizer)
    if dp is None:
      raise ValueError(
          f"Model {self.name!r}: the noise generator and the step limit are "
          "kept in the DPOptimizer's step state; compile the model first "
          "(a DP model's compile wraps the optimizer).")
    dp.step_state.start(self.distribute_strategy, self._dp_seed)
    return dp.step_state

  def _dp_noise_source(self):
    """The run's generator; the noise mechanism picks the source it draws
    from (`NoiseMechanism.noise_source`: OS keys in secure mode)."""
    return self._dp_run_state().generator

  def _agree_with(self, optimizer):
    """At `compile`: a DPOptimizer's plan takes the model's request
    (`tf_pxg.dp.plan.DPPlan.absorb`: what the model gives must agree, or
    fill what the plan leaves open; raises naming both); a secure plan
    refuses a seeded model."""
    optimizer = _unscaled(optimizer)
    if not isinstance(optimizer, DPOptimizer):
      return
    optimizer._take_request(  # pylint: disable=protected-access
        self._dp_request, f"Model {self.name!r}")
    if optimizer.plan.secure_mode and self._dp_seed is not None:
      raise ValueError(
          f"Model {self.name!r} was created with a noise seed, but its "
          "DPOptimizer has secure_mode=True, which cannot be "
          "reproducible. Create the model without `seed`.")

  def _dp_step_parts(self) -> dp_step.StepParts:
    """The train step's `tf_pxg.dp.step.StepParts`, from the one plan: the
    clipping policy and its clip, the multipliers
    (`tf_pxg.dp.plan.DPPlan.step_noise`, at the expected batch size of the
    run's sampler; None: a plain batch), the `NoiseMechanism` and the
    state the `DPOptimizer` holds for them."""
    from tf_pxg.dp import clipping as policies  # noqa: PLC0415
    optimizer = _unscaled(self.optimizer)
    plan = self._dp_plan(optimizer, strict=True)
    sampler = self._dp_run_state().sampler
    step_noise = plan.step_noise(
        None if sampler is None else sampler.expected_batch_size)
    noise = plan.mechanism
    clip, noise_state, states = plan.l2_norm_clip, None, ()
    stateless = (isinstance(plan.clipping, policies.Flat) and
                 not noise.stateful and not plan.num_step_releases)
    if isinstance(optimizer, DPOptimizer) and not stateless:
      # Only a policy, mechanism or release with state builds the
      # optimizer here (a stateless step leaves it to Keras, as plain
      # DP-SGD always has: building it in a traced multi-worker step would
      # create variables outside the strategy's own build).
      if not optimizer.built:
        with tf.init_scope():
          optimizer.build(list(self.trainable_variables))
      state = optimizer.dp_state
      clip = plan.l2_norm_clip if state.clip is None else state.clip
      noise_state = state.noise
      states = state.release_states(step_noise.releases)
    elif not stateless and not isinstance(optimizer, DPOptimizer):
      raise ValueError(  # compile wraps; only a hand-set optimizer gets here
          f"Model {self.name!r}: clipping={plan.clipping!r}, "
          f"noise_mechanism={plan.noise_mechanism!r} and the side releases "
          "keep state in a tf_pxg.keras.DPOptimizer; compile with one.")
    return dp_step.StepParts(
        plan.clipping, clip, plan.noise_multiplier or 0.0, step_noise.gradient,
        noise, noise_state, optimizer.iterations, step_noise.releases, states,
        optimizer.step_state if isinstance(optimizer, DPOptimizer) else None)

  def _check_trainable_for_dp(self, optimizer):
    optimizer = _unscaled(optimizer)  # mixed_float16: see dp_gradients
    self._dp_plan(optimizer, strict=True).check_budget()
    inner = _applying(optimizer)
    if getattr(inner, "gradient_accumulation_steps", None):
      raise ValueError(
          f"Model {self.name!r} is compiled with an optimizer that has "
          f"gradient_accumulation_steps={inner.gradient_accumulation_steps}: "
          "Keras would average noisy gradients of several batches (adding "
          "the noise k times). For DP gradient accumulation pass "
          "`accumulation_steps=k` to `fit` (noise once per logical step) and "
          "create the optimizer without gradient_accumulation_steps.")
    _validation.check_no_batch_mixing_layers(self)
    _validation.check_no_data_dependent_losses(self)

  # Keras hooks --------------------------------------------------------------

  def compile(self, optimizer="rmsprop", *args, **kwargs):
    optimizer = keras.optimizers.get(optimizer)
    request = self._dp_request
    if (_loss_scale_optimizer(optimizer) is not None and
        not isinstance(_unscaled(optimizer), DPOptimizer) and
        not request.is_default_mechanism):
      raise ValueError(
          f"Model {self.name!r}: its clipping policy or noise mechanism keeps "
          "state in a DPOptimizer, which must be inside the "
          "LossScaleOptimizer: pass LossScaleOptimizer(DPOptimizer(...)), or "
          "the DPOptimizer alone (Keras adds the LossScaleOptimizer under "
          "mixed_float16).")
    if (not isinstance(_unscaled(optimizer), DPOptimizer) and
        (request.l2_norm_clip is not None or
         not request.is_default_mechanism)):
      # The plan, the mechanism's state and the privacy ledger live in a
      # DPOptimizer (saved with it), so the model's settings wrap the given
      # optimizer (inside a LossScaleOptimizer given around it): it then
      # owns the plan.
      self._dp_plan(optimizer, strict=True)
      scaled = _loss_scale_optimizer(optimizer)
      optimizer = DPOptimizer(
          _unscaled(optimizer), request.l2_norm_clip,
          request.noise_multiplier, secure_mode=request.secure_mode,
          clipping=request.clipping, sampling=request.sampling,
          noise_mechanism=request.noise_mechanism,
          noisy_loss=request.noisy_loss,
          side_releases=request.side_releases,
          unprotected_training_metrics=request.unprotected_training_metrics)
      if scaled is not None:
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=scaled.initial_scale,
            dynamic_growth_steps=scaled.dynamic_growth_steps)
    self._agree_with(optimizer)
    self._check_trainable_for_dp(optimizer)
    if self._dp_plan(optimizer).secure_mode:
      jit = kwargs.get("jit_compile", "auto")
      if jit is True:
        from tf_pxg.dp import secure  # noqa: PLC0415
        raise secure.xla_error(f"Model {self.name!r} with secure_mode=True")
      kwargs["jit_compile"] = False
    self._forget_traced_steps()
    # The privacy ledger is the model's: the old optimizer's steps are
    # counted, a new DP optimizer (a fresh noise state) closes the open run
    # (tf_pxg.keras._ledger).
    previous = _ledger.dp_optimizer(getattr(self, "optimizer", None))
    _ledger.hand_over(self, getattr(self, "optimizer", None), optimizer)
    # So does the run's unsaved state (a seeded noise stream goes on, never
    # replays; the step limit and the last sampler stay).
    if previous is not None:
      _ledger.dp_optimizer(optimizer).step_state.take_over(
          previous.step_state)
    self._dp_run_state(optimizer)
    super().compile(optimizer, *args, **kwargs)

  def compile_from_config(self, config):
    config = keras.saving.deserialize_keras_object(config)
    self.compile(**config)
    if hasattr(self, "optimizer") and self.built:
      self.optimizer.build(self.trainable_variables)

  def make_train_function(self, force=False):
    """Keras' train function, always a traced graph under DP.

    With `compile(run_eagerly=True)` Keras would call `train_step` eagerly,
    where a Python-side value of the batch (an `if` on a batch statistic,
    `.numpy()`, `tf.numpy_function`, a tensor kept on a layer between
    batches) leaves the recorded computation unseen and lets one example
    move the others' gradients. So the train function is built as with
    `run_eagerly=False` (without XLA: Keras turns `jit_compile` off with
    `run_eagerly`); such values are then trace-time errors or ops the graph
    checks refuse. `evaluate`, `predict`, callbacks and the data pipeline
    stay eager. See docs/threat_model.md, "The forward pass is closed:
    eager mode", and docs/testing.md, "How to debug a DP model".

    Raises:
      ValueError: `tf.config.run_functions_eagerly(True)` is set.
    """
    _train_step.refuse_functions_run_eagerly(self, "fit")
    if not self.run_eagerly:
      return super().make_train_function(force)
    self.run_eagerly = False  # read only while the function is built
    try:
      return super().make_train_function(force)
    finally:
      self.run_eagerly = True

  def _forget_traced_steps(self) -> None:
    """Drops the traced steps of eager callers (`traced_step`): a recompile
    or a changed logging flag must retrace them, as Keras' train function."""
    for key in (_TRACED_TRAIN_STEP, _TRACED_GRADIENTS):
      self.__dict__.pop(key, None)

  @tf.autograph.experimental.do_not_convert
  def train_step(self, data):
    """The DP step (`tf_pxg.keras._train_step.dp_train_step`), traced even
    when called eagerly (`tf_pxg.keras._train_step.traced_step`).

    Like `dp_gradients` and `dp_apply`, never converted by autograph: a
    custom loop's `tf.function` traces it as Keras' `fit` does (its step is
    `do_not_convert` too), so the forward pass is the same graph in both,
    and tf_pxg's backward pass is not rewritten on each first trace. A
    Python `if` on a tensor in the model's `call` is then an error, as in
    `fit`: write it with `tf.cond` or `keras.ops.cond`."""
    return _train_step.traced_step(self, _TRACED_TRAIN_STEP,
                                   self._dp_train_step)(data)

  def _dp_train_step(self, data):
    self._check_trainable_for_dp(self.optimizer)
    return _train_step.dp_train_step(
        self, data, self._dp_step_parts(), self._dp_noise_source(),
        _applying(self.optimizer),
        loss_scale=_loss_scale_optimizer(self.optimizer))

  @tf.autograph.experimental.do_not_convert
  def dp_gradients(self, data):
    """The replica-local half of `train_step` (no synchronisation).

    Returns a `tf_pxg.keras._train_step.ReplicaGradients`; pass it to
    `dp_apply` in the same replica context. Splitting the step lets a
    custom loop compile this half with XLA per replica where the strategy
    forbids synchronisation inside a compiled function (MirroredStrategy on
    CPU); `train_step` is `dp_apply(dp_gradients(data))`. Called eagerly,
    it runs as a traced graph, as `train_step` does.
    """
    def gradients(data):
      self._check_trainable_for_dp(self.optimizer)
      result = _train_step.dp_gradients(
          self, data, self._dp_step_parts(), self._dp_noise_source(),
          _loss_scale_optimizer(self.optimizer))
      # Only tensors leave a tf.function: the parts (a policy, variables)
      # are put back below.
      return result._replace(parts=None), result.parts is not None

    result, has_parts = _train_step.traced_step(
        self, _TRACED_GRADIENTS, gradients)(data)
    if not has_parts:
      return result
    return result._replace(parts=self._dp_step_parts())

  @tf.autograph.experimental.do_not_convert
  def dp_apply(self, result):
    """The synchronising half of `train_step`: apply (within the step
    limit), metrics."""
    return _train_step.dp_apply(self, result, _applying(self.optimizer),
                                xla=bool(getattr(self, "jit_compile", False)))

  # Step limit (privacy budget) ------------------------------------------------

  @property
  def step_limit(self) -> Optional[int]:
    """The step limit (an absolute `optimizer.iterations` count), or None."""
    if _ledger.dp_optimizer(getattr(self, "optimizer", None)) is None:
      return None  # not compiled: no run, no limit
    value = int(_train_step.step_limit_variable(self).numpy())
    return None if value == step_state.NO_STEP_LIMIT else value

  def set_step_limit(self, limit: Optional[int]) -> None:
    """Applies updates only while `optimizer.iterations < limit` (None: no
    limit).

    The check is inside the compiled train step (data-independent, per
    physical batch, whatever `steps_per_execution`): a batch past the limit
    changes no weight, optimizer slot or `iterations`. The limit is not
    saved with the model. `PrivacyCallback(target_epsilon=...)` sets it at
    `on_train_begin` and removes it at `on_train_end`.
    """
    if limit is not None and (isinstance(limit, bool) or
                              int(limit) != limit or limit < 0):
      raise ValueError(f"step limit must be a non-negative integer or None; "
                       f"got {limit!r}.")
    _train_step.step_limit_variable(self).assign(
        step_state.NO_STEP_LIMIT if limit is None else int(limit))



@keras.saving.register_keras_serializable(package="tf_pxg")
class DPModel(_DPTrainingMixin, keras.Model):
  """A functional Keras model trained with DP-SGD by `fit`.

  `DPModel(inputs, outputs, l2_norm_clip=1.0, noise_multiplier=1.1)`; see
  `_DPTrainingMixin` for the DP arguments, noise derivation and errors. For
  subclassed models use `make_dp_model_class(MyModel)`.
  """


@keras.saving.register_keras_serializable(package="tf_pxg")
class DPSequential(_DPTrainingMixin, keras.Sequential):
  """A `keras.Sequential` trained with DP-SGD by `fit`.

  `DPSequential([layers...], l2_norm_clip=1.0, noise_multiplier=1.1)`.
  """


_DP_CLASSES = {keras.Model: DPModel, keras.Sequential: DPSequential}


def make_dp_model_class(cls: type) -> type:
  """A subclass of the Keras model class `cls` that trains with DP-SGD.

  The new class takes `l2_norm_clip`, `noise_multiplier`, `seed` and
  `secure_mode` keyword
  arguments in addition to `cls`'s own, and is registered as
  `tf_pxg>DP<cls.__name__>` for `keras.models.load_model` (pass it in
  `custom_objects` if another class of that name was registered first).

  Raises:
    TypeError: `cls` is not a `keras.Model` subclass, or already DP.
  """
  if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
    raise TypeError(f"make_dp_model_class expects a keras.Model subclass; "
                    f"got {cls!r}.")
  if issubclass(cls, _DPTrainingMixin):
    raise TypeError(f"{cls.__name__} already trains with DP.")
  if cls in _DP_CLASSES:
    return _DP_CLASSES[cls]
  new_cls = type(f"DP{cls.__name__}", (_DPTrainingMixin, cls),
                 {"__module__": cls.__module__,
                  "__doc__": f"{cls.__name__} trained with DP-SGD "
                             "(see tf_pxg.keras.make_dp_model_class)."})
  _DP_CLASSES[cls] = new_cls
  name = f"tf_pxg>{new_cls.__name__}"
  if keras.saving.get_registered_object(name) is None:
    keras.saving.register_keras_serializable(package="tf_pxg")(new_cls)
  return new_cls


def make_private(model: keras.Model, l2_norm_clip: Optional[float] = None,
                 noise_multiplier: Optional[float] = None,
                 seed: Optional[int] = None,
                 secure_mode: bool = False, clipping=None,
                 noise_mechanism=None, sampling=None,
                 unprotected_training_metrics: bool = False,
                 noisy_loss=None, side_releases=()) -> keras.Model:
  """A DP model sharing `model`'s layers and weights.

  `secure_mode`, `clipping`, `noise_mechanism`, `sampling`,
  `unprotected_training_metrics`, `noisy_loss`, `side_releases`: see
  `_DPTrainingMixin`
  (secure mode raises with a `seed`).

  Works for functional and `Sequential` models (the result is a `DPModel` or
  `DPSequential` over the same layer objects: training one trains the
  other). Compile the result before `fit`.

  Raises:
    TypeError: `model` is a subclassed model (use `make_dp_model_class`) or
      already DP.
    ValueError: invalid DP settings or a BatchNormalization layer (named).
  """
  if isinstance(model, _DPTrainingMixin):
    raise TypeError(f"Model {model.name!r} already trains with DP.")
  dp_plan.DPPlan.validated("make_private", l2_norm_clip, noise_multiplier,
                           required=False)
  _validation.check_no_batch_mixing_layers(model)
  kwargs = dict(l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
                seed=seed,
                secure_mode=secure_mode, clipping=clipping,
                noise_mechanism=noise_mechanism, sampling=sampling,
                unprotected_training_metrics=unprotected_training_metrics,
                noisy_loss=noisy_loss, side_releases=side_releases)
  if isinstance(model, keras.Sequential):
    return DPSequential(model.layers, name=f"dp_{model.name}", **kwargs)
  if isinstance(model, _compat.functional_class()):
    return DPModel(inputs=model.inputs, outputs=model.outputs,
                   name=f"dp_{model.name}", **kwargs)
  raise TypeError(
      f"make_private works for functional and Sequential models; "
      f"{model.name!r} is a subclassed {type(model).__name__}. Use "
      f"tf_pxg.keras.make_dp_model_class({type(model).__name__}) to get a DP "
      "version of the class, then build and load the weights into it.")

