"""A non-finite example gets clip factor 0; the DP step always happens.

An example whose loss or gradient norm is NaN/inf must contribute exactly 0
to the clipped sum (a select, not a multiply: 0 * inf = NaN), the other
examples' contributions must be unchanged, and the update must be applied
(a skipped step would depend on one example: an unbounded leak). Checked
against a closed form computed with a plain `tf.GradientTape` loop over
single examples: `w_new = w - lr * sum_{b finite} clip(g_b) / B` (sigma = 0):

* the tape API (`clipped_gradient_sum`) for every kind of rule: Dense
  (ghost and materialised norms), Conv2D (native norms, `TF_PXG_NATIVE=0`,
  XLA), an embedding (gather), a bias, and an op without a rule (the
  vectorized fallback); the native row scaling on inf/NaN rows;
* Keras `train_on_batch` and `fit` (eager, tf.function, XLA; Poisson with
  accumulation; MirroredStrategy over 2 logical CPUs).
"""

import math
import os
import textwrap

import _multi_worker as multi_worker
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk
from tf_pxg.dp import clipping
from tf_pxg.rules import base

B = 8
BAD = 2  # the non-finite example


# Reference: single-example tf.GradientTape loop --------------------------


def _reference_sum(loss_fn, variables, batches, clip):
  """`sum_{b finite} clip(g_b)` per variable, the norms, and finiteness."""
  total = [np.zeros(v.shape, np.float64) for v in variables]
  norms, finite = [], []
  for one in batches:
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(*one))
    grads = [np.zeros(v.shape) if g is None else
             np.asarray(tf.convert_to_tensor(g), np.float64)
             for g in tape.gradient(loss, variables)]
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
    ok = math.isfinite(norm) and bool(np.isfinite(loss.numpy()))
    norms.append(norm)
    finite.append(ok)
    if ok:
      factor = min(1.0, clip / max(norm, 1e-12))
      total = [t + factor * g for t, g in zip(total, grads)]
  return total, np.array(norms), np.array(finite)


def _split(*arrays):
  return [tuple(a[b:b + 1] for a in arrays) for b in range(len(arrays[0]))]


def _check_tape(loss_fn, variables, arrays, mode="graph", clip=None,
                atol=1e-5):
  """`clipped_gradient_sum` over the batch equals the reference sum over the
  finite examples; returns the trace records."""
  ref, norms, finite = _reference_sum(loss_fn, variables, _split(*arrays),
                                      clip or 1.0)
  assert not finite[BAD] and finite.sum() == B - 1
  if clip is None:  # active for about half the finite examples
    clip = float(np.median(norms[finite]))
    ref, _, _ = _reference_sum(loss_fn, variables, _split(*arrays), clip)

  def run(*args):
    with tf_pxg.GradientTape() as tape:
      losses = loss_fn(*args)
    return tape.clipped_gradient_sum(losses, variables, clip)

  if mode == "graph":
    run = tf.function(run)
  elif mode == "jit":
    run = tf.function(run, jit_compile=True)
  with tf_pxg.testing.trace_rules() as records:
    sums, got_norms = run(*[tf.constant(a) for a in arrays])
  for s, r, v in zip(sums, ref, variables):
    s = np.asarray(tf.convert_to_tensor(s), np.float64)
    assert np.all(np.isfinite(s)), v.name
    np.testing.assert_allclose(s, r, rtol=1e-4, atol=atol, err_msg=v.name)
  got_norms = got_norms.numpy()
  np.testing.assert_allclose(got_norms[finite], norms[finite], rtol=1e-4)
  return records


def _forms(records, op_type, form="sq_norm"):
  return {r.get(form) for r in records
          if r["op_type"] == op_type and r["form"] == form}


def _rng():
  return np.random.default_rng(0)


