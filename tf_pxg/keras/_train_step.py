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
variable (`step_limit_variable`, held in the `DPOptimizer`'s
`StepState`; `tf_pxg.keras.PrivacyCallback` sets it to
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
from tf_pxg.dp import step as dp_step
from tf_pxg.keras import _validation
from tf_pxg.keras import losses as pe_losses
from tf_pxg.gradient_tape import GradientTape


def _num_replicas() -> int:
  return tf.distribute.get_strategy().num_replicas_in_sync


def step_limit_variable(model) -> tf.Variable:
  """The model's int64 step limit: its compiled `DPOptimizer`'s
  (`tf_pxg.dp.step_state.StepState.step_limit`; not a Keras-tracked
  weight and not saved: it is the budget of one `fit`, which
  `PrivacyCallback` sets at `on_train_begin` and resets at
  `on_train_end`; a resumed run's callback sets it again from the
  restored `iterations`)."""
  return model._dp_run_state().step_limit  # pylint: disable=protected-access


def _within_limit(iterations, limit, step_end=None) -> tf.Tensor:
  """Whether this physical batch's update is applied: another optimizer
  step is allowed (`iterations < limit`) and, unless `step_end` is None (a
  plain batch), the batch ends a logical step. Data-independent; read it
  before the apply moves `iterations`."""
  go = tf.less(tf.cast(iterations, tf.int64), tf.cast(limit, tf.int64))
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
                       _within_limit(optimizer.iterations, limit, step_end))
    else:
      when(_within_limit(optimizer.iterations, limit, step_end),
           lambda: optimizer.apply(transform(grads), variables))
    return
  grads = transform(grads)

  def cross_replica(distribution, grads, step_end):
    if step_end is not None:
      step_end = distribution.experimental_local_results(step_end)[0]

    def apply():
      distribution.extended.call_for_each_replica(
          lambda g: optimizer.apply(g, variables), args=(grads,))

    when(_within_limit(optimizer.iterations, limit, step_end), apply)

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
    released: the side releases' noisy sums (this replica's shares,
      meaningful at a step's end), in `StepParts.releases` order.
    release_normalizer: their divisor (qN, or this replica's example count
      of a plain batch; all-reduced in `dp_apply`), None without releases.
    parts: the step's `StepParts` when `dp_apply` needs them (side releases
      to publish), else None: a result that holds only tensors can be
      returned from a `tf.function` (a custom loop's compiled
      `dp_gradients`).
    finite: `[B]` (or `[P]` units) bool: the example's loss and gradient
      norm are finite (its clip factor was not zeroed); for the opt-in
      unprotected metrics, which must never see a non-finite example.
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
  released: tuple = ()
  release_normalizer: Optional[tf.Tensor] = None
  parts: Optional[dp_step.StepParts] = None
  finite: Optional[tf.Tensor] = None


class Forward(NamedTuple):
  """The forward stage's result (`forward_losses`).

  Attributes:
    x, y, y_pred, sample_weight: the batch and the model's outputs.
    info: the batch's `tf_pxg.data.BatchInfo` (a plain batch's too).
    losses: `[B]` per-example (per-unit) losses, padding rows constant 0.
    target: what the backward pass differentiates (`losses`, times the
      loss scale under mixed_float16).
    scale: the loss scale, or None.
    tape: the `tf_pxg.GradientTape` that recorded the forward pass.
    variables: the trainable variables (read after the forward pass: a
      lazily built model makes them in its first call).
  """
  x: Any
  y: Any
  y_pred: Any
  sample_weight: Any
  info: Any
  losses: tf.Tensor
  target: tf.Tensor
  scale: Any
  tape: Any
  variables: list


