"""One DP-SGD step for a Keras model: clip, noise, scale, apply.

Per global step with R replicas, each holding `B_r` examples
(`B = sum_r B_r`, the global batch):

1. replica r computes `S_r = sum_{b in r} min(1, C/||g_b||) g_b` with
   `tf_pxg.GradientTape.clipped_gradient_sum` (flat clipping over all
   trainable variables);
2. it adds `n_r ~ N(0, (sigma C)^2 / R)` — std `sigma C / sqrt(R)`, from a
   `tf.random.Generator` created in the strategy scope, which gives each
   replica an independent stream — and divides by `B`;
3. Keras' optimizer all-reduces (sums) the replicas' gradients, giving
   `(sum_r S_r + sum_r n_r) / B`; the `n_r` are independent, so
   `sum_r n_r ~ N(0, R * (sigma C)^2 / R) = N(0, (sigma C)^2)`: the noise of
   one global step is added exactly once, whatever R is.

With Poisson batches (`tf_pxg.data`: the `sample_weight` slot holds the
batch's `info`, read as a `tf_pxg.data.BatchInfo`) a logical step spans one or more physical batches:
padding rows get a constant loss (zero gradient, norm, loss and metric
weight), the replicas' `S_r` accumulate locally
(`tf_pxg.dp.accumulation.LogicalStepAccumulator`) and only the physical
batch that ends the step draws the noise, divides by the expected batch
size `qN` instead of `B`, and applies; the others leave weights, optimizer
slots and `iterations` untouched. No replica-context conditional holds a
synchronisation point (MirroredStrategy forbids it): the accumulators are
updated with selects, and the apply is gated (below).

Weight-regularizer gradients (data-independent) are added unclipped and
un-noised, once per logical step, divided by R so that the all-reduce sums
them once.

Non-finite examples: an example whose loss or gradient norm is NaN/inf gets
clip factor 0 (`tf_pxg.GradientTape.clipped_gradient_sum`) and adds exactly
0 to the clipped sum; the step happens anyway. Whether an update is applied
never depends on the data: a step skipped because some example is
non-finite would reveal, through the weights, something about one example
(e.g. whether a planted NaN record was sampled) that no noise covers; see
`tf_pxg.dp.clipping`. Non-finite values that are not any example's — a
weight regulariser's gradient, a parameter, the noise — propagate as in
plain Keras (they depend only on the model and the step count, which the
mechanism may reveal), so a model that diverges ends up with NaN weights as
it would without DP.

The step limit (privacy budget): the apply is gated, data-independently, by
`optimizer.iterations < limit`, with `limit` the model's step-limit
variable (`step_limit_variable`; `tf_pxg.keras.PrivacyCallback` sets it to
the most logical steps its target ε allows; int64 max means none). A
physical batch past the limit changes no weight, optimizer slot or
`iterations`, whatever `steps_per_execution`, `accumulation_steps` or the
strategy; so ε, computed from `iterations`, is the ε of the steps that
updated the weights. Gated at the end of a logical step (`step_end`),
without a conditional under XLA (`_apply_then_undo`), and in cross-replica
context under MirroredStrategy.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import keras
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.dp import mechanisms as dp_mechanisms
from tf_pxg.dp import noise as dp_noise
from tf_pxg.keras import _validation
from tf_pxg.keras import losses as pe_losses
from tf_pxg.gradient_tape import GradientTape


def _num_replicas() -> int:
  return tf.distribute.get_strategy().num_replicas_in_sync


# The model attribute holding an audit's clipped-sum hook (gradient
# canaries, `tf_pxg.audit.gradient_canaries.attach`), or None.
CLIPPED_SUM_HOOK = "_dp_clipped_sum_hook"

# The step-limit variable's "no limit".
NO_STEP_LIMIT = tf.int64.max


def step_limit_variable(model) -> tf.Variable:
  """The model's int64 step limit (made on first use, `NO_STEP_LIMIT`).

  The train step applies an update only while `optimizer.iterations <
  limit`. Made in an init scope (lifted out of a traced function), in the
  strategy scope when there is one; not a Keras-tracked weight and not
  saved: it is the budget of one `fit` (`PrivacyCallback` sets it at
  `on_train_begin` and resets it at `on_train_end`), not model state. A
  resumed run's callback sets it again from the restored `iterations`.
  """
  var = model.__dict__.get("_dp_step_limit")
  if var is None:
    with tf.init_scope():
      var = tf.Variable(NO_STEP_LIMIT, dtype=tf.int64, trainable=False,
                        name="dp_step_limit")
    object.__setattr__(model, "_dp_step_limit", var)
  return var


def _within_limit(optimizer, limit, step_end=None) -> tf.Tensor:
  """Whether this physical batch's update is applied: another optimizer
  step is allowed (`iterations < limit`) and, unless `step_end` is None (a
  plain batch), the batch ends a logical step. Data-independent; read it
  before the apply moves `iterations`."""
  go = tf.less(tf.cast(optimizer.iterations, tf.int64),
               tf.cast(limit, tf.int64))
  return go if step_end is None else tf.logical_and(step_end, go)


def _apply_then_undo(optimizer, grads, variables, keep):
  """`_apply_gated` without a conditional, for XLA.

  Under `jit_compile` on CPU a `tf.cond` around `optimizer.apply` costs
  several times a whole step. Instead the update is applied and, unless
  `keep`, every weight, optimizer slot and `iterations` is selected back to
  its value before the step (`tf.where`, which XLA fuses). The result is
  the same as not applying.
  """
  slots = [v for v in optimizer.variables if v is not optimizer.iterations]
  state = list(variables) + slots
  before = [tf.identity(v.value) for v in state]
  it_before = tf.identity(optimizer.iterations.value)
  with tf.control_dependencies(before + [it_before]):
    optimizer.apply(grads, variables)
  for v, old in zip(state, before):
    v.assign(tf.where(keep, v.value, old))
  optimizer.iterations.assign(
      tf.where(keep, optimizer.iterations.value, it_before))


def _apply_gated(optimizer, grads, variables, limit, xla=False,
                 step_end=None, transform=None):
  """Applies `grads` at `step_end` if `optimizer.iterations < limit`.

  Otherwise nothing changes (weights, slots, `iterations`). The gate is
  data-independent: `step_end` (None: always) comes from the sampler's
  schedule and `limit` from the budget, both equal on all replicas.
  `transform` (list -> list, e.g. the normalisation) is applied to `grads`
  just before `optimizer.apply`, inside the conditional where there is one
  in replica context, so physical batches that do not end a logical step
  skip it. Follows `keras.optimizers.LossScaleOptimizer`: under strategies
  that need `merge_call` (MirroredStrategy) the conditionals are taken in
  cross-replica context, since a replica-context conditional must not hold
  a synchronisation point (`transform` then runs before, in replica
  context). With `xla` (and no merge call) they are replaced by an undo,
  see `_apply_then_undo`.
  """
  if not optimizer.built:
    optimizer.build(variables)
  transform = transform or (lambda g: g)

  def when(go, fn):
    tf.cond(go, lambda: fn() and None, lambda: None)

  if _compat.strategy_supports_no_merge_call():
    if xla:
      _apply_then_undo(optimizer, transform(grads), variables,
                       _within_limit(optimizer, limit, step_end))
    else:
      when(_within_limit(optimizer, limit, step_end),
           lambda: optimizer.apply(transform(grads), variables))
    return
  grads = transform(grads)

  def cross_replica(distribution, grads, step_end):
    if step_end is not None:
      step_end = distribution.experimental_local_results(step_end)[0]

    def apply():
      distribution.extended.call_for_each_replica(
          lambda g: optimizer.apply(g, variables), args=(grads,))

    when(_within_limit(optimizer, limit, step_end), apply)

  tf.distribute.get_replica_context().merge_call(
      cross_replica, args=(grads, step_end))


def _regularization(model, variables):
  """The weight regularizers' loss and its gradients (None where none)."""
  with tf.GradientTape() as reg_tape:
    reg_losses = _compat.regularization_losses(model)
    reg_loss = (tf.add_n([tf.cast(r, tf.float32) for r in reg_losses])
                if reg_losses else tf.constant(0.0))
  if not reg_losses:
    return reg_loss, [None] * len(variables)
  return reg_loss, reg_tape.gradient(reg_loss, variables)


