"""`check_example_independence`'s default search finds the exits of issue 49
on its own: no outlier planted in the batch, every argument left at its
default (`change="search"`, `index=None`).

1. One attack per class of issue 49's "Why", written the way a user writes
   it (keras.Sequential, functional models, subclassed layers, a plain
   callable): the check raises `ExampleMixingError`, names the moved
   examples, and the changed batch it found is recorded.
2. Well-behaved models (Dense, Embedding + LSTM, Conv2D, a transformer
   block, and the per-example cousins of the attacks: a fixed one-hot
   depth, a per-example ragged mean) pass: no false alarm.
3. The batch mixers of test_example_independence.py (MixUp included, which
   the explicit change of example 0 misses) fail the default search; the
   random layers pass it.
4. What the search tries: several examples, several directions, the
   largest id the model's Embedding accepts, a fallback when the model
   refuses an id.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import testing as pxg_testing

L = keras.layers
CHECK = pxg_testing.check_example_independence
B, T, V, D = 4, 8, 20, 4


def _ids(rng=None):
  """Token ids in [1, 12) (well below V), lengths 3..6 of T, 0-padded:
  no example is an outlier, none is full length."""
  rng = rng or np.random.default_rng(0)
  ids = np.zeros((B, T), np.int32)
  for b, n in enumerate([5, 3, 6, 4]):
    ids[b, :n] = rng.integers(1, 12, size=n)
  return ids


def _floats(rng=None):
  rng = rng or np.random.default_rng(1)
  return rng.standard_normal((B, D)).astype("float32")


def _labels():
  return np.array([0, 1, 2, 1])


def _compiled(model):
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return model


class Fn(L.Layer):
  """A user's one-off layer: `fn(inputs)`."""

  def __init__(self, fn, shape=None, **kwargs):
    super().__init__(**kwargs)
    self.fn, self.shape = fn, shape

  def call(self, inputs):
    return self.fn(inputs)

  def compute_output_shape(self, input_shape):
    return self.shape if self.shape is not None else input_shape


def _token_model(*middle, pool=None, embed=True):
  """ids [B, T] -> middle -> (Embedding) -> pool -> Dense(3)."""
  inputs = keras.Input((T,), dtype="int32")
  h = inputs
  for layer in middle:
    h = layer(h)
  if embed:
    h = L.Embedding(V, D)(h)
  h = (pool or L.GlobalAveragePooling1D())(h)
  return _compiled(keras.Model(inputs, L.Dense(3)(h)))


# 1. The attacks ----------------------------------------------------------


def one_hot_depth_from_ids():
  """Bag of tokens normalised by the vocabulary the batch shows:
  `tf.one_hot(ids, depth=tf.reduce_max(ids) + 1)`."""

  def bag(ids):
    depth = tf.reduce_max(ids) + 1
    counts = tf.reduce_sum(tf.one_hot(ids, depth=depth), axis=1)
    counts = counts / tf.cast(depth, counts.dtype)
    return tf.reshape(tf.pad(counts, [[0, 0], [0, V - depth]]), [-1, V])

  return _compiled(keras.Sequential([
      keras.Input((T,), dtype="int32"), Fn(bag, (None, V)), L.Dense(3)])), (
          _ids(), _labels())


class TrimToLongest(L.Layer):
  """`x[:, :max_len]`, `max_len` the batch's longest sequence."""

  def call(self, ids):
    lengths = tf.reduce_sum(tf.cast(ids != 0, tf.int32), axis=1)
    return ids[:, :tf.reduce_max(lengths)]

  def compute_output_shape(self, input_shape):
    return (input_shape[0], None)


def trim_to_longest():
  return _token_model(TrimToLongest()), (_ids(), _labels())


def where_on_rare_ids():
  """Ids among the batch's highest three become OOV (id 1):
  `tf.where(ids >= tf.reduce_max(ids) - 2, 1, ids)`."""
  rare = Fn(lambda ids: tf.where(ids >= tf.reduce_max(ids) - 2,
                                 tf.ones_like(ids), ids))
  return _token_model(rare), (_ids(), _labels())


def where_on_outlier_batch():
  """A plain callable: squash every input when the batch holds an outlier
  (`tf.where(tf.reduce_max(tf.abs(x)) > 10, tf.tanh(x), x)`)."""
  keras.utils.set_random_seed(0)
  dense = L.Dense(3)
  dense.build((None, D))

  def model(x, training=None):
    del training
    squash = tf.reduce_max(tf.abs(x)) > 10.0
    return dense(tf.where(squash, tf.tanh(x), x))

  return model, (_floats(), _labels()), dict(
      variables=dense.trainable_variables,
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=None))