# Tape API ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("form, rows, d, units", [
    ("ghost", 1, 3, 4),          # MatMul on [B, d]
    ("ghost", 2, 16, 16),        # 2 rows of 16: Grams are cheaper
    ("materialised", 16, 2, 3),  # 16 rows of 2: per-example gradient kept
])
@pytest.mark.parametrize("mode", ["eager", "graph", "jit"])
def test_dense_ghost_and_materialised(bad, form, rows, d, units, mode):
  rng = _rng()
  x = rng.standard_normal((B, rows, d)).astype("float32")
  x[BAD, 0, 1] = bad
  w = tf.Variable(rng.standard_normal((d, units)).astype("float32"))
  bias = tf.Variable(rng.standard_normal(units).astype("float32"))

  def loss_fn(x):
    h = tf.einsum("btd,du->btu", x, w) if rows > 1 else (
        tf.matmul(tf.reshape(x, [-1, d]), w))
    h = tf.nn.bias_add(tf.reshape(h, [-1, units]), bias)
    return tf.reduce_sum(tf.reshape(tf.tanh(h) ** 2, [-1, rows * units]), 1)

  records = _check_tape(loss_fn, [w, bias], [x], mode)
  op = "Einsum" if rows > 1 else "MatMul"
  assert _forms(records, op) == {form}
  assert _forms(records, "BiasAdd", "weighted_sum") <= {
      None, "from per-example"}


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_dense_head_non_finite_output_gradient(bad, mode):
  # An LM-head-like MatMul ([B*T, d] x [d, V], V > d) with ghost norms: its
  # weighted sum scales the smaller operand, the data; the bad example's
  # output gradient rows (inf/NaN from its loss scale, data finite) must
  # still add exactly 0.
  rng = _rng()
  t, d, v = 2, 8, 16
  x = rng.standard_normal((B, t, d)).astype("float32")
  scale = rng.uniform(0.5, 1.5, (B, 1)).astype("float32")
  scale[BAD] = bad
  w = tf.Variable(rng.standard_normal((d, v)).astype("float32") * .3)

  def loss_fn(x, scale):
    logits = tf.matmul(tf.reshape(x, [-1, d]), w)
    return tf.reduce_sum(tf.reshape(tf.tanh(logits), [-1, t * v]) * scale, 1)

  records = _check_tape(loss_fn, [w], [x, scale], mode)
  assert _forms(records, "MatMul") == {"ghost"}


@pytest.mark.parametrize("mode", ["eager", "graph", "jit"])
def test_nan_loss_with_finite_gradient_is_dropped(mode):
  # log of a negative number: the loss is NaN, its gradient 1/z finite; the
  # target's finiteness decides too.
  rng = _rng()
  x = rng.uniform(0.5, 1.5, (B, 3)).astype("float32")
  x[BAD] = -x[BAD]
  w = tf.Variable(rng.uniform(0.5, 1.5, (3, 2)).astype("float32"))

  def loss_fn(x):
    return tf.reduce_sum(tf.math.log(tf.matmul(x, w)), 1)

  _check_tape(loss_fn, [w], [x], mode)


def _conv_case(bad):
  rng = _rng()
  x = rng.standard_normal((B, 6, 6, 2)).astype("float32")
  x[BAD, 3, 2, 1] = bad
  k = tf.Variable(rng.standard_normal((3, 3, 2, 4)).astype("float32") * .5)

  def loss_fn(x):
    y = tf.nn.conv2d(x, k, 1, "SAME")
    return tf.reduce_sum(tf.reshape(tf.tanh(y), [-1, 6 * 6 * 4]) ** 2, 1)

  return loss_fn, [k], [x]


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_conv2d_native_norms(bad, native_ops):
  del native_ops
  records = _check_tape(*_conv_case(bad), mode="graph")
  assert _forms(records, "Conv2D") == {"native"}


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_conv2d_without_native_ops(bad, mode, monkeypatch):
  if mode == "graph":
    monkeypatch.setenv("TF_PXG_NATIVE", "0")
  records = _check_tape(*_conv_case(bad), mode=mode)
  assert _forms(records, "Conv2D") and "native" not in _forms(records,
                                                              "Conv2D")