class Mechanism(NamedTuple):
  """The parts of the DP plan a step composes beyond the clip value.

  Attributes:
    clipping: the `tf_pxg.clipping` policy.
    clip_variable: the adaptive clip's variable (`QuantileAdaptive`), else
      None (the clip is the Python `l2_norm_clip`).
    count_stddev: the unclipped count's noise std (adaptive), else 0.
    gradient_noise_multiplier: sigma_g, the gradient noise's multiplier:
      the accounted `noise_multiplier` sigma, or with adaptive clipping
      `(sigma^-2 - (2 count_stddev)^-2)^-1/2` (Andrew et al., Theorem 1),
      less the noisy loss's share `z^-2` too when there is one.
    noise: the `tf_pxg.dp.mechanisms.NoiseMechanism` (independent, BandMF,
      secure, ...); the step calls its `add` and nothing else about it.
    noise_state: its state (`noise.init_state(...)`, held by the
      `DPOptimizer`), or None.
    optimizer: the optimizer whose `iterations` index the steps.
    noisy_loss: the `tf_pxg.dp.noisy_loss.NoisyLoss` released and logged
      as `loss`, else None.
  """
  clipping: Any
  clip_variable: Optional[tf.Variable]
  count_stddev: float
  gradient_noise_multiplier: float
  noise: Any
  noise_state: Any
  optimizer: Any
  noisy_loss: Any = None


