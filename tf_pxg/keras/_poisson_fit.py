"""The data path of a DP model's `fit` (see `tf_pxg.data.poisson`).

`fit_input` asks the sampler class of `fit(sampling=...)`
(`tf_pxg.data.samplers.resolve`) for its input: Keras' own batches for
`ShuffledSampler`, the masked stream below for every masked sampler
(`PoissonSampler` and its subclasses), whichever it is.

`prepare` turns `fit`'s arrays or tensors (any dtype, strings included)
into an endless `tf.data` stream of masked physical batches, sampled and
gathered by TF ops (`tf_pxg.data.poisson_dataset`: no Python generator),
and builds the model and its `LogicalStepAccumulator`. Keras' epochs then
count `k * steps_per_epoch` physical batches.

The stream is keyed by logical step: it starts at the model's
`optimizer.iterations` (0 for a fresh optimizer), so a run resumed from a
checkpoint (weights and optimizer restored) with the same `sampling_seed`
draws exactly the steps the uninterrupted run would have drawn from there
(a checkpoint holds no partial logical step: the accumulator is not model
state, so the step is redone from its first physical batch). Without a
seed, a fresh OS-entropy seed is drawn per `fit`: the law (independent
Poisson steps) is the same, the draws differ.

`secure_mode`: when the model has `_dp_secure_mode` True (set by the DP
models' `secure_mode=True`), every step's sampling randomness comes from the
OS CSPRNG (`tf_pxg.data.sampling_ops.urandom_keys`) and `sampling_seed`
raises.

A logical step that overflowed into extra physical batches shifts the
later steps' boundaries, so when `fit` ends the last logical step may be
unfinished: `finish` recomputes its remaining physical batches (the step is
a pure function of the seed and its index,
`start + optimizer.iterations - iterations at start`) and feeds them, so
every logical step that was started is completed, the same data as if the
epoch had been longer. If training was stopped early (e.g.
`PrivacyCallback`'s budget), or in secure mode (a step cannot be redrawn),
the unfinished step is discarded instead: nothing of it was released, and
`optimizer.iterations` (hence ε) counts only applied steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg import data as dp_data
from tf_pxg.data import participation
from tf_pxg.data import samplers
from tf_pxg.data import sampling_ops
from tf_pxg.keras import callbacks as dp_callbacks


@dataclasses.dataclass(frozen=True)
class FitData:
  """`fit`'s data arguments, as the user passed them (see `DPModel.fit`)."""
  x: Any
  y: Any
  batch_size: Optional[int]
  epochs: int
  initial_epoch: int
  callbacks: Any
  validation_split: float
  validation_data: Any
  validation_batch_size: Optional[int]
  shuffle: bool
  class_weight: Any
  sample_weight: Any
  steps_per_epoch: Optional[int]
  accumulation_steps: int
  physical_batch_size: Optional[int]
  sampling_seed: Optional[int]
  augmult: int
  user_ids: Any
  examples_per_user: Optional[int]


class FitInput:
  """What a sampler gives `keras.Model.fit`.

  Attributes:
    sampler: the run's `tf_pxg.data.samplers.Sampler` (its `dp_event` is
      what `PrivacyCallback` composes).
    keras_args: the data arguments of `keras.Model.fit` (`x`, ...,
      `callbacks`).
    finish: called with the model after Keras' `fit` returns.
  """

  def __init__(self, sampler, keras_args: dict,
               finish: Callable[[keras.Model], None] = lambda model: None):
    self.sampler = sampler
    self.keras_args = keras_args
    self.finish = finish