def label_depth_from_labels():
  """A loss with label smoothing over the classes the batch shows:
  `tf.one_hot(y, depth=tf.reduce_max(y) + 1)` (the batch holds every
  class: only lowering the largest label moves it)."""

  def loss(y_true, logits):
    depth = tf.cast(tf.reduce_max(y_true), tf.int32) + 1
    smooth = 0.9 * tf.one_hot(y_true, depth) + 0.1 / tf.cast(depth,
                                                              tf.float32)
    smooth = tf.reshape(tf.pad(smooth, [[0, 0], [0, 3 - depth]]), [-1, 3])
    return keras.losses.categorical_crossentropy(smooth, logits,
                                                 from_logits=True)

  model = keras.Sequential([keras.Input((D,)), L.Dense(3)])
  return model, (_floats(), _labels()), dict(loss=loss)


class TileByLargestId(L.Layer):
  """Tile multiples from the batch: the mean embedding repeated
  `max(ids) // 4 + 1` times, then summed."""

  def call(self, inputs):
    ids, h = inputs
    mean = tf.reduce_mean(h, axis=1, keepdims=True)
    reps = tf.reduce_max(ids) // 4 + 1
    return tf.reduce_sum(tf.tile(mean, [1, reps, 1]), axis=1)

  def compute_output_shape(self, input_shapes):
    return (input_shapes[1][0], input_shapes[1][2])


def tile_multiples():
  inputs = keras.Input((T,), dtype="int32")
  h = TileByLargestId()([inputs, L.Embedding(V, D)(inputs)])
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


class PaddedMean(L.Layer):
  """A mean over the batch's padded length: the sum over the sequence
  divided by the row sum of `tf.broadcast_to(1., [B, max_len])`."""

  def call(self, inputs):
    ids, h = inputs
    max_len = tf.reduce_max(tf.reduce_sum(tf.cast(ids != 0, tf.int32), 1))
    ones = tf.broadcast_to(1.0, tf.stack([tf.shape(h)[0], max_len]))
    return tf.reduce_sum(h, axis=1) / tf.reduce_sum(ones, 1, keepdims=True)

  def compute_output_shape(self, input_shapes):
    return (input_shapes[1][0], input_shapes[1][2])


def broadcast_shape():
  inputs = keras.Input((T,), dtype="int32")
  h = PaddedMean()([inputs, L.Embedding(V, D)(inputs)])
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


class TermFrequency(L.Layer):
  """Token counts per example, `tf.math.bincount(ids, axis=-1)`, whose
  width is the batch's largest id + 1; their mean is a feature."""

  def call(self, ids):
    counts = tf.cast(tf.math.bincount(ids, axis=-1), tf.float32)
    return tf.reduce_mean(counts, axis=-1, keepdims=True)

  def compute_output_shape(self, input_shape):
    return (input_shape[0], 1)


def bincount_width():
  inputs = keras.Input((T,), dtype="int32")
  pooled = L.GlobalAveragePooling1D()(L.Embedding(V, D)(inputs))
  h = L.Concatenate()([pooled, TermFrequency()(inputs)])
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


class NoiseSeededByBatch(L.Layer):
  """Reproducible noise: `stateless_normal(seed=[sum(ids), 0])`."""

  def call(self, inputs):
    ids, h = inputs
    seed = tf.stack([tf.reduce_sum(tf.cast(ids, tf.int64)),
                     tf.constant(0, tf.int64)])
    return h + 0.1 * tf.random.stateless_normal(tf.shape(h), seed=seed)

  def compute_output_shape(self, input_shapes):
    return input_shapes[1]


def seed_from_ids():
  inputs = keras.Input((T,), dtype="int32")
  h = NoiseSeededByBatch()([inputs, L.Embedding(V, D)(inputs)])
  h = L.GlobalAveragePooling1D()(h)
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