class ReplicaGradients(NamedTuple):
  """What `dp_gradients` computed on one replica for one physical batch.

  Attributes:
    grads: this replica's noisy clipped-gradient sums, one per trainable
      variable (`model.trainable_variables` order), not yet normalised;
      meaningful only when `step_end` is true (or None).
    normalizer: scalar float32: the expected batch size qN of a Poisson
      step, or, for a plain batch, this replica's example count (the
      global batch size is its all-reduced sum); None when `grads` are
      already divided (the noise kernel divided them in its pass).
    reg_grads: the weight regularizers' gradients divided by R (None where
      a variable has none), added after normalisation.
    step_end: scalar bool, or None for a plain (non-Poisson) batch, which
      is always a whole step.
    x, y, y_pred, sample_weight, losses, mask, reg_loss: for the loss and
      metric trackers (`mask` None for a plain batch; for units of several
      rows the pair `(unit mask [P], row mask [P G])`, `losses` per unit).
    count: adaptive clipping's noisy unclipped count (this replica's share,
      meaningful at a step's end), else None.
    count_normalizer: the divisor for `count` and `loss_sum` (qN, or this
      replica's example count of a plain batch; all-reduced in
      `dp_apply`).
    mechanism: the step's `Mechanism` when `dp_apply` needs it (an
      adaptive clip to update), else None: a result that holds only
      tensors can be returned from a `tf.function` (a custom loop's
      compiled `dp_gradients`).
    finite: `[B]` (or `[P]` units) bool: the example's loss and gradient
      norm are finite (its clip factor was not zeroed); for the opt-in
      unprotected metrics, which must never see a non-finite example.
    loss_sum: `tf_pxg.dp.noisy_loss.NoisyLoss`'s noisy clamped loss sum
      (this replica's share, meaningful at a step's end), else None.
  """
  grads: list
  normalizer: tf.Tensor
  reg_grads: list
  step_end: Optional[tf.Tensor]
  x: Any
  y: Any
  y_pred: Any
  sample_weight: Any
  losses: tf.Tensor
  mask: Optional[tf.Tensor]
  reg_loss: tf.Tensor
  count: Optional[tf.Tensor] = None
  count_normalizer: Optional[tf.Tensor] = None
  mechanism: Optional[Mechanism] = None
  finite: Optional[tf.Tensor] = None
  loss_sum: Optional[tf.Tensor] = None


