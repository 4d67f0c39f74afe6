"""Recurrent layers with `unroll=False` (a `While` loop in TF) and loops.

Every Keras recurrent layer, with its default `unroll=False`, is compared
with the plain `tf.GradientTape` loop over single examples
(`tf_pxg.testing`) in eager mode, `tf.function` and XLA: per-example
gradients, global norms and clipped sums. While the tape records,
`tf_pxg.tape.control_flow` unrolls loops with a static number of steps; a loop it
cannot see into raises. A DP `fit` step with an LSTM equals
`w - mean_b clip(g_b)`, also under MirroredStrategy (replica threads record
and unroll on their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing

from _keras_models import check_one_dp_fit_step
from _keras_models import MinimalRNNCell

L = keras.layers
MODES = pxg_testing.MODES
B = 3


def _sq_loss(outputs):
  outputs = tf.convert_to_tensor(outputs)
  return tf.reduce_sum(tf.reshape(tf.square(outputs),
                                  [tf.shape(outputs)[0], -1]), axis=1)


# name -> (layer factory, per-example input shape)
LAYERS = {
    "SimpleRNN_sequences": (lambda: L.SimpleRNN(
        3, return_sequences=True), (4, 2)),
    "LSTM": (lambda: L.LSTM(3), (4, 2)),
    "LSTM_go_backwards_sequences": (lambda: L.LSTM(
        3, go_backwards=True, return_sequences=True), (4, 2)),
    "GRU": (lambda: L.GRU(3), (4, 2)),
    "GRU_reset_before_go_backwards": (lambda: L.GRU(
        3, reset_after=False, go_backwards=True), (4, 2)),
    "Bidirectional_LSTM": (lambda: L.Bidirectional(L.LSTM(
        2, return_sequences=True)), (4, 2)),
    "RNN_custom_cell": (lambda: L.RNN(MinimalRNNCell(
        3, activation="tanh", kernel_initializer="glorot_uniform",
        recurrent_initializer="orthogonal")), (4, 2)),
    "ConvLSTM1D": (lambda: L.ConvLSTM1D(2, 3, padding="same"), (3, 5, 2)),
    "ConvLSTM2D": (lambda: L.ConvLSTM2D(2, 2), (2, 4, 4, 1)),
}


def _built(make, shape, data_seed, dtype=tf.float32):
  """`(layer, x)`: `make()` under Keras seed 0, built by calling it on a
  standard-normal batch `x` of `shape` (NumPy seed `data_seed`)."""
  keras.utils.set_random_seed(0)
  layer = make()
  x = tf.constant(np.random.default_rng(data_seed).standard_normal(shape),
                  dtype)
  layer(x)
  return layer, x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_recurrent_layer_matches_reference(name, mode):
  make, shape = LAYERS[name]
  layer, x = _built(make, (B,) + shape, data_seed=1)
  pxg_testing.check_per_example_gradients(
      _sq_loss, layer, layer.trainable_variables, x, mode=mode)


def _masked_text_model():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((6,), dtype="int32"),
      L.Embedding(12, 4, mask_zero=True),
      L.Bidirectional(L.GRU(3, return_sequences=True)),
      L.LSTM(2),
      L.Dense(2),
  ])
  # Varying numbers of unmasked steps (trailing zeros are masked).
  ids = np.array([[3, 4, 5, 6, 7, 8],
                  [2, 9, 1, 0, 0, 0],
                  [5, 0, 0, 0, 0, 0]], np.int32)
  return model, tf.constant(ids)


@pytest.mark.parametrize("mode", MODES)
def test_masked_stacked_recurrent_text_model_matches_reference(mode):
  model, ids = _masked_text_model()
  model(ids)
  pxg_testing.check_per_example_gradients(
      _sq_loss, model, model.trainable_variables, ids, mode=mode)


def test_lstm_float64_and_batch_of_one():
  layer, x = _built(lambda: L.LSTM(3, return_sequences=True,
                                   dtype="float64"),
                    (1, 4, 2), data_seed=2, dtype=tf.float64)
  for mode in ("eager", "function"):
    pxg_testing.check_per_example_gradients(
        _sq_loss, layer, layer.trainable_variables, x, mode=mode)


def test_gradient_equals_tf_gradient_tape_for_lstm_in_function():
  layer, x = _built(lambda: L.LSTM(3), (B, 4, 2), data_seed=3)

  @tf.function
  def both(x):
    with tf_pxg.GradientTape() as tape:
      ours = tf.reduce_sum(layer(x) ** 2)
    with tf.GradientTape() as ref_tape:
      ref = tf.reduce_sum(layer(x) ** 2)
    return (tape.gradient(ours, layer.trainable_variables),
            ref_tape.gradient(ref, layer.trainable_variables))

  ours, ref = both(x)
  for g, r in zip(ours, ref):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5,
                               atol=1e-6 * float(np.max(np.abs(r))))


@pytest.mark.parametrize("steps,seed,padded,pad_from", [
    (5, 4, 1, 3),
    # >= 8 steps: the chunked merge of `merge_uses`.
    (12, 6, 2, 7),
], ids=["T5", "T12_chunked"])
def test_dp_fit_step_with_lstm_equals_clipped_reference_update(
    steps, seed, padded, pad_from):
  """One fit step, SGD(1), no noise: w - mean_b clip(g_b) (flat clipping),
  with example `padded` masked from step `pad_from`."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, 30, (4, steps)).astype(np.int32)
  ids[padded, pad_from:] = 0
  y = rng.integers(0, 2, 4)
  layers = lambda: [keras.Input((steps,), dtype="int32"),
                    L.Embedding(30, 4, mask_zero=True), L.LSTM(3),
                    L.Dense(2)]
  check_one_dp_fit_step(layers, ids, y)