class RunningPeak(L.Layer):
  """Normalises by the largest |activation| seen, written in a `tf.cond`
  branch into a non-trainable weight and read back."""

  def build(self, input_shape):
    self.peak = self.add_weight(shape=(), initializer="ones",
                                trainable=False, name="peak")

  def call(self, h):
    top = tf.reduce_max(tf.abs(h))
    updated = tf.cond(top > self.peak,
                      lambda: tf.identity(self.peak.assign(top)),
                      lambda: tf.identity(self.peak))
    with tf.control_dependencies([updated]):
      return h / tf.identity(self.peak.value)

  def compute_output_shape(self, input_shape):
    return input_shape


def state_in_cond_branch():
  keras.utils.set_random_seed(0)
  model = _compiled(keras.Sequential([
      keras.Input((D,)), L.Dense(6), RunningPeak(), L.Dense(3)]))
  return model, (_floats(), _labels())


class TokenMemory(L.Layer):
  """Remembers, per token id, the last sequence summary it appeared in (a
  `tf.lookup` table written and read back in the same call)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.table = tf.lookup.experimental.MutableHashTable(
        tf.int64, tf.float32, default_value=0.0)

  def call(self, inputs):
    ids, h = inputs
    ids = tf.cast(ids, tf.int64)
    summary = tf.reduce_mean(h, axis=[1, 2])  # [B]
    keys = tf.reshape(ids, [-1])
    values = tf.reshape(tf.broadcast_to(summary[:, None], tf.shape(ids)),
                        [-1])
    write = self.table.insert(keys, values)
    with tf.control_dependencies([write]):
      memory = tf.reshape(self.table.lookup(ids), [-1, T])
    return tf.reduce_sum(h, axis=1) + tf.reduce_mean(memory, 1,
                                                     keepdims=True)

  def compute_output_shape(self, input_shapes):
    return (input_shapes[1][0], input_shapes[1][2])


def lookup_table_state():
  inputs = keras.Input((T,), dtype="int32")
  h = TokenMemory()([inputs, L.Embedding(V, D)(inputs)])
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


class PackedContext(L.Layer):
  """Sequence packing: the batch's tokens packed into rows of 4 tokens
  (`RaggedTensor.from_row_starts` over the flat values, across example
  boundaries), each token given its packed row's mean."""

  def call(self, inputs):
    ids, h = inputs
    lengths = tf.reduce_sum(tf.cast(ids != 0, tf.int32), axis=1)
    per_example = tf.RaggedTensor.from_tensor(h, lengths=lengths)
    flat = per_example.flat_values
    packed = tf.RaggedTensor.from_row_starts(
        flat, tf.range(0, tf.shape(flat)[0], 4))
    context = tf.gather(tf.reduce_mean(packed, axis=1), packed.value_rowids())
    mixed = per_example.with_flat_values(flat + context)
    return tf.reduce_mean(mixed, axis=1)

  def compute_output_shape(self, input_shapes):
    return (input_shapes[1][0], input_shapes[1][2])


def ragged_packing():
  inputs = keras.Input((T,), dtype="int32")
  h = PackedContext()([inputs, L.Embedding(V, D)(inputs)])
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


# class of issue 49 -> the attacks of that class.
ATTACKS = {
    "integer statistic at an argument": [
        one_hot_depth_from_ids, trim_to_longest, where_on_rare_ids,
        where_on_outlier_batch, label_depth_from_labels],
    "size from the batch": [tile_multiples, broadcast_shape,
                            bincount_width],
    "seed from integer inputs": [seed_from_ids],
    "state written and read back": [state_in_cond_branch,
                                    lookup_table_state],
    "ragged partition across examples": [ragged_packing],
}
ATTACK_BUILDERS = {fn.__name__: fn for fns in ATTACKS.values() for fn in fns}


def _build(builder):
  keras.utils.set_random_seed(0)
  built = builder()
  model, (x, y) = built[:2]
  return model, x, y, (built[2] if len(built) > 2 else {})


@pytest.mark.parametrize("name", sorted(ATTACK_BUILDERS))
def test_default_search_finds_the_attack(name):
  model, x, y, kwargs = _build(ATTACK_BUILDERS[name])
  with pytest.raises(pxg_testing.ExampleMixingError) as info:
    CHECK(model, x, y, **kwargs)
  result = info.value.result
  assert result.moved, result
  assert all(i != b for i, b in result.moved)
  message = str(info.value)
  for i, b in result.moved:
    assert f"changing example {i} moved example {b}:" in message, message
  # The moved examples moved by more than rounding: at least 10 times the
  # tolerance, in the loss or the gradient.
  assert (result.max_loss_change > 10 * result.loss_tolerance or
          result.max_gradient_change > 10 * result.gradient_tolerance), result
  # The line names the change that found it.
  assert any("[" in line and "example" in line for line in result.details)