def dp_gradients(model: keras.Model, data, l2_norm_clip: float,
                 noise_multiplier: float, generator: tf.random.Generator,
                 accumulator_for=None,
                 mechanism: Optional[Mechanism] = None,
                 loss_scale=None) -> ReplicaGradients:
  """The replica-local part of a DP step: no cross-replica communication.

  Forward pass, per-example losses, flat per-example clipping, the logical
  step's accumulation and the noise (drawn only at a step's end);
  `dp_apply` normalises. It holds no synchronisation point, so it compiles
  as one XLA program per replica under any strategy (`tf.function(...,
  jit_compile=True)`), including MirroredStrategy on CPUs, whose optimizer
  step still needs `merge_call`.

  `data` is `(x, y, sample_weight)`. When `sample_weight` is the `info` dict
  of a Poisson physical batch (`tf_pxg.data`), padding rows are masked out,
  the clipped sums accumulate until the batch that ends the logical step,
  and the noisy sum is to be divided by the expected batch size; then
  `accumulator_for(variables)` must return the model's
  `tf_pxg.dp.accumulation.LogicalStepAccumulator`. Otherwise the batch is
  one logical step, to be divided by its realised global size.

  `loss_scale` (mixed_float16): the `keras.optimizers.LossScaleOptimizer`
  Keras compiled the model with. The backward pass runs on the per-example
  losses times its scale S (float16 gradients do not underflow); the
  norms and clip factors are those of the unscaled losses and the clipped
  sum is unscaled in the weighted sums (`clipped_gradient_sum`'s
  `gradient_scale`); the noise is added in float32 to that. An example
  whose scaled backward pass overflows has a non-finite norm, hence clip
  factor 0, like any non-finite example. S is read, never updated: Keras'
  dynamic scaling halves S and skips the step when the summed gradient is
  non-finite, a decision that here could only come from one example's
  overflow (the sum of zeroed examples is finite), so neither happens and
  the step and S are data-independent.

  `mechanism` (None: DP-SGD with flat clipping and independent noise)
  brings a clipping policy (automatic; adaptive, whose clip is a variable
  and whose unclipped count is accumulated with the sums and noised with
  them) and the `tf_pxg.dp.mechanisms.NoiseMechanism` with its state. The
  step composes clip -> `noise.add` -> normalise and never asks which
  mechanism it has: the step index is `optimizer.iterations`, and a step
  that will not be applied (not a logical step's end, past the step
  limit) passes `write=False`, so a stateful mechanism (BandMF's buffers)
  keeps its state.
  """
  from tf_pxg.data.batch_info import BatchInfo  # noqa: PLC0415

  # Under the model's XLA compilation, selects replace the conditionals and
  # the noise is drawn at every physical batch (used only at a step's end):
  # on CPU an XLA conditional copies every tensor it passes.
  xla = bool(getattr(model, "jit_compile", False))
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  # The one place the wire dict becomes the typed info (None: a plain batch).
  info = BatchInfo.from_element(sample_weight)
  if info is not None:
    sample_weight = info.weight
  # Eagerly a refused write has already run when it is seen: keep the
  # state to put back (in a graph the refusal comes at trace time).
  before = _eager_state(model)
  with GradientTape() as tape:
    if _compat.call_has_training_arg(model):
      y_pred = model(x, training=True)
    else:
      y_pred = model(x)
    losses = pe_losses.per_example_losses(model, y, y_pred, sample_weight)
    row_mask = None
    if info is not None and info.row_mask is not None:
      # Privacy units of G contiguous rows (augmult copies, a user's
      # examples): the unit's loss is the mean of its real rows' losses, so
      # its gradient is the mean of theirs, clipped as one. The engine takes
      # a `[P]` target over `[P G]` rows in one backward pass.
      row_mask = tf.cast(info.row_mask, losses.dtype)
      rows = tf.where(row_mask > 0, losses, tf.zeros_like(losses))
      units = tf.shape(info.mask)[0]
      rows = tf.reshape(rows, [units, -1])
      per_unit = tf.reshape(row_mask, [units, -1])
      losses = tf.reduce_sum(rows, axis=1) / tf.maximum(
          tf.reduce_sum(per_unit, axis=1), 1.0)
    if info is not None:
      # A padding row's loss is replaced by a constant: its output gradient,
      # hence its per-example gradient and norm, are exactly zero.
      mask = tf.cast(info.mask, losses.dtype)
      losses = tf.where(mask > 0, losses, tf.zeros_like(losses))
    scale = None
    target = losses
    if loss_scale is not None:  # mixed_float16: see the docstring
      scale = tf.cast(loss_scale.scale_loss(1.0), losses.dtype)
      target = losses * scale
  # Read after the forward pass: a lazily built model (e.g. a Sequential
  # without an Input) creates its variables in its first call.
  variables = list(model.trainable_variables)
  _validation.check_no_data_dependent_losses(model)
  with _restored_on_error(before):
    _validation.check_forward_side_effects(model, tape, data)
  clipping = None if mechanism is None else mechanism.clipping
  clip_variable = None if mechanism is None else mechanism.clip_variable
  clip = l2_norm_clip if clip_variable is None else clip_variable.read_value()
  if mechanism is not None:
    # A mechanism may read the recorded batch before the gradient drops it
    # (sparse embedding rows: the ids each example gathers,
    # tf_pxg.dp.sparse_selection); a no-op for the others.
    mechanism.noise.prepare(
        tape, variables, model=model, batch_size=tf.shape(losses)[0],
        mask=None if info is None else info.mask,
        step_end=None if info is None else info.step_end,
        xla=xla)
  # A non-finite example's clip factor is 0 there: nothing to check here.
  sums, norms = tape.clipped_gradient_sum(target, variables, clip,
                                          clipping=clipping,
                                          gradient_scale=scale)
  # An embedding's sum stays `IndexedSlices` up to the noise, which adds
  # its rows inside the fused noise loop (tf_pxg.dp.threefry).
  sums = [tf.zeros_like(v) if s is None else s
          for s, v in zip(sums, variables)]
  # Audits only: gradient canaries join the clipped sum through the hook
  # `tf_pxg.audit.gradient_canaries.attach` sets on the model (none
  # attached: `sums` unchanged at trace time). Read from the model, so
  # keras does not import audit (which imports keras).
  canary_hook = model.__dict__.get(CLIPPED_SUM_HOOK)
  if canary_hook is not None:
    sums = canary_hook(model, sums, variables, info, clip, clipping)
  replicas = _num_replicas()
  # Data-independent weight regularizers: unclipped, un-noised, once per
  # logical step (divided by R: the all-reduce sums the replicas' copies).
  reg_loss, reg_grads = _regularization(model, variables)

  finite = tf.logical_and(tf.math.is_finite(losses), tf.math.is_finite(norms))
  # Private scalars released with the sum, each `(value, noise std)`,
  # accumulated and noised as the gradient is: adaptive clipping's count,
  # the noisy training loss.
  scalars = {}
  if clip_variable is not None:  # adaptive: sum_b (1[||g_b|| <= C] - 1/2)
    scalars["count"] = (clipping.unclipped_count(
        norms, clip, None if info is None else info.mask),
                        mechanism.count_stddev)
  if mechanism is not None and mechanism.noisy_loss is not None:
    keep = finite if info is None else tf.logical_and(
        finite, info.mask > 0)
    scalars["loss_sum"] = (mechanism.noisy_loss.clamped_sum(losses, keep),
                           mechanism.noisy_loss.stddev)
  sums = sums + [value for value, _ in scalars.values()]
  if info is None:
    step_end, mask = None, None
    normalizer = tf.cast(tf.shape(losses)[0], tf.float32)
  else:
    step_end = info.step_end
    normalizer = info.normalizer
    sums = accumulator_for(variables).step(
        [dp_noise.densify(s) for s in sums], step_end, branchless=xla)
    mask = info.mask
    if row_mask is not None:
      mask = (mask, info.row_mask)  # per unit, per row (metrics)
  draw = None if xla else step_end
  noise = dp_mechanisms.IndependentGaussian() if mechanism is None else \
      mechanism.noise
  source = noise.noise_source(generator)
  released = {}
  if scalars:
    sums, tail = sums[:-len(scalars)], sums[-len(scalars):]
    released = {name: _noisy_scalar(value, stddev, source, replicas, draw)
                for (name, (_, stddev)), value in zip(scalars.items(), tail)}
  if mechanism is not None and noise_multiplier:
    # The gradient's share of the accounted noise (adaptive clipping keeps
    # the rest for the count), times the clip in use.
    noise_multiplier = mechanism.gradient_noise_multiplier
  # clip -> mechanism -> normalise. The divisor is known here for a Poisson
  # step (qN) or the only replica's batch: the mechanism divides in its
  # noise pass (one pass over the weights fewer); otherwise `dp_apply`
  # divides by the all-reduced batch size.
  # With no noise the sums are divided in `dp_apply` (as before the
  # mechanisms were parts): dividing them here, outside the apply's
  # conditional, fails in Keras' graph apply for weight-regularized models
  # (tests/test_keras_dp.py::test_weight_regularizer_added_unclipped).
  divide = bool(noise_multiplier) and (info is not None or replicas == 1)
  noisy = _add_noise(model, noise, mechanism, sums, clip, noise_multiplier,
                     normalizer if divide else None, source, replicas,
                     step_end, draw)
  normalizer = None if divide else normalizer
  reg_grads = [None if r is None else r / replicas for r in reg_grads]
  count_normalizer = None
  if released:
    count_normalizer = (info.normalizer if info is not None else
                        tf.cast(tf.shape(losses)[0], tf.float32))
  return ReplicaGradients(noisy, normalizer, reg_grads, step_end, x, y,
                          y_pred, sample_weight, losses, mask, reg_loss,
                          released.get("count"), count_normalizer,
                          None if clip_variable is None else mechanism,
                          finite, released.get("loss_sum"))