def fit_input(model, sampling, data: FitData) -> FitInput:
  """The input of `fit(sampling=...)`: the sampler class
  (`samplers.resolve`; of an instance, its class) picks its builder from
  `_BUILDERS` (by class, most derived first); every masked sampler (a
  `PoissonSampler` subclass) gets the fixed-shape masked stream. A class is
  built from the data and the model; an instance is used as it is, once
  checked against them.

  Raises:
    ValueError: an unknown `sampling`, data the sampler cannot draw from,
      or an instance that does not fit the data or the model (named, with
      the fix).
  """
  given = None if isinstance(sampling, (str, type)) else sampling
  sampler_class = samplers.resolve(sampling if given is None else
                                   type(given))
  # The one participation check (tf_pxg.data.participation): the class
  # before the data is read, the built instance after.
  mechanism, where = model.dp_plan.mechanism, f"Model {model.name!r}.fit"
  participation.check(sampler_class, mechanism, where)
  build = next(_BUILDERS[c] for c in sampler_class.__mro__ if c in _BUILDERS)
  run = build(model, sampler_class, data, given)
  participation.check(run.sampler, mechanism, where)
  return run


def _keras_batches(model, sampler_class, data: FitData,
                   given=None) -> FitInput:
  """Keras' own data path (`ShuffledSampler`): the data as given."""
  if data.augmult != 1 or data.user_ids is not None:
    raise ValueError("augmult and user_ids need sampling='poisson'.")
  sampler = given or sampler_class(batch_size=data.batch_size)
  return FitInput(sampler, dict(
      x=data.x, y=data.y, batch_size=data.batch_size,
      validation_split=data.validation_split,
      validation_data=data.validation_data,
      # Keras ignores (and warns about) `shuffle` for datasets.
      shuffle=data.shuffle and not isinstance(data.x, tf.data.Dataset),
      class_weight=data.class_weight, sample_weight=data.sample_weight,
      steps_per_epoch=data.steps_per_epoch,
      validation_batch_size=data.validation_batch_size,
      callbacks=data.callbacks))


def _masked_stream(model, sampler_class, data: FitData,
                   given=None) -> FitInput:
  """A masked sampler's endless stream of fixed-shape physical batches
  (`prepare`), stopped after the accounted number of logical steps."""
  dataset, feed, arrays, validation_data = prepare(
      model, data.x, data.y, data.sample_weight, data.class_weight,
      data.batch_size, data.validation_split, data.validation_data,
      data.accumulation_steps, data.physical_batch_size,
      data.steps_per_epoch, data.sampling_seed, augmult=data.augmult,
      user_ids=data.user_ids, examples_per_user=data.examples_per_user,
      sampler_class=sampler_class, sampler=given)
  inner = feed.sampler
  sampler = inner
  if data.augmult != 1 or data.user_ids is not None:
    sampler = samplers.PrivacyUnits(
        inner, "user" if data.user_ids is not None else "example",
        data.augmult, data.examples_per_user)
  callbacks = data.callbacks
  if data.steps_per_epoch is None:
    callbacks = with_step_limit(model, callbacks, inner,
                                data.epochs - data.initial_epoch)
  return FitInput(sampler, dict(
      x=dataset, validation_data=validation_data, shuffle=False,
      steps_per_epoch=inner.steps_per_epoch * inner.accumulation_steps,
      validation_batch_size=(data.validation_batch_size or data.batch_size or
                             32)
      if validation_data is not None and
      not isinstance(validation_data, tf.data.Dataset) else None,
      callbacks=callbacks), lambda m: finish(m, feed, arrays))


class _Feed:
  """The sampler of a `fit`, where its stream started, and how to finish."""

  def __init__(self, sampler, start_step: int):
    self.sampler = sampler
    self.start_step = int(start_step)

  def remaining(self, model, in_step: int) -> list:
    """The `PhysicalBatch`es left of the unfinished step (`in_step` fed)."""
    if self.sampler.secure_mode or in_step <= 0:
      return []
    done = int(model.optimizer.iterations.numpy()) - self.start_step
    stream = sampling_ops.index_stream(
        self.sampler, start_step=self.start_step + done, num_steps=1)
    batches = [dp_data.PhysicalBatch(i, m, bool(e))
               for i, m, e in stream.as_numpy_iterator()]
    return batches[in_step:]