def test_raw_while_loop_on_a_parameter_raises_naming_loop_and_variable():
  w = tf.Variable(tf.ones([2, 2]), name="loop_kernel")
  x = tf.ones([B, 2])

  @tf.function
  def run(x):
    with tf_pxg.GradientTape() as tape:
      h = tf.while_loop(lambda i, h: i < 3,
                        lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                        (0, x))[1]
      losses = tf.reduce_sum(h, axis=1)
    return tape.per_example_gradient(losses, [w])

  with pytest.raises(ValueError, match=r"(?s)While.*loop_kernel.*loop"):
    run(x)


def test_keras_lstm_with_dynamic_length_raises_instead_of_none():
  keras.utils.set_random_seed(0)
  layer = L.LSTM(2)
  layer(tf.zeros([1, 3, 2]))

  @tf.function(input_signature=[tf.TensorSpec([None, None, 2])])
  def run(x):
    with tf_pxg.GradientTape() as tape:
      losses = tf.reduce_sum(layer(x), axis=1)
    return tape.per_example_norms(losses, layer.trainable_variables)

  with pytest.raises(ValueError, match=r"(?s)While.*lstm.*static"):
    run(tf.ones([B, 4, 2]))


def test_weight_shared_across_steps_is_one_merged_contraction():
  """The T uses of each LSTM weight merge into one interface: one sq_norm
  call per weight, the recurrent kernel by the Gram (ghost) form over steps,
  and no vectorized fallback."""
  layer, x = _built(lambda: L.LSTM(32), (B, 6, 4), data_seed=5)

  @tf.function
  def norms(x):
    with tf_pxg.GradientTape() as tape:
      losses = tf.reduce_sum(layer(x) ** 2, axis=1)
    return tape.per_example_norms(losses, layer.trainable_variables)

  with pxg_testing.trace_rules() as records:
    norms(x)
  calls = [r for r in records if r["form"] == "sq_norm"]
  assert len(calls) == 3, records  # kernel, recurrent kernel, bias
  assert not any(r["rule"] == "_VectorizedFallback" for r in records)
  # Recurrent kernel [32, 128] over T=6 rows: 6*(32+128) < 32*128.
  assert sum(r.get("sq_norm") == "ghost" for r in calls
             if r["op_type"] == "MatMul") >= 1, calls


def _concats_of_shape(fn, shape):
  """The ConcatV2 ops whose output has `shape` among the ops that `fn`'s
  outputs depend on (tensors built but never read are pruned by TF)."""
  graph = fn.get_concrete_function().graph
  seen, stack = set(), [t.op for t in graph.outputs]
  while stack:
    op = stack.pop()
    if op.name not in seen:
      seen.add(op.name)
      stack.extend(t.op for t in op.inputs)
      stack.extend(op.control_inputs)
  return [op for op in graph.get_operations() if op.name in seen and
          op.type == "ConcatV2" and op.outputs[0].shape.as_list() == shape]


def test_lstm_weights_share_one_row_concatenation():
  """An LSTM's kernel, recurrent kernel and bias meet the same output
  gradient dz_t at every step: their merged interfaces concatenate the T
  tensors once (`merge_uses._SharedRows`), not once per weight, and the
  norms still equal the reference loop's."""
  t, units = 5, 4
  layer, x = _built(lambda: L.LSTM(units), (B, t, 3), data_seed=7)

  @tf.function
  def norms():
    with tf_pxg.GradientTape() as tape:
      losses = _sq_loss(layer(x))
    return tape.per_example_norms(losses, layer.trainable_variables)

  gate_rows = _concats_of_shape(norms, [B, t, 4 * units])
  assert len(gate_rows) == 1, [op.name for op in gate_rows]
  reference = pxg_testing.reference_per_example_gradients(
      _sq_loss, layer, layer.trainable_variables, x)
  expected = np.sqrt(sum(np.sum(np.reshape(g, [B, -1]) ** 2, axis=1)
                         for g in reference))
  np.testing.assert_allclose(norms().numpy(), expected, rtol=1e-4)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("mode", MODES)