def _eager_state(model):
  """`(variable, value)` of the model's non-trainable variables when
  executing eagerly (the ones a forward pass may write), else None."""
  if not tf.executing_eagerly():
    return None
  return [(v, tf.identity(v.value)) for v in model.non_trainable_variables]


@contextlib.contextmanager
def _restored_on_error(state):
  """Assigns `state` back if the body raises (a refused eager write)."""
  try:
    yield
  except Exception:
    for v, value in state or ():
      v.assign(value)
    raise


def _noisy_scalar(value, stddev, generator, replicas, draw):
  """`value + N(0, stddev^2 / R)`: this replica's share of a noisy released
  scalar, e.g. the count (drawn only when `draw` is true or None)."""
  if not stddev:
    return value
  share = dp_noise.replica_noise_stddev(stddev, replicas)
  add = lambda: dp_noise.add_gaussian_noise(  # noqa: E731
      [tf.reshape(value, [1])], share, generator=generator)[0][0]
  if draw is None:
    return add()
  return tf.cond(draw, add, lambda: tf.identity(value))


def _add_noise(model, noise, mechanism, sums, clip, noise_multiplier,
               normalizer, source, replicas, step_end, draw):
  """`noise.add(...)`: this replica's noisy sums (divided by `normalizer`
  unless None), drawn only when `draw` is true or None (a physical batch
  that does not end its logical step discards them). The mechanism's state
  is written only if this step is applied: at a logical step's end and
  within the step limit (both data-independent)."""
  state = None if mechanism is None else mechanism.noise_state
  optimizer = None if mechanism is None else mechanism.optimizer
  step = write = None
  if optimizer is not None:
    step = optimizer.iterations
    write = _within_limit(optimizer, step_limit_variable(model), step_end)

  def noisy():
    return noise.add(sums, state, step, noise_multiplier=noise_multiplier,
                     l2_norm_clip=clip, num_replicas=replicas, source=source,
                     normalizer=normalizer, write=write)[0]

  if draw is None:
    return noisy()
  return tf.cond(draw, noisy, lambda: [
      tf.cast(dp_noise.densify(g), noise.noise_dtype(g.dtype))
      for g in sums])