def _to_arrays(dataset: tf.data.Dataset):
  """An unbatched finite dataset of `(x, y[, w])` as numpy arrays."""
  spec = dataset.element_spec
  if not isinstance(spec, tuple) or not 2 <= len(spec) <= 3:
    raise ValueError(
        "Poisson sampling of a tf.data.Dataset needs elements `(x, y)` or "
        f"`(x, y, sample_weight)` of single examples; got {spec}.")
  first = tf.nest.flatten(spec)[0]
  if first.shape.rank and first.shape[0] is None:
    raise ValueError(
        "fit got a batched tf.data.Dataset: its batches are fixed, not "
        "Poisson samples, so the ε of tf_pxg.accounting would not hold. "
        "Pass it unbatched with `batch_size=` (it is read into memory and "
        "Poisson-sampled), pass arrays, or pass `sampling='shuffled'` to "
        "train on its batches as they are.")
  if int(dataset.cardinality()) < 0:
    raise ValueError(
        "Poisson sampling needs the dataset size; this tf.data.Dataset has "
        "unknown or infinite cardinality. Pass arrays, a finite unbatched "
        "dataset (e.g. with tf.data.experimental.assert_cardinality(n)), or "
        "`sampling='shuffled'` to train on its own batches (no Poisson ε).")
  items = list(dataset.as_numpy_iterator())
  return tuple(tf.nest.map_structure(lambda *a: np.stack(a), *parts)
               for parts in zip(*items))


class _ShardFeed:
  """`fit` on `PoissonShards`: the stream from `start_step`, and the rest."""

  def __init__(self, shards, start_step: int):
    self.sampler = shards
    self.start_step = int(start_step)

  def rest(self, model, in_step: int):
    """`(dataset, count)` of the unfinished step's remaining batches."""
    if in_step <= 0:
      return None, 0
    step = int(model.optimizer.iterations.numpy())  # the unfinished one
    ds = self.sampler.dataset(start_step=step)
    count = sum(1 for _ in ds.map(lambda x, y, i: i).take_while(
        lambda i: tf.logical_not(
            dp_data.BatchInfo.from_element(i).step_end)))
    return ds.skip(in_step).take(count + 1 - in_step), count + 1 - in_step


def _prepare_shards(model, shards, y, sample_weight, class_weight,
                    batch_size, validation_split, accumulation_steps,
                    physical_batch_size, steps_per_epoch, seed):
  """`prepare` for `PoissonShards` (Beam output) given as `x`."""
  given = {"y": y, "sample_weight": sample_weight,
           "class_weight": class_weight, "validation_split":
           validation_split or None, "physical_batch_size":
           physical_batch_size, "steps_per_epoch": steps_per_epoch,
           "sampling_seed": seed}
  bad = [k for k, v in given.items() if v is not None]
  if bad:
    raise ValueError(
        f"fit on PoissonShards takes the sampling from the shards; do not "
        f"pass {bad} (labels come from the shards' parse_fn).")
  if batch_size is not None and batch_size != shards.expected_batch_size:
    raise ValueError(f"batch_size={batch_size}, but the shards were sampled "
                     f"with B={shards.expected_batch_size}; omit batch_size.")
  if accumulation_steps != shards.accumulation_steps:
    raise ValueError(
        f"accumulation_steps={accumulation_steps}, but the shards were laid "
        f"out with k={shards.accumulation_steps}; pass "
        f"accumulation_steps={shards.accumulation_steps}.")
  strategy = model.distribute_strategy
  if strategy.num_replicas_in_sync != shards.num_replicas:
    raise ValueError(
        f"The shards were laid out for {shards.num_replicas} replicas; this "
        f"model's strategy has {strategy.num_replicas_in_sync}. Rerun the "
        "pipeline with the matching num_replicas.")
  if shards.parse_fn is None:
    raise ValueError("fit on PoissonShards needs PoissonShards(dir, "
                     "parse_fn=...) to turn records into (x, y).")
  start = (int(model.optimizer.iterations.numpy())
           if getattr(model, "optimizer", None) is not None else 0)
  dataset = shards.dataset(start_step=start)
  x, y, _ = next(iter(dataset.take(1)))
  with strategy.scope():
    _compat.symbolic_build(model, data_batch=(x, y, None))
  with strategy.scope():
    model._dp_accumulator_for(list(model.trainable_variables)).reset()
  return dataset, _ShardFeed(shards, start), None, None