@pytest.mark.parametrize("mode", ["eager", "graph", "jit"])
def test_embedding_gather(mode):
  rng = _rng()
  ids = rng.integers(0, 5, (B, 3)).astype("int32")
  ids[BAD] = ids[0]  # shares rows with a finite example
  scale = rng.uniform(0.5, 1.5, (B, 1, 1)).astype("float32")
  scale[BAD] = np.inf
  table = tf.Variable(rng.standard_normal((5, 4)).astype("float32"))

  def loss_fn(ids, scale):
    e = tf.gather(table, ids) * scale
    return tf.reduce_sum(tf.reshape(e, [-1, 12]) ** 2, 1)

  records = _check_tape(loss_fn, [table], [ids, scale], mode)
  assert {r["rule"] for r in records if r["op_type"] in
          ("GatherV2", "ResourceGather")} == {"_GatherRule"}


@pytest.mark.parametrize("mode", ["eager", "graph", "jit"])
def test_vectorized_fallback_op(mode):
  # RealDiv has no rule: d(x / w)/dw = -x / w^2, inf for the inf example.
  rng = _rng()
  x = rng.standard_normal((B, 3)).astype("float32")
  x[BAD, 1] = np.inf
  w = tf.Variable(rng.uniform(1.0, 2.0, 3).astype("float32"))

  def loss_fn(x):
    return tf.reduce_sum(tf.sin(x / w), 1)

  records = _check_tape(loss_fn, [w], [x], mode)
  assert {r["rule"] for r in records if r["op_type"] == "RealDiv"} == {
      "_VectorizedFallback"}


def test_clip_factors_select_zero_for_non_finite_norms():
  c = clipping.clip_factors(tf.constant([0.5, 4.0, np.inf, np.nan, 0.0]),
                            2.0).numpy()
  np.testing.assert_array_equal(c, [1.0, 0.5, 0.0, 0.0, 1.0])
  c = clipping.clip_factors(tf.constant([3.0, np.inf]), float("inf"))
  np.testing.assert_array_equal(c.numpy(), [1.0, 0.0])


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_native_scale_rows_zero_factor_gives_zeros(dtype, native_ops):
  t = np.arange(24, dtype=dtype.as_numpy_dtype).reshape(6, 4)
  t[2, 1], t[3, 0], t[4, 3] = np.inf, np.nan, -np.inf
  c = np.array([0.5, 0.0, 2.0], dtype.as_numpy_dtype)  # 2 rows per example
  got = native_ops.tf_pxg_scale_rows(tf.constant(t), tf.constant(c)).numpy()
  want = t.copy()
  want[2:4] = 0.0
  want *= np.repeat(c, 2)[:, None]
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("jit", [False, True])
def test_scale_examples_fallback_zero_factor_gives_zeros(jit):
  t = np.ones((3, 2, 2), np.float32)
  t[1, 0, 1] = np.nan
  t[1, 1, 0] = np.inf

  def run(t, c):
    swapped = tf.transpose(t, [1, 0, 2])  # batch on axis 1
    return (base.scale_examples(swapped, c, 3, axis=1),
            base.scale_examples(tf.reshape(t, [6, 2]), c, 3),
            base.drop_examples(tf.reshape(t, [6, 2]), c, 3))

  fn = tf.function(run, jit_compile=jit)
  axis1, rows, dropped = fn(tf.constant(t), tf.constant([2.0, 0.0, 1.0]))
  want = np.ones((3, 2, 2), np.float32) * np.array([2, 0, 1])[:, None, None]
  np.testing.assert_array_equal(np.swapaxes(axis1.numpy(), 0, 1), want)
  np.testing.assert_array_equal(rows.numpy().reshape(3, 2, 2), want)
  np.testing.assert_array_equal(
      dropped.numpy().reshape(3, 2, 2),
      np.ones((3, 2, 2)) * np.array([1, 0, 1])[:, None, None])


# Keras ---------------------------------------------------------------------

CLIP_Q = 0.5  # the clip is this quantile of the finite examples' norms


def _keras_data(case):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((B, 4)).astype("float32")
  y = rng.standard_normal((B, 2)).astype("float32")
  if case == "inf_feature":  # tanh saturates: finite loss, NaN gradient
    x[BAD, 1] = np.inf
  else:  # a NaN label: NaN loss and gradient
    y[BAD, 0] = np.nan
  return x, y