def forward_losses(model: keras.Model, data, loss_scale=None) -> Forward:
  """Stage 1: the forward pass under a `tf_pxg.GradientTape`, per-example
  (per-unit) losses, padding rows' losses replaced by a constant (zero
  gradient and norm), and the checks of what the forward pass did.

  `data` is `(x, y, sample_weight)`; `sample_weight` may be the wire form
  of a sampler's `BatchInfo` (`tf_pxg.data`), else the batch is plain
  (`BatchInfo.plain`).

  Raises:
    ValueError: the forward pass mixes examples, writes state, or has a
      data-dependent loss (named by `_validation`).
  """
  from tf_pxg.data.batch_info import BatchInfo  # noqa: PLC0415

  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  # The one place the wire dict becomes the typed info.
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
    if info is None:
      info = BatchInfo.plain(tf.shape(losses)[0], sample_weight)
    if info.row_mask is not None:
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
    if not info.is_plain:
      # A padding row's loss is replaced by a constant: its output gradient,
      # hence its per-example gradient and norm, are exactly zero.
      mask = tf.cast(info.mask, losses.dtype)
      losses = tf.where(mask > 0, losses, tf.zeros_like(losses))
    scale, target = None, losses
    if loss_scale is not None:  # mixed_float16: see dp_gradients
      scale = tf.cast(loss_scale.scale_loss(1.0), losses.dtype)
      target = losses * scale
  variables = list(model.trainable_variables)
  _validation.check_no_data_dependent_losses(model)
  with _restored_on_error(before):
    _validation.check_forward_side_effects(model, tape, data)
  return Forward(x, y, y_pred, sample_weight, info, losses, target, scale,
                 tape, variables)


def dp_gradients(model: keras.Model, data, parts: dp_step.StepParts,
                 generator: tf.random.Generator,
                 loss_scale=None) -> ReplicaGradients:
  """The replica-local part of a DP step: no cross-replica communication.

  The stages: `forward_losses` (this module, Keras') -> `clip` ->
  `accumulate` -> `privatize` (`tf_pxg.dp.step`, framework-free, which a
  custom loop runs too); `dp_apply` then normalises,
  publishes the side releases and applies. It holds no synchronisation
  point, so it compiles as one XLA program per replica under any strategy
  (`tf.function(..., jit_compile=True)`), including MirroredStrategy on
  CPUs, whose optimizer step still needs `merge_call`.

  `data` is `(x, y, sample_weight)`. When `sample_weight` is the `info` dict
  of a Poisson physical batch (`tf_pxg.data`), padding rows are masked out,
  the clipped sums accumulate until the batch that ends the logical step
  (in the model's `LogicalStepAccumulator`), and the noisy sum is to be
  divided by the expected batch size. Otherwise the batch is one logical
  step, to be divided by its realised global size.

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

  `parts` (`StepParts`) brings the clipping policy (automatic; adaptive,
  whose clip is a variable), the side releases (accumulated with the sums
  and noised with them) and the `tf_pxg.dp.mechanisms.NoiseMechanism`
  with its state. The step never asks which mechanism it has: the step
  index is `optimizer.iterations`, and a step that will not be applied
  (not a logical step's end, past the step limit) passes `write=False`, so
  a stateful mechanism (BandMF's buffers) keeps its state.
  """
  # Under the model's XLA compilation, selects replace the conditionals and
  # the noise is drawn at every physical batch (used only at a step's end):
  # on CPU an XLA conditional copies every tensor it passes.
  xla = bool(getattr(model, "jit_compile", False))
  forward = forward_losses(model, data, loss_scale)
  info, variables = forward.info, forward.variables
  clipped = dp_step.clip(forward.tape, forward.target, forward.losses,
                         variables, info, parts,
                         gradient_scale=forward.scale, xla=xla)
  totals = dp_step.accumulate(clipped, info, variables, parts, xla=xla)
  # A stateful mechanism writes its state only at an applied step: a
  # logical step's end within the step limit (both data-independent).
  write = _within_limit(parts.step_index, step_limit_variable(model),
                        info.step_end)
  noisy, normalizer, released = dp_step.privatize(
      parts, totals, info, generator, write=write,
      num_replicas=_num_replicas(), xla=xla, variables=variables)
  # Data-independent weight regularizers: unclipped, un-noised, once per
  # logical step (divided by R: the all-reduce sums the replicas' copies).
  reg_loss, reg_grads = _regularization(model, variables)
  reg_grads = [None if r is None else r / _num_replicas() for r in reg_grads]
  mask = None if info.is_plain else info.mask
  if info.row_mask is not None:
    mask = (mask, info.row_mask)  # per unit, per row (metrics)
  return ReplicaGradients(
      noisy, normalizer, reg_grads, info.step_end, forward.x, forward.y,
      forward.y_pred, forward.sample_weight, forward.losses, mask, reg_loss,
      released, info.normalizer if released else None,
      parts if released else None, clipped.finite)


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