def test_default_search_in_function_mode():
  model, x, y, kwargs = _build(where_on_outlier_batch)
  result = CHECK(model, x, y, mode="function", raise_on_failure=False,
                 **kwargs)
  assert result.moved and not result.passed, result


def test_every_class_has_an_attack():
  assert len(ATTACKS) == 5 and all(ATTACKS.values())


# 2. No false alarm -------------------------------------------------------


def dense_mlp():
  return _compiled(keras.Sequential([
      keras.Input((D,)), L.Dense(8, activation="relu"), L.Dense(3)])), (
          _floats(), _labels())


def embedding_lstm():
  return _token_model(pool=L.LSTM(5)), (_ids(), _labels())


def conv2d():
  x = np.random.default_rng(2).standard_normal((B, 6, 6, 2)).astype(
      "float32")
  return _compiled(keras.Sequential([
      keras.Input((6, 6, 2)), L.Conv2D(3, 3, activation="relu"),
      L.GlobalAveragePooling2D(), L.Dense(3)])), (x, _labels())


def transformer_block():
  inputs = keras.Input((T,), dtype="int32")
  h = L.Embedding(V, 8)(inputs)
  a = L.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
  h = L.LayerNormalization()(h + a)
  f = L.Dense(8)(L.Dense(16, activation="gelu")(h))
  h = L.LayerNormalization()(h + f)
  h = L.GlobalAveragePooling1D()(h)
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


def one_hot_fixed_depth():
  return _compiled(keras.Sequential([
      keras.Input((T,), dtype="int32"),
      Fn(lambda ids: tf.reduce_sum(tf.one_hot(ids, depth=V), 1), (None, V)),
      L.Dense(3)])), (_ids(), _labels())


class PerExampleRaggedMean(L.Layer):

  def call(self, inputs):
    ids, h = inputs
    lengths = tf.reduce_sum(tf.cast(ids != 0, tf.int32), axis=1)
    return tf.reduce_mean(tf.RaggedTensor.from_tensor(h, lengths=lengths), 1)

  def compute_output_shape(self, input_shapes):
    return (input_shapes[1][0], input_shapes[1][2])


def ragged_per_example():
  inputs = keras.Input((T,), dtype="int32")
  h = PerExampleRaggedMean()([inputs, L.Embedding(V, D)(inputs)])
  return _compiled(keras.Model(inputs, L.Dense(3)(h))), (_ids(), _labels())


WELL_BEHAVED = [dense_mlp, embedding_lstm, conv2d, transformer_block,
                one_hot_fixed_depth, ragged_per_example]


@pytest.mark.parametrize("builder", WELL_BEHAVED,
                         ids=[f.__name__ for f in WELL_BEHAVED])
def test_well_behaved_model_passes_the_default_search(builder):
  model, x, y, kwargs = _build(builder)
  result = CHECK(model, x, y, **kwargs)
  assert result.passed and not result.exits, result
  assert result.changed_loss_change > 0, result
  # Several examples, several directions each.
  assert len(result.indices) >= 2 and len(result.changes) >= 2 * len(
      result.indices), result.changes


def test_scalar_weight_passes_the_default_search():
  """A scalar trainable weight (its gradient is 0-d)."""

  class Scale(L.Layer):

    def build(self, input_shape):
      self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, h):
      return h * self.scale

  model, (x, y) = _compiled(keras.Sequential([
      keras.Input((D,)), L.Dense(3), Scale()])), (_floats(), _labels())
  assert CHECK(model, x, y).passed


# 3. The batch mixers and the random layers under the default search -------


def _dense_model(*middle):
  """Input(D) -> Dense(6, relu) -> middle -> Dense(3)."""
  inputs = keras.Input((D,))
  h = L.Dense(6, activation="relu")(inputs)
  for layer in middle:
    h = layer(h)
  return _compiled(keras.Model(inputs, L.Dense(3)(h)))


def _centre(h):
  return h - tf.reduce_mean(h, axis=0, keepdims=True)


def _mixup():
  inputs = keras.Input((6, 6, 2))
  h = L.Conv2D(3, 3, activation="relu")(L.MixUp(alpha=0.2, seed=3)(inputs))
  model = _compiled(keras.Model(inputs, L.Dense(3)(
      L.GlobalAveragePooling2D()(h))))
  x = np.random.default_rng(11).standard_normal((B, 6, 6, 2))
  return model, x.astype("float32"), _labels()