def _tensors(tree):
  """Arrays (numpy, lists, object arrays of str/bytes) as tensors."""
  def convert(a):
    if isinstance(a, tf.Tensor):
      return a
    a = np.asarray(a)
    return tf.convert_to_tensor(a.astype(bytes) if a.dtype == object else a)
  return None if tree is None else tf.nest.map_structure(convert, tree)


def prepare(model, x, y, sample_weight, class_weight, batch_size,
            validation_split, validation_data, accumulation_steps,
            physical_batch_size, steps_per_epoch, seed, augmult=1,
            user_ids=None, examples_per_user=None,
            sampler_class=dp_data.PoissonSampler, sampler=None):
  """The Poisson input of a DP `fit`, with the model and accumulator built.

  `sampler`: an instance to draw from (checked by `_check_instance`);
  None builds one of `sampler_class` from the data and the model.

  Returns:
    `(dataset, feed, data, validation_data)`: the endless dataset, its
    `_Feed`, the training `(x, y, sample_weight)` tensors, and the
    validation data (split off with `validation_split`).

  Raises:
    ValueError: data that cannot be Poisson-sampled (named, with the fix);
      `sampling_seed` given to a model in secure mode.
  """
  secure = bool(getattr(model, "_dp_secure_mode", False))
  if secure and seed is not None:
    raise ValueError(
        f"fit got sampling_seed={seed!r} for a model created with "
        "secure_mode=True: secure mode draws every step's sampling "
        "randomness from the OS CSPRNG, so a seed cannot apply. Drop "
        "`sampling_seed`, or create the model without secure_mode for a "
        "reproducible (test) run.")
  units = {"augmult": augmult, "user_ids": user_ids,
           "examples_per_user": examples_per_user}
  if isinstance(x, dp_data.PoissonShards):
    if augmult != 1 or user_ids is not None:
      raise ValueError("augmult and user_ids are not supported for "
                       "PoissonShards; pass arrays.")
    return _prepare_shards(model, x, y, sample_weight, class_weight,
                           batch_size, validation_split, accumulation_steps,
                           physical_batch_size, steps_per_epoch, seed)
  if isinstance(x, tf.data.Dataset):
    parts = _to_arrays(x)
    x, y = parts[0], parts[1]
    sample_weight = parts[2] if len(parts) == 3 else sample_weight
  elif isinstance(x, keras.utils.PyDataset) or (
      x is not None and not tf.nest.is_nested(x) and
      not hasattr(x, "shape")):
    raise ValueError(
        f"fit got {type(x).__name__} data: its batches are fixed, not "
        "Poisson samples. Pass arrays (or an unbatched finite "
        "tf.data.Dataset) for Poisson sampling, or `sampling='shuffled'` to "
        "train on these batches (no Poisson ε).")
  if y is None:
    raise ValueError("DP fit needs labels `y` (per-example losses).")
  if user_ids is not None:
    n_rows = dp_data.num_examples(x, y)
    users = dp_data.user_index(user_ids, n_rows, examples_per_user)
    if validation_split:
      raise ValueError("validation_split with user_ids would split users' "
                       "examples across training and validation; pass "
                       "validation_data.")
  elif examples_per_user is not None:
    raise ValueError("examples_per_user needs user_ids.")
  if validation_split and validation_data is None:
    (x, y, sample_weight), validation_data = _train_validation_split(
        (x, y, sample_weight), validation_split)
  if class_weight is not None:
    if sample_weight is not None:
      raise ValueError("Pass `sample_weight` or `class_weight`, not both.")
    sample_weight = _class_weight_to_sample_weights(np.asarray(y),
                                                    class_weight)
  x, y, sample_weight = _tensors(x), _tensors(y), _tensors(sample_weight)
  strategy = model.distribute_strategy
  n = dp_data.num_examples(x, y, sample_weight)
  start = (int(model.optimizer.iterations.numpy())
           if getattr(model, "optimizer", None) is not None else 0)
  if user_ids is not None:
    n = users.num_users  # sampled units are users
  if sampler is not None:
    _check_instance(model, sampler, n, secure, batch_size,
                    physical_batch_size, accumulation_steps,
                    steps_per_epoch, seed)
  else:
    # Every masked sampler is built from the one frozen config.
    sampler = sampler_class.from_config(samplers.SamplerConfig(
        n, min(32, n) if batch_size is None else batch_size,
        physical_batch_size=physical_batch_size,
        accumulation_steps=accumulation_steps,
        num_replicas=strategy.num_replicas_in_sync,
        steps_per_epoch=steps_per_epoch, seed=seed, secure_mode=secure,
        start_step=start, **_cyclic_groups(model)))
  feed = _Feed(sampler, start)
  feed.units = units
  dataset = dp_data.poisson_dataset(sampler, x, y, sample_weight,
                                    repeat=True, start_step=start, **units)
  # Build what is unbuilt (model, optimizer, compiled loss and metrics) on
  # plain tensors: Keras would otherwise build them under a strategy from
  # the first element of the stream, whose `sample_weight` slot is `info`.
  sample = tf.nest.map_structure(
      lambda a: a[:sampler.physical_batch_size], (x, y))
  with strategy.scope():
    _compat.symbolic_build(model, data_batch=(sample[0], sample[1], None))
  with strategy.scope():
    model._dp_accumulator_for(list(model.trainable_variables)).reset()
  return dataset, feed, (x, y, sample_weight), validation_data