def _keras_model(clip, **compile_kwargs):
  keras.utils.set_random_seed(0)
  inp = keras.Input((4,))
  h = keras.layers.Dense(5, activation="tanh")(inp)
  out = keras.layers.Dense(2)(h)
  model = dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=0.0)
  model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse",
                **compile_kwargs)
  return model


LR = 0.5


def _expected(x, y, divisor):
  """(clip, expected weights after one step, initial weights)."""
  model = _keras_model(1.0)
  variables = model.trainable_variables
  mse = keras.losses.MeanSquaredError(reduction=None)

  def loss_fn(x, y):
    return mse(y, model(x))

  _, norms, finite = _reference_sum(loss_fn, variables, _split(x, y), 1.0)
  assert not finite[BAD] and finite.sum() == B - 1
  clip = float(np.quantile(norms[finite], CLIP_Q))
  total, _, _ = _reference_sum(loss_fn, variables, _split(x, y), clip)
  before = [v.numpy() for v in variables]
  return clip, [w - LR * t / divisor for w, t in zip(before, total)], before


def _assert_weights(model, want):
  for v, w in zip(model.trainable_variables, want):
    got = v.numpy()
    assert np.all(np.isfinite(got)), v.path
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=v.path)


MODES = {"eager": dict(run_eagerly=True), "graph": {},
         "jit": dict(jit_compile=True)}


@pytest.mark.parametrize("case", ["inf_feature", "nan_label"])
@pytest.mark.parametrize("mode", list(MODES))
def test_train_on_batch_drops_the_example(case, mode):
  x, y = _keras_data(case)
  clip, want, _ = _expected(x, y, B)
  model = _keras_model(clip, **MODES[mode])
  model.train_on_batch(x, y)
  assert int(model.optimizer.iterations) == 1
  _assert_weights(model, want)


@pytest.mark.parametrize("case", ["inf_feature", "nan_label"])
@pytest.mark.parametrize("mode", list(MODES))
def test_poisson_fit_drops_the_example(case, mode):
  # q = 1 (batch_size = N): every example in the logical step, divided by
  # qN = B; two physical batches of 4 per step.
  x, y = _keras_data(case)
  clip, want, _ = _expected(x, y, B)
  model = _keras_model(clip, **MODES[mode])
  history = model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                      accumulation_steps=2, physical_batch_size=4,
                      sampling_seed=0)
  assert int(model.optimizer.iterations) == 1
  assert "dp_skipped_steps" not in history.history
  assert not any("skip" in k for k in history.history)
  _assert_weights(model, want)


def test_shuffled_fit_steps_per_execution_drops_the_example():
  x, y = _keras_data("inf_feature")
  clip, want, _ = _expected(x, y, B)
  model = _keras_model(clip, jit_compile=True, steps_per_execution=2)
  history = model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                      sampling="shuffled", shuffle=False)
  assert "dp_skipped_steps" not in history.history
  _assert_weights(model, want)


_MIRRORED = textwrap.dedent("""
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import keras
    """) + multi_worker.MIRRORED_TWO_CPUS + textwrap.dedent("""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_non_finite as t
    out = {}
    for case in ("inf_feature", "nan_label"):
      x, y = t._keras_data(case)
      clip, want, _ = t._expected(x, y, t.B)
      with strategy.scope():
        model = t._keras_model(clip)
      ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(t.B)
      logs = model.fit(ds, epochs=1, verbose=0, sampling="shuffled").history
      err = max(float(np.max(np.abs(v.numpy() - w)))
                for v, w in zip(model.trainable_variables, want))
      out[case] = dict(err=err, logged=sorted(logs),
                       iterations=int(model.optimizer.iterations.numpy()))
    print("RESULT", json.dumps(out))
    """)


def test_mirrored_two_replicas_drop_the_example():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = multi_worker.run_script(f"ROOT = {root!r}\n" + _MIRRORED,
                                   timeout=300)
  for case, r in result.items():
    assert r["iterations"] == 1, case
    assert r["err"] < 1e-5, (case, r)
    assert "dp_skipped_steps" not in r["logged"]