def test_lstm_long_sequence_norms_by_chunks_match_reference(mode, batch,
                                                            dtype):
  """T = 10 steps (>= merge_uses._MIN_CHUNKED_USES): each weight's uses
  merge into 4 chunks of consecutive steps, with no [B, T, 4u]
  concatenation; per-example gradients, norms and clipped sums equal the
  reference loop's. (At these sizes the chunks' gradients are materialised
  and added; the sum of every chunk pair's ghost terms is the per-example
  table's `LSTM_unroll_chunked_ghost`.)"""
  t, units = 10, 4
  layer, x = _built(lambda: L.LSTM(units, dtype=dtype), (batch, t, 3),
                    data_seed=9, dtype=dtype)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(
        _sq_loss, layer, layer.trainable_variables, x, mode=mode)
  chunked = [r for r in records if r["form"] == "chunked_sq_norm"]
  assert {r["op_type"] for r in chunked} == {"MatMul"}, records
  assert all(r["chunks"] == 4 for r in chunked), chunked

  @tf.function
  def norms():
    with tf_pxg.GradientTape() as tape:
      losses = _sq_loss(layer(x))
    return tape.per_example_norms(losses, layer.trainable_variables)

  assert not _concats_of_shape(norms, [batch, t, 4 * units])


def test_lstm_kernel_takes_ghost_norm_when_it_holds_less_memory():
  """T = 8 steps, 8 inputs, 4u = 64 gate units: the kernel's Grams cost
  8 (8 + 64) = 576 FLOPs per row against 8 * 64 = 512 materialised (within
  25 %), and hold 2 * 64 numbers per example against 512, so the ghost form
  is taken (`contraction._prefer_ghost`, for all 8 rows of the 4 chunks of
  steps); the norms equal the reference."""
  layer, x = _built(lambda: L.LSTM(16), (B, 8, 8), data_seed=8)

  @tf.function
  def norms(x):
    with tf_pxg.GradientTape() as tape:
      losses = _sq_loss(layer(x))
    return tape.per_example_norms(losses, layer.trainable_variables)

  with pxg_testing.trace_rules() as records:
    got = norms(x)
  forms = sorted(r.get("sq_norm") for r in records
                 if r["form"] == "chunked_sq_norm" and
                 r["op_type"] == "MatMul")
  assert forms == ["ghost", "ghost"], records
  reference = pxg_testing.reference_per_example_gradients(
      _sq_loss, layer, layer.trainable_variables, x)
  expected = np.sqrt(sum(np.sum(np.reshape(g, [B, -1]) ** 2, axis=1)
                         for g in reference))
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4)


_MIRRORED_LSTM = textwrap.dedent("""
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import tf_pxg.keras as dpk
    from tf_pxg import testing as pxg_testing
    L = keras.layers

    def layers():
      return [keras.Input((6,), dtype="int32"),
              L.Embedding(50, 4, mask_zero=True),
              L.Bidirectional(L.LSTM(3)), L.Dense(2)]

    rng = np.random.default_rng(0)
    x = rng.integers(1, 50, (8, 6)).astype("int32")
    x[2, 3:] = 0
    x[5, 1:] = 0
    y = rng.integers(0, 2, 8)
    keras.utils.set_random_seed(0)
    ref = keras.Sequential(layers())
    before = [w.copy() for w in ref.get_weights()]
    g = pxg_testing.reference_per_example_gradients(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                   reduction=None),
        ref, ref.trainable_variables, tf.constant(x), labels=tf.constant(y))
    # Some examples clipped, some not.
    clip = float(np.median(pxg_testing.per_example_global_norms(g)))
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
      model = dpk.DPSequential(layers(), l2_norm_clip=clip,
                               noise_multiplier=0.0)
      model.set_weights(before)
      model.compile(optimizer=keras.optimizers.SGD(1.0),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    before = [v.numpy() for v in ref.trainable_variables]
    pxg_testing.assert_dp_step_matches_reference(
        model.trainable_variables, before,
        pxg_testing.expected_dp_sgd_weights(before, g, clip),
        names=[v.path for v in model.trainable_variables])
    print("OK")
""")


def test_dp_fit_with_bidirectional_lstm_under_mirrored_strategy():
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
  proc = subprocess.run([sys.executable, "-c", _MIRRORED_LSTM], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
      proc.stdout[-2000:] + proc.stderr[-4000:])