def dp_apply(model: keras.Model, result: ReplicaGradients, optimizer,
             xla: bool = False):
  """Stage 5, the synchronising part of a DP step: all-reduce, publish
  the side releases, apply, logs.

  At a logical step's end, and while `optimizer.iterations` is below the
  model's step limit (`step_limit_variable`), applies `result.grads` with
  `optimizer` (whose all-reduce sums the replicas' noisy shares). Returns
  the logs: nothing computed from the private batch by default (see
  `_unprotected_metrics` for why, and for the opt-in): the learning rate
  and the side releases (`NoisyLoss` as `loss`, averaged by Keras' loss
  tracker; a stateful release's state under its name, e.g. the adaptive
  clip as `l2_norm_clip`), functions of noised values only. Nothing here
  depends on whether an example was non-finite (its clip factor was 0).
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
    # Every gradient is made here (tf.identity where nothing else is): in
    # the apply's conditional, Keras' gradient all-reduce needs them all
    # from the branch's graph, not some captured from outside (a weight
    # regulariser's sum is made inside, the others would not be).
    grads = [tf.cast(g if normalizer is None else
                     g / tf.cast(normalizer, g.dtype), v.dtype)
             for g, v in zip(sums, variables)]
    return [tf.identity(g) if r is None else g + tf.cast(r, g.dtype)
            for g, r in zip(grads, result.reg_grads)]

  published = {}
  if result.released:
    published = _publish(model, result, optimizer, limit, ctx, replicas)
  _apply_gated(optimizer, result.grads, variables, limit, xla=xla,
               step_end=step_end, transform=normalise)

  # Keras' step needs at least one logged tensor; the learning rate is
  # data-independent (Keras' LR callbacks log it under this key too).
  logs = {"learning_rate": tf.identity(optimizer.learning_rate)}
  if getattr(model, "unprotected_training_metrics", False):
    logs.update(_unprotected_metrics(model, result))
  logs.update(published)
  return logs


def _publish(model, result, optimizer, limit, ctx, replicas) -> dict:
  """The side releases at an applied step (a logical step's end within the
  step limit, decided before the apply moves `iterations`): the replicas'
  noisy shares are all-reduced (summed: their noise adds up to the whole
  noise, once) and divided by the step's divisor; a stateful release's
  state becomes `next_state(state, estimate)` (every replica computes the
  same), a stateless one (`NoisyLoss`) goes to Keras' loss tracker (other
  physical batches weigh 0: no conditional). Returns the logs: functions
  of the noisy releases only."""
  n = result.release_normalizer
  if ctx is not None and replicas > 1:
    released = [ctx.all_reduce(tf.distribute.ReduceOp.SUM, v)
                for v in result.released]
    if result.step_end is None:  # plain batches: the global batch size
      n = ctx.all_reduce(tf.distribute.ReduceOp.SUM, n)
  else:
    released = list(result.released)
  go = _within_limit(optimizer.iterations, limit, result.step_end)
  parts = result.parts
  logs = {}
  for release, state, value in zip(parts.releases, parts.release_states,
                                   released):
    estimate = value / tf.cast(n, tf.float32)
    if state is None:
      _compat.loss_tracker(model).update_state(
          estimate, sample_weight=tf.cast(go, tf.float32))
      logs[release.name] = _compat.loss_tracker(model).result()
      continue
    old = state.read_value()
    state.assign(tf.where(go, tf.cast(release.next_state(old, estimate),
                                      old.dtype), old))
    logs[release.name] = state.read_value()
  return logs


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
  # A NoisyLoss release owns Keras' loss tracker (logged as `loss`).
  noisy_loss = result.parts is not None and any(
      not r.stateful for r in result.parts.releases)
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


def dp_train_step(model: keras.Model, data, parts: dp_step.StepParts,
                  generator: tf.random.Generator, optimizer, loss_scale=None):
  """One DP-SGD (physical) step: `dp_gradients` then `dp_apply`."""
  result = dp_gradients(model, data, parts, generator, loss_scale)
  return dp_apply(model, result, optimizer,
                  xla=bool(getattr(model, "jit_compile", False)))


def _rows_times(weight, mask):
  """`weight * mask` with the `[P]` mask broadcast over trailing axes."""
  mask = tf.reshape(mask, [-1] + [1] * (weight.shape.rank - 1))
  return weight * tf.cast(mask, weight.dtype)