def dp_apply(model: keras.Model, result: ReplicaGradients, optimizer,
             xla: bool = False):
  """The synchronising part of a DP step: all-reduce, apply, metrics.

  At a logical step's end, and while `optimizer.iterations` is below the
  model's step limit (`step_limit_variable`), applies `result.grads` with
  `optimizer` (whose all-reduce sums the replicas' noisy shares). Returns
  the logs: nothing computed from the private batch by default (see
  `_unprotected_metrics` for why, and for the opt-in): the learning rate,
  the `NoisyLoss` release as `loss` when there is one, and the adaptive
  clip (a function of noisy counts) when there is one. Nothing here depends on
  whether an example was non-finite (its clip factor was 0).
  """
  variables = list(model.trainable_variables)
  if not optimizer.built:  # not inside a conditional
    optimizer.build(variables)
  limit = step_limit_variable(model)
  replicas = _num_replicas()
  ctx = tf.distribute.get_replica_context()
  step_end = result.step_end
  normalizer = result.normalizer
  if (normalizer is not None and step_end is None and ctx is not None and
      replicas > 1):
    # Plain batches: the global batch is the sum of the replicas' shares,
    # which differ for a partial last batch.
    normalizer = ctx.all_reduce(tf.distribute.ReduceOp.SUM, normalizer)

  def normalise(sums):
    grads = [tf.cast(g if normalizer is None else
                     g / tf.cast(normalizer, g.dtype), v.dtype)
             for g, v in zip(sums, variables)]
    return [g if r is None else g + tf.cast(r, g.dtype)
            for g, r in zip(grads, result.reg_grads)]

  clip_variable = (None if result.mechanism is None else
                   result.mechanism.clip_variable)
  if clip_variable is not None:
    _update_adaptive_clip(result, clip_variable, optimizer, limit, ctx,
                          replicas)
  if result.loss_sum is not None:
    _track_noisy_loss(model, result, optimizer, limit, ctx, replicas)
  _apply_gated(optimizer, result.grads, variables, limit, xla=xla,
               step_end=step_end, transform=normalise)

  # Keras' step needs at least one logged tensor; the learning rate is
  # data-independent (Keras' LR callbacks log it under this key too).
  logs = {"learning_rate": tf.identity(optimizer.learning_rate)}
  if getattr(model, "unprotected_training_metrics", False):
    logs.update(_unprotected_metrics(model, result))
  if result.loss_sum is not None:
    # The noisy, accounted loss (tf_pxg.dp.noisy_loss): safe to log.
    logs["loss"] = _compat.loss_tracker(model).result()
  if clip_variable is not None:
    # A function of the noisy counts only: post-processing, safe to log.
    logs["l2_norm_clip"] = clip_variable.read_value()
  return logs


def _released_scalar(value, n, result, ctx, replicas):
  """A released scalar and its divisor, summed over the replicas (their
  noise shares add up to the whole noise, once)."""
  if ctx is not None and replicas > 1:
    value = ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)
    if result.step_end is None:  # plain batches: the global batch size
      n = ctx.all_reduce(tf.distribute.ReduceOp.SUM, n)
  return value, n


def _track_noisy_loss(model, result, optimizer, limit, ctx, replicas):
  """Adds the step's noisy mean loss to Keras' loss tracker (logged as
  `loss`, averaged over the epoch's steps) at an applied step; other
  physical batches weigh 0 (no conditional)."""
  loss_sum, n = _released_scalar(result.loss_sum, result.count_normalizer,
                                 result, ctx, replicas)
  weight = tf.cast(_within_limit(optimizer, limit, result.step_end),
                   tf.float32)
  _compat.loss_tracker(model).update_state(
      loss_sum / tf.cast(n, tf.float32), sample_weight=weight)