def _check_instance(model, sampler, n, secure, batch_size,
                    physical_batch_size, accumulation_steps,
                    steps_per_epoch, seed):
  """Checks that a sampler instance given to `fit` draws from this data
  for this model: the same number of units, replicas, secure mode and
  cyclic groups (the optimizer's persisted `group_seed`), and no `fit`
  argument that the instance already fixes set to another value.

  Raises:
    ValueError: naming the first mismatch and the fix.
  """
  name = type(sampler).__name__
  groups = {"min_separation": 1, "group_seed": None,
            **_cyclic_groups(model)}
  expected = {
      "num_examples": n,
      "num_replicas": model.distribute_strategy.num_replicas_in_sync,
      "secure_mode": secure, "min_separation": groups["min_separation"]}
  if groups["min_separation"] > 1:
    expected["group_seed"] = groups["group_seed"]
  fixed = {"expected_batch_size": batch_size,
           "physical_batch_size": physical_batch_size,
           "accumulation_steps": None if accumulation_steps == 1 else
                                 accumulation_steps,
           "steps_per_epoch": steps_per_epoch}
  expected.update({k: v for k, v in fixed.items() if v is not None})
  for key, value in expected.items():
    if getattr(sampler, key, None) != value:
      raise ValueError(
          f"fit(sampling=<{name} instance>): its {key} is "
          f"{getattr(sampler, key, None)!r}, but this fit needs {value!r} "
          "(the data's units, the model's strategy, secure mode and noise "
          "mechanism, or fit's own argument). Build the sampler with "
          f"{key}={value!r}, or pass the class, sampling={name}, and fit "
          "builds it.")
  if seed is not None:
    raise ValueError(f"fit(sampling=<{name} instance>) takes the "
                     "instance's seed; drop sampling_seed.")


def _cyclic_groups(model) -> dict:
  """The sampler's cyclic-group arguments for the model's BandMF bands.

  The groups are drawn i.i.d. per example from the optimizer's persistent
  `group_seed` (`tf_pxg.keras._dp_state`), so a resumed `fit` keeps every
  example in its group and its participations stay b steps apart.
  """
  bands = model.min_separation
  if bands == 1:
    return {}
  seed = model.optimizer.dp_state.group_seed
  return {"min_separation": bands, "group_seed": int(seed.numpy())}