def _two_tower():
  """In-batch negatives: logits[a, b] = z_a(query a) . z_b(item b)."""
  query, item = keras.Input((D,), name="query"), keras.Input((D,),
                                                            name="item")
  logits = L.Lambda(lambda t: tf.matmul(t[0], t[1], transpose_b=True),
                    output_shape=(None,))([L.Dense(4)(query),
                                           L.Dense(4)(item)])
  model = _compiled(keras.Model({"query": query, "item": item}, logits))
  rng = np.random.default_rng(11)
  x = {k: rng.standard_normal((B, D)).astype("float32")
       for k in ("query", "item")}
  return model, x, np.arange(B)


MIXERS = {
    "mixup": _mixup,
    "batchnorm_training": lambda: (_dense_model(L.BatchNormalization()),
                                   _floats(), _labels()),
    # Forward per example, backward mixed: only the gradients tell.
    "stop_gradient_centring": lambda: (_dense_model(Fn(
        lambda h: _centre(h) + tf.stop_gradient(
            tf.reduce_mean(h, 0, keepdims=True)))), _floats(), _labels()),
    "in_batch_negatives": _two_tower,
}


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_mixers_are_caught_by_the_default_search(name):
  """MixUp included: its draw maps example 0 to itself, so the explicit
  change of example 0 misses it (test_example_independence.py,
  `test_mixup_caveat`); the search changes several examples."""
  keras.utils.set_random_seed(7)
  model, x, y = MIXERS[name]()
  if name == "mixup":
    assert CHECK(model, x, y, change="perturb").passed
  with pytest.raises(pxg_testing.ExampleMixingError) as info:
    CHECK(model, x, y)
  assert info.value.result.moved


RANDOM_MODELS = {
    "dropout": lambda: _dense_model(L.Dropout(0.5)),
    # Unseeded TF op: the same op seeds after re-seeding.
    "unseeded_tf_random": lambda: _dense_model(Fn(
        lambda h: h * tf.cast(tf.random.uniform(tf.shape(h)) > 0.5,
                              h.dtype))),
}


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_random_layers_pass_the_default_search(name):
  keras.utils.set_random_seed(5)
  result = CHECK(RANDOM_MODELS[name](), _floats(), _labels())
  assert result.passed, result


# 4. What the search tries ------------------------------------------------


def test_search_changes_several_examples_in_several_directions():
  keras.utils.set_random_seed(0)
  model, x, y = _token_model(), _ids(), _labels()
  result = CHECK(model, x, y)
  # Example 0, the holder of the largest id and the longest sequence (2).
  assert result.indices[:2] == (0, 2), result.indices
  directions = {c.split(":")[0] for c in result.changes}
  assert {"perturb", "high", "low", "zeros"} <= directions, result.changes
  # "high" is the largest id the Embedding accepts, at every position.
  assert any(c.startswith("high") and f"set to {V - 1}" in c
             for c in result.changes), result.changes


class GatherRows(L.Layer):
  """A table lookup with no Embedding layer: ids beyond 11 are refused."""

  def build(self, input_shape):
    self.table = self.add_weight(shape=(12, D), initializer="normal")

  def call(self, ids):
    return tf.reduce_mean(tf.gather(self.table, ids), axis=1)

  def compute_output_shape(self, input_shape):
    return (input_shape[0], D)


def test_an_id_the_model_refuses_falls_back_to_the_batch_largest():
  model = _compiled(keras.Sequential([
      keras.Input((T,), dtype="int32"), GatherRows(), L.Dense(3)]))
  x = _ids()
  x[1, 0] = 11  # the largest id the table holds
  result = CHECK(model, x, _labels())
  assert result.passed, result
  assert any(c.startswith("high") and "set to 11" in c
             for c in result.changes), result.changes


def test_a_batch_the_search_cannot_change_is_an_error():
  model = _compiled(keras.Sequential([
      keras.Input((2,), dtype="string"),
      L.StringLookup(vocabulary=["a", "b"]), L.Embedding(4, 2),
      L.Flatten(), L.Dense(2)]))
  x = np.array([["a", "b"]] * B, dtype=object)
  with pytest.raises(ValueError, match="could not change the batch"):
    CHECK(model, x, None, loss=lambda out: tf.reduce_sum(out, -1))