def _unprotected_metrics(model, result: ReplicaGradients) -> dict:
  """The compiled loss and metrics on the private batch, opt-in only.

  By default the DP step logs nothing computed from the batch: a training
  loss or accuracy on the private batch is not noised, so one example moves
  it without bound, turns it into NaN (a planted `inf` record: membership
  in the log), and through callbacks that read the logs (`TerminateOnNaN`,
  `EarlyStopping`, `ReduceLROnPlateau`) decides how many steps run or the
  learning rate: data-dependent control that no noise covers.

  With the opt-in, the values are computed as Keras does, padding rows
  excluded, and logged under `unprotected_<name>` keys, so no callback
  that monitors `loss` or a metric's own name reads them unless told to.
  They are not covered by ε. Non-finite examples (clip factor 0) are
  replaced by zeros and weighted 0, so no logged value is NaN because of
  one example; a finite outlier still moves them without bound.
  """
  x, y, y_pred, losses = result.x, result.y, result.y_pred, result.losses
  sample_weight, mask = result.sample_weight, result.mask
  row_mask = None
  if isinstance(mask, tuple):  # privacy units of several rows
    mask, row_mask = mask
  finite = tf.cast(result.finite, losses.dtype)
  losses = tf.where(result.finite, losses, tf.zeros_like(losses))
  mask = finite if mask is None else tf.cast(mask, losses.dtype) * finite
  if row_mask is not None:  # the metrics see rows: a unit's G rows
    rows = tf.reshape(tf.repeat(finite, tf.shape(row_mask)[0] //
                                tf.shape(finite)[0]), [-1])
    row_mask = tf.cast(row_mask, losses.dtype) * rows
  rows = mask if row_mask is None else row_mask
  y = _zero_rows(y, rows)
  y_pred = _zero_rows(y_pred, rows)
  noisy_loss = result.loss_sum is not None  # owns Keras' loss tracker
  if not noisy_loss:
    _compat.loss_tracker(model).update_state(
        losses + tf.cast(result.reg_loss, losses.dtype), sample_weight=mask)
  with _compat.metrics_masked(model, rows):
    logs = model.compute_metrics(
        x, y, y_pred, sample_weight=rows if sample_weight is None else
        _rows_times(sample_weight, rows))
  return {f"unprotected_{k}": v for k, v in logs.items()
          if not (noisy_loss and k == "loss")}


def _zero_rows(nest, rows):
  """Floating tensors of `nest` with the rows where `rows` is 0 set to 0
  (a select: `inf * 0` would be NaN)."""
  def zero(t):
    if t is None or not t.dtype.is_floating or t.shape.rank == 0:
      return t
    keep = tf.reshape(rows > 0, [-1] + [1] * (t.shape.rank - 1))
    return tf.where(keep, t, tf.zeros_like(t))
  return tf.nest.map_structure(zero, nest)


def _update_adaptive_clip(result, clip_variable, optimizer, limit, ctx,
                          replicas):
  """`C <- C exp(-eta (noisy_count / n + 1/2 - gamma))` at an applied step.

  The replicas' noisy count shares are all-reduced (summed: their noise
  adds up to `N(0, count_stddev^2)`, once), so every replica computes the
  same new clip; it is assigned only where the step's update is applied
  (a logical step's end, within the step limit), decided before the apply
  moves `iterations`.
  """
  count, n = _released_scalar(result.count, result.count_normalizer, result,
                              ctx, replicas)
  go = _within_limit(optimizer, limit, result.step_end)
  new = result.mechanism.clipping.next_clip(clip_variable.read_value(), count,
                                            n)
  clip_variable.assign(tf.where(go, new, clip_variable.read_value()))


# The closed forward pass: every DP step runs as a traced graph -------------

# Where the privacy argument and the debugging advice are.
_CLOSED_FORWARD_DOC = ('docs/threat_model.md, "The forward pass is closed: '
                       'eager mode"; docs/testing.md, "How to debug a DP '
                       'model"')