def finish(model, feed, data):
  """Completes (or, after an early stop, discards) an unfinished step."""
  accumulator = model._dp_accumulator_for(list(model.trainable_variables))
  in_step = int(accumulator.in_step.read_value())
  if model.stop_training:
    dataset, count = None, 0
  elif isinstance(feed, _ShardFeed):
    dataset, count = feed.rest(model, in_step)
  else:
    rest = feed.remaining(model, in_step)
    dataset, count = (dp_data.poisson_dataset(
        feed.sampler, *data, batches=lambda: rest,
        **getattr(feed, "units", {})), len(rest)) if rest else (None, 0)
  if count:
    iterator = iter(
        model.distribute_strategy.experimental_distribute_dataset(dataset))
    for _ in range(count):
      try:
        model.train_function(iterator)
      except StopIteration:
        break
  accumulator.reset()


class _StepLimit(keras.callbacks.Callback):
  """Stops training once `optimizer.iterations` reaches `limit`."""

  def __init__(self, limit: int):
    super().__init__()
    self.limit = limit

  def on_train_batch_end(self, batch, logs=None):
    if int(self.model.optimizer.iterations.numpy()) >= self.limit:
      self.model.stop_training = True


def with_step_limit(model, callbacks, sampler, epochs):
  """`callbacks` plus a stop after `accounting.steps_for(N, B, epochs)` steps.

  `ceil(N / B)` logical steps per epoch would run `epochs * ceil(N / B)`
  steps, more than the `ceil(epochs * N / B)` that
  `tf_pxg.accounting` (and `noise_multiplier_for_epsilon(epochs=...)`, the
  `tf-pxg` command) count for `epochs` epochs when `B` does not divide `N`;
  the limit makes `fit` run exactly the accounted number (with
  `steps_per_execution > 1`, Keras may run up to that many physical batches
  more, and a logical step they leave unfinished is discarded).
  """
  from tf_pxg import accounting  # noqa: PLC0415
  limit = int(model.optimizer.iterations.numpy()) + (
      accounting.steps_for(sampler.num_examples,
                           int(round(sampler.expected_batch_size)), epochs)
      if float(sampler.expected_batch_size).is_integer() else
      epochs * sampler.steps_per_epoch)
  return dp_callbacks.appended(callbacks, _StepLimit(limit))


def _train_validation_split(arrays, validation_split: float):
  """Keras' split for `validation_split`: the last `validation_split` of the
  rows (not shuffled) is held out; `None` entries stay `None`."""
  flat = [a for a in tf.nest.flatten(arrays) if a is not None]
  n = int(flat[0].shape[0])
  split_at = int(math.floor(n * (1.0 - validation_split)))
  if split_at == 0 or split_at == n:
    raise ValueError(
        f"validation_split={validation_split} leaves no rows for training or "
        f"for validation with {n} examples; change it or pass "
        "validation_data.")
  head = tf.nest.map_structure(
      lambda a: None if a is None else a[:split_at], arrays)
  tail = tf.nest.map_structure(
      lambda a: None if a is None else a[split_at:], arrays)
  return head, tail


def _class_weight_to_sample_weights(y: np.ndarray, class_weight: dict):
  """One weight per example from `class_weight` (class index -> weight):
  class ids, or one-hot / probability rows (their argmax), as Keras."""
  if y.ndim > 1 and y.shape[-1] > 1:
    y = np.argmax(y, axis=-1)
  y = np.reshape(y, [-1]).astype(np.int64)
  missing = sorted(set(y.tolist()) - set(int(k) for k in class_weight))
  if missing:
    raise ValueError(f"class_weight has no weight for classes {missing}.")
  return np.asarray([class_weight[int(c)] for c in y], np.float32)


# The builder of each kind of sampler's `fit` input (looked up along the
# sampler class's MRO): Keras' batches, or the masked stream.
_BUILDERS = {samplers.ShuffledSampler: _keras_batches,
             dp_data.PoissonSampler: _masked_stream}