def refuse_functions_run_eagerly(model, where: str) -> None:
  """Raises if `tf.config.run_functions_eagerly(True)` is set.

  The DP step must run as a traced graph (see `traced_step`); that flag
  makes every `tf.function`, Keras' train function included, run its
  Python eagerly, which reopens the exits the trace closes.

  Raises:
    ValueError: naming the flag, the model and what to do instead.
  """
  if tf.config.functions_run_eagerly():
    raise ValueError(
        f"Model {model.name!r}.{where}: tf.config.run_functions_eagerly(True) "
        "is set, which runs the DP train step's Python eagerly. tf_pxg "
        "always traces the DP step (with compile(run_eagerly=True) too): "
        "eagerly, a Python branch on a tensor, `.numpy()`, "
        "tf.numpy_function/tf.py_function or a tensor kept on a layer "
        "between batches would let one example change the other examples' "
        "gradients, outside what clipping bounds. Call "
        "tf.config.run_functions_eagerly(False) before training; to debug, "
        "use tf.print in the layer or compile(run_eagerly=True) (the step "
        f"is still traced, the rest of fit runs eagerly); see "
        f"{_CLOSED_FORWARD_DOC}.")


def is_python_read(error: Exception) -> bool:
  """Whether `error`, raised while tracing the step, is the forward pass
  reading a tensor's value in Python (a branch on a tensor, `.numpy()`,
  a tensor kept on a layer from another trace)."""
  if isinstance(error, tf.errors.OperatorNotAllowedInGraphError):
    return True
  text = str(error)
  if isinstance(error, AttributeError):
    return "'numpy'" in text
  return isinstance(error, (TypeError, ValueError)) and (
      "out of scope" in text or "cannot be accessed from here" in text)


@contextlib.contextmanager
def closed_forward(model):
  """Turns a trace-time Python exit of the forward pass into a ValueError
  that names the model, why it is refused and what to do (the original
  error chained)."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    if not is_python_read(e):
      raise
    raise ValueError(
        f"Model {model.name!r}: its forward pass reads a tensor's value in "
        f"Python ({type(e).__name__}: {str(e).strip()[:600]}). A Python "
        "branch on a batch value, `.numpy()`, or a tensor kept on a layer "
        "from one batch to the next would let one example change how the "
        "other examples are processed, outside what clipping bounds. tf_pxg "
        "traces the DP train step in every mode, compile(run_eagerly=True) "
        "included, so such a value is refused here. Write it with row-wise "
        "TF ops (e.g. tf.where on each example's own values), keep state in "
        "a tf.Variable only if it is data-independent, and debug with "
        f"tf.print; see {_CLOSED_FORWARD_DOC}.") from e


def traced_step(model, key: str, fn):
  """`fn(data)` run as the model's traced `tf.function` (cached on the model
  under `key`) when called eagerly, else `fn(data)` itself.

  The DP step's forward pass always runs in a graph: a Python-side value of
  the batch (a branch, `.numpy()`, `tf.numpy_function`, an attribute kept
  between calls) is then a trace-time error or an op that the graph checks
  refuse, as in `tf.function`, instead of a silent exit from the recorded
  computation. Eager callers (a custom loop calling `train_step` or
  `dp_gradients` directly) get the same traced step; `fit` and
  `train_on_batch` trace it through `make_train_function` even with
  `run_eagerly=True` (`_DPTrainingMixin.make_train_function`).

  `fn`'s result must be returnable from a `tf.function` (tensors, nests,
  None).

  Raises:
    ValueError: `tf.config.run_functions_eagerly(True)` is set
      (`refuse_functions_run_eagerly`), or the forward pass reads a tensor's
      value in Python (`closed_forward`).
  """
  def guarded(data):
    with closed_forward(model):
      return fn(data)

  if not tf.executing_eagerly():
    return guarded
  refuse_functions_run_eagerly(model, key.strip("_"))
  function = model.__dict__.get(key)
  if function is None:
    # Without autograph, as Keras traces its train function: a Python `if`
    # on a tensor is an error, not a silent tf.cond.
    function = tf.function(guarded, reduce_retracing=True, autograph=False)
    # Not tracked by Keras or tf.train.Checkpoint (not model state).
    object.__setattr__(model, key, function)
  return function


def dp_train_step(model: keras.Model, data, l2_norm_clip: float,
                  noise_multiplier: float, generator: tf.random.Generator,
                  optimizer, accumulator_for=None, mechanism=None,
                  loss_scale=None):
  """One DP-SGD (physical) step: `dp_gradients` then `dp_apply`."""
  result = dp_gradients(model, data, l2_norm_clip, noise_multiplier,
                        generator, accumulator_for, mechanism, loss_scale)
  return dp_apply(model, result, optimizer,
                  xla=bool(getattr(model, "jit_compile", False)))


def _rows_times(weight, mask):
  """`weight * mask` with the `[P]` mask broadcast over trailing axes."""
  mask = tf.reshape(mask, [-1] + [1] * (weight.shape.rank - 1))
  return weight * tf.cast(mask, weight.dtype)
