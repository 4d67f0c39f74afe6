"""The native norm ops: `TfPxgConv2DFilterSqNorm` /
`TfPxgConv2DFilterWeightedSum` and the depthwise
`TfPxgDepthwiseConv2DFilterSqNorm` / `TfPxgDepthwiseConv2DFilterWeightedSum`
(tf_pxg.rules.conv),
`TfPxgRowSumOfSquares` (tf_pxg.rules.base.row_sum_of_squares) and
`TfPxgScaleRows` (tf_pxg.rules.base.scale_examples).

The row op is checked against float64 NumPy sums of squares (rows of one
element to a million, empty tensors, float32/float64), its gradient against
2x, and its use by the rules (ghost norms of Dense layers and materialised
norms) against the reference loop, with the TF path under XLA. The row scaling is checked
exactly against NumPy (it is one multiplication per element) and its
gradient in closed form; its use by every rule's weighted sum is covered by
the per-example table and the DP-step tests.

The ops' definitions, ||sum over an example's rows of G_n||^2 with G_n the
filter gradient of row n, is checked against a float64 NumPy evaluation of
that sum (strided slices of the zero-padded input, contracted with dz) for
strides, dilations, explicit padding, several rows per example (also with
the examples minor, as after SpaceToBatchND), one input channel, channel counts that are not whole vectors, and both index dtypes;
and for `TfPxgConv2DFilterWeightedSum` sum_b c[b] G_b in the same cases,
an example with factor 0 and inf/NaN rows adding nothing (bit for bit),
many examples with most factors 0, and an empty batch. The rule's clipped
sums use it outside XLA (recorded as "native") for strided convolutions,
and TF's filter gradient for stride 1 and filters above
`FUSED_SUM_MAX_FILTER` entries.
The rule that uses it is checked against the plain `tf.GradientTape` loop
over single examples (`tf_pxg.testing.check_per_example_gradients`):
eagerly and in `tf.function` (native op) and under XLA (the patch path), at
B = 1 and 5, in float32 and float64, for VALID/SAME/EXPLICIT padding,
strides and dilations, with several rows per example and with a `None`
batch. One `fit` step of an unbuilt Keras convnet runs the op and equals
the noiseless DP-SGD step of the reference loop. Without the library the patch path runs.

The depthwise ops (a `DepthwiseConv2dNative`, or a `Conv2D` with one input
channel per group as in Keras' ConvNeXt) are checked against float64 NumPy
per-example filter gradients: squared norms, and clip-weighted sums in
which an example with factor 0 and inf/NaN rows adds nothing; channel
counts of several vector blocks and partial vectors, multipliers > 1,
strides, dilations, padding, kernels larger than the image, several rows
per example (also the examples minor). Both Keras forms use them outside
XLA (norms and weighted sums) and match the reference loop in the three
modes, and a DP `fit` step of a ConvNeXt-style block equals the reference
DP-SGD step.

The op must build on every machine of this kind (it has g++); run with
TF_PXG_NATIVE=0 to test without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import testing as pxg_testing
from _keras_models import check_one_dp_fit_step

F32, F64 = tf.float32, tf.float64


@pytest.fixture(scope="module")
def lib(native_ops):
  return native_ops


# The op against its definition ------------------------------------------------


def _per_example_definition(x, dz, ksize, strides, dilations, pads,
                            examples, minor=False):
  """[B, kh, kw, C, Cout]: sum over example b's rows n of G_n, in float64
  NumPy (rows b k .. b k + k - 1, or b, B + b, ... with `minor`).

  `pads` = (top, left, bottom, right) zeros around the input; G_n[i, j] is
  x's slice at offset (i d_h, j d_w), strided, contracted with dz[n].
  """
  top, left, bottom, right = pads
  x = np.pad(np.asarray(x, np.float64),
             [[0, 0], [top, bottom], [left, right], [0, 0]])
  dz = np.asarray(dz, np.float64)
  n, oh, ow, _ = dz.shape
  k = n // examples
  (kh, kw), (sh, sw), (dh, dw) = ksize, strides, dilations
  out = []
  for b in range(examples):
    rows = ([r * examples + b for r in range(k)] if minor else
            range(b * k, (b + 1) * k))
    out.append(sum(np.stack([np.stack([
        np.einsum("hwc,hwo->co",
                  x[row, i * dh:i * dh + (oh - 1) * sh + 1:sh,
                    j * dw:j * dw + (ow - 1) * sw + 1:sw], dz[row])
        for j in range(kw)]) for i in range(kh)]) for row in rows))
  return np.stack(out)


def _definition(x, dz, ksize, strides, dilations, pads, examples):
  """||sum_{rows n of example b} G_n||^2 per example, in float64 NumPy."""
  g = _per_example_definition(x, dz, ksize, strides, dilations, pads,
                              examples)
  return np.sum(g.reshape(examples, -1) ** 2, axis=1)


# (rows, H, W, C, ksize, strides, dilations, (top, left, bottom, right),
#  Cout, examples)
OP_CASES = {
    "cnn_conv1": (4, 28, 28, 1, (5, 5), (2, 2), (1, 1), (0, 0, 0, 0), 16, 4),
    "cnn_conv2": (5, 12, 12, 16, (4, 4), (2, 2), (1, 1), (0, 0, 0, 0), 32, 5),
    "padded_2_rows_each": (6, 9, 11, 3, (3, 2), (1, 2), (1, 1), (1, 0, 1, 1),
                           7, 3),
    "dilated_padded": (2, 7, 7, 20, (3, 3), (1, 1), (2, 1), (1, 1, 1, 1), 40,
                       2),
    "dilated_columns": (1, 6, 6, 17, (2, 3), (3, 1), (1, 3), (0, 2, 1, 1), 19,
                        1),
    "1x1": (3, 4, 5, 33, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 1, 3),
}


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64],
                         ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_op_matches_its_definition(lib, name, dtype, index_dtype):
  n, h, w, c, ksize, strides, dilations, pads, cout, examples = OP_CASES[name]
  rng = np.random.default_rng(sorted(OP_CASES).index(name))
  oh = (h + pads[0] + pads[2] - (ksize[0] - 1) * dilations[0] - 1) // (
      strides[0]) + 1
  ow = (w + pads[1] + pads[3] - (ksize[1] - 1) * dilations[1] - 1) // (
      strides[1]) + 1
  x = tf.constant(rng.standard_normal((n, h, w, c)), dtype)
  dz = tf.constant(rng.standard_normal((n, oh, ow, cout)), dtype)
  got = lib.tf_pxg_conv2d_filter_sq_norm(
      x, dz, tf.constant(examples, index_dtype), ksize=ksize,
      strides=strides, dilations=dilations, pads=pads[:2])
  assert got.dtype == dtype and got.shape == [examples]
  want = _definition(x, dz, ksize, strides, dilations, pads, examples)
  # Each entry of G sums P*k products of unit normals; float32 rounding of
  # those sums, relative to the norm.
  rtol = 1e-5 if dtype == F32 else 1e-12
  np.testing.assert_allclose(got.numpy(), want, rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_op_with_the_examples_minor(lib, dtype):
  """Rows [k, B] (as after SpaceToBatchND): example b's rows are b, B + b,
  ...; the same norms as the [B, k] rows."""
  n, h, w, c, ksize, strides, dilations, pads, cout, examples = OP_CASES[
      "padded_2_rows_each"]
  rng = np.random.default_rng(7)
  oh, ow = h + pads[0] + pads[2] - ksize[0] + 1, (
      w + pads[1] + pads[3] - ksize[1]) // strides[1] + 1
  x = rng.standard_normal((n, h, w, c))
  dz = rng.standard_normal((n, oh, ow, cout))
  k = n // examples

  def minor(t):  # [B*k] example-major -> [k*B] example-minor
    return t.reshape(examples, k, *t.shape[1:]).swapaxes(0, 1).reshape(
        t.shape)

  got = lib.tf_pxg_conv2d_filter_sq_norm(
      tf.constant(minor(x), dtype), tf.constant(minor(dz), dtype), examples,
      ksize=ksize, strides=strides, dilations=dilations, pads=pads[:2],
      batch_minor=True)
  want = _definition(x, dz, ksize, strides, dilations, pads, examples)
  np.testing.assert_allclose(got.numpy(), want,
                             rtol=1e-5 if dtype == F32 else 1e-12, atol=0)


def test_op_rejects_rows_that_do_not_split_into_examples(lib):
  x = tf.zeros([5, 4, 4, 2])
  dz = tf.zeros([5, 3, 3, 3])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="5 rows are not a whole number per example"):
    lib.tf_pxg_conv2d_filter_sq_norm(x, dz, 2, ksize=[2, 2], strides=[1, 1],
                                     dilations=[1, 1], pads=[0, 0])
  with pytest.raises(tf.errors.InvalidArgumentError, match="dz 4"):
    lib.tf_pxg_conv2d_filter_sq_norm(x, dz[:4], 5, ksize=[2, 2],
                                     strides=[1, 1], dilations=[1, 1],
                                     pads=[0, 0])


def test_op_on_an_empty_batch(lib):
  got = lib.tf_pxg_conv2d_filter_sq_norm(
      tf.zeros([0, 4, 4, 2]), tf.zeros([0, 3, 3, 3]), 0, ksize=[2, 2],
      strides=[1, 1], dilations=[1, 1], pads=[0, 0])
  assert got.shape == [0]


def _op_data(name, dtype, seed):
  n, h, w, c, ksize, strides, dilations, pads, cout, examples = OP_CASES[name]
  rng = np.random.default_rng(seed)
  oh = (h + pads[0] + pads[2] - (ksize[0] - 1) * dilations[0] - 1) // (
      strides[0]) + 1
  ow = (w + pads[1] + pads[3] - (ksize[1] - 1) * dilations[1] - 1) // (
      strides[1]) + 1
  x = rng.standard_normal((n, h, w, c))
  dz = rng.standard_normal((n, oh, ow, cout))
  attrs = dict(ksize=ksize, strides=strides, dilations=dilations,
               pads=pads[:2])
  return x, dz, examples, attrs, rng


def _assert_close_to(got, want, dtype):
  """Entries of `want` are sums of products of unit normals: float32
  rounding relative to the largest of them (never an rtol between
  float-noise values)."""
  scale = np.max(np.abs(want)) if want.size else 0.0
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=(1e-5 if dtype == F32 else 1e-12) * scale)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(OP_CASES))
def test_weighted_sum_matches_its_definition(lib, name, dtype):
  """TfPxgConv2DFilterWeightedSum: sum_b c[b] G_b, [kh, kw, C, Cout]; an
  example with factor 0 whose rows hold inf and NaN adds exactly nothing
  (bit for bit the result with finite rows there)."""
  x, dz, examples, attrs, rng = _op_data(name, dtype,
                                         sorted(OP_CASES).index(name))
  g = _per_example_definition(x, dz, pads=OP_CASES[name][7],
                              examples=examples, **{
                                  k: v for k, v in attrs.items()
                                  if k != "pads"})
  c = rng.uniform(0.1, 2.0, examples)
  c[0] = 0.0
  want = np.einsum("b,b...->...", c, g)
  k = x.shape[0] // examples
  finite = lib.tf_pxg_conv2d_filter_weighted_sum(
      tf.constant(x, dtype), tf.constant(dz, dtype), tf.constant(c, dtype),
      **attrs)
  x[:k], dz[:k] = np.inf, np.nan  # example 0's rows
  got = lib.tf_pxg_conv2d_filter_weighted_sum(
      tf.constant(x, dtype), tf.constant(dz, dtype), tf.constant(c, dtype),
      **attrs)
  assert got.dtype == dtype and got.shape == want.shape
  _assert_close_to(got.numpy(), want, dtype)
  np.testing.assert_array_equal(got.numpy(), finite.numpy())


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_weighted_sum_with_the_examples_minor(lib, dtype):
  """Rows [k, B] (as after SpaceToBatchND): example b's rows are b, B + b,
  ...; c[b] scales those."""
  x, dz, examples, attrs, rng = _op_data("padded_2_rows_each", dtype, 7)
  pads = OP_CASES["padded_2_rows_each"][7]
  g = _per_example_definition(x, dz, attrs["ksize"], attrs["strides"],
                              attrs["dilations"], pads, examples, minor=True)
  c = rng.uniform(0.1, 2.0, examples)
  got = lib.tf_pxg_conv2d_filter_weighted_sum(
      tf.constant(x, dtype), tf.constant(dz, dtype), tf.constant(c, dtype),
      batch_minor=True, **attrs)
  _assert_close_to(got.numpy(), np.einsum("b,b...->...", c, g), dtype)


def test_weighted_sum_of_many_examples_and_channels(lib):
  """Several groups of examples and threads' running sums, channel counts
  of several vectors plus a partial one, all factors 0 but some."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((37, 6, 6, 21))
  dz = rng.standard_normal((37, 4, 4, 35))
  attrs = dict(ksize=[3, 3], strides=[1, 1], dilations=[1, 1], pads=[0, 0])
  g = _per_example_definition(x, dz, (3, 3), (1, 1), (1, 1), (0, 0, 0, 0),
                              37)
  c = rng.uniform(0.1, 2.0, 37)
  c[rng.permutation(37)[:20]] = 0.0
  for dtype in (F32, F64):
    got = lib.tf_pxg_conv2d_filter_weighted_sum(
        tf.constant(x, dtype), tf.constant(dz, dtype), tf.constant(c, dtype),
        **attrs)
    _assert_close_to(got.numpy(), np.einsum("b,b...->...", c, g), dtype)
  zero = lib.tf_pxg_conv2d_filter_weighted_sum(
      tf.constant(x, F32), tf.constant(dz, F32), tf.zeros([37]), **attrs)
  np.testing.assert_array_equal(zero.numpy(), np.zeros([3, 3, 21, 35]))


def test_weighted_sum_rejects_rows_that_do_not_split_into_examples(lib):
  attrs = dict(ksize=[2, 2], strides=[1, 1], dilations=[1, 1], pads=[0, 0])
  x, dz = tf.zeros([5, 4, 4, 2]), tf.zeros([5, 3, 3, 3])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="5 rows are not a whole number per example"):
    lib.tf_pxg_conv2d_filter_weighted_sum(x, dz, tf.ones([2]), **attrs)
  with pytest.raises(tf.errors.InvalidArgumentError, match="dz 4"):
    lib.tf_pxg_conv2d_filter_weighted_sum(x, dz[:4], tf.ones([5]), **attrs)


def test_weighted_sum_on_an_empty_batch(lib):
  g = lib.tf_pxg_conv2d_filter_weighted_sum(
      tf.zeros([0, 4, 4, 2]), tf.zeros([0, 3, 3, 3]), tf.zeros([0]),
      ksize=[2, 2], strides=[1, 1], dilations=[1, 1], pads=[0, 0])
  np.testing.assert_array_equal(g.numpy(), np.zeros([2, 2, 2, 3]))


# The rule against the reference loop -------------------------------------------


def _conv(strides=1, padding="VALID", dilations=1):
  return lambda x, w: tf.nn.conv2d(x, w, strides, padding,
                                   dilations=dilations)


def _two_rows_per_example(x, w):
  """A conv over 2 images per example ([B, 2, H, W, C] as [2B, H, W, C], as
  `TimeDistributed` does): both rows' filter gradients add up."""
  b = tf.shape(x)[0]
  y = tf.nn.conv2d(tf.reshape(x, tf.concat([[2 * b], x.shape[2:]], 0)), w, 1,
                   "SAME")
  return tf.reshape(y, tf.concat([[b], [-1]], 0))


# name: (fn, example shape, filter shape)
RULE_CASES = {
    "VALID": (_conv(), (6, 5, 3), (2, 3, 3, 4)),
    "SAME_strides2": (_conv(2, "SAME"), (7, 6, 2), (3, 3, 2, 5)),
    "SAME_strides_1x2": (_conv([1, 2], "SAME"), (5, 8, 3), (4, 2, 3, 17)),
    "EXPLICIT": (_conv(1, [[0, 0], [2, 0], [1, 1], [0, 0]]), (4, 4, 1),
                 (3, 3, 1, 3)),
    "VALID_dilation2": (_conv(1, "VALID", 2), (6, 5, 2), (2, 2, 2, 3)),
    # Keras' dilated Conv2D: SpaceToBatchND, Conv2D on [k, B] rows.
    "keras_dilation2": (lambda x, w: tf.keras.ops.conv(
        x, w, padding="valid", dilation_rate=2), (6, 5, 2), (2, 2, 2, 3)),
    "SAME_dilation2": (_conv(1, "SAME", [2, 1]), (5, 5, 2), (3, 2, 2, 3)),
    "two_rows_per_example": (_two_rows_per_example, (2, 4, 4, 3),
                             (3, 3, 3, 2)),
}


def _model(name, dtype):
  fn, _, filter_shape = RULE_CASES[name]
  rng = np.random.default_rng(len(name))
  w = tf.Variable(rng.standard_normal(filter_shape), dtype=dtype, name="w")
  return (lambda x: fn(x, w)), w


def _loss(labels, outputs):
  d = outputs - tf.cast(labels, outputs.dtype)
  return 0.5 * tf.reduce_sum(tf.reshape(d * d, [tf.shape(d)[0], -1]), axis=1)


def _data(name, dtype, batch, model):
  rng = np.random.default_rng(batch + 100 * len(name))
  x = tf.constant(rng.standard_normal((batch, *RULE_CASES[name][1])), dtype)
  labels = tf.constant(rng.standard_normal(model(x).shape), dtype)
  return x, labels


@pytest.mark.parametrize("mode", pxg_testing.MODES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(RULE_CASES))
def test_rule_matches_reference(lib, name, dtype, batch, mode):
  del lib
  model, w = _model(name, dtype)
  x, labels = _data(name, dtype, batch, model)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(_loss, model, [w], x, labels,
                                            mode=mode)
  forms = {r.get("sq_norm") for r in records
           if r["form"] == "sq_norm" and r["op_type"] == "Conv2D"}
  sums = {r.get("weighted_sum") for r in records
          if r["form"] == "weighted_sum" and r["op_type"] == "Conv2D"}
  if mode == "jit":  # XLA cannot run the op: the patch path.
    assert forms and "native" not in forms, records
    assert "native" not in sums, records
  else:
    assert forms == {"native"}, records
    # Fused for strided (or 1x1) convolutions; TF's filter gradient else.
    assert sums == ({"native"} if "strides" in name else {None}), records


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_rule_with_a_dynamic_batch(lib, dtype):
  """One `tf.function` with a `None` batch, called on B = 5 and B = 1."""
  del lib
  name = "SAME_strides2"
  model, w = _model(name, dtype)

  # The labels' rank is static (a None batch): through a loss on labels of
  # unknown rank the engine cannot follow the batch axis and refuses.
  out_rank = model(tf.zeros([1, *RULE_CASES[name][1]], dtype)).shape.rank

  @tf.function(input_signature=[
      tf.TensorSpec([None, *RULE_CASES[name][1]], dtype),
      tf.TensorSpec([None] * out_rank, dtype)])
  def norms(x, labels):
    with tf_pxg.GradientTape() as tape:
      losses = _loss(labels, model(x))
    return tape.per_example_norms(losses, [w])

  for batch in (5, 1):
    x, labels = _data(name, dtype, batch, model)
    (ref,) = pxg_testing.reference_per_example_gradients(
        _loss, model, [w], x, labels)
    want = np.sqrt(np.sum(ref.numpy().reshape(batch, -1) ** 2, axis=1))
    got = norms(x, labels)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=0)
  assert "TfPxgConv2DFilterSqNorm" in {
      op.type for op in norms.get_concrete_function().graph.get_operations()}


def test_keras_fit_step_with_the_op(lib):
  """keras.io's MNIST convnet shape (no `Input`), numpy data: one DP `fit`
  step runs the native norms and equals the noiseless DP-SGD step of the
  reference loop."""
  del lib
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 12, 12, 1)).astype("float32")
  y = rng.integers(0, 3, 16).astype("int32")

  def make_layers():
    return [tf.keras.layers.Conv2D(8, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(8, 3, padding="same", strides=2,
                                   activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(3)]

  with pxg_testing.trace_rules() as records:
    check_one_dp_fit_step(make_layers, x, y, build_shape=x.shape)
  assert {r.get("sq_norm") for r in records
          if r["form"] == "sq_norm" and r["op_type"] == "Conv2D"} == {
              "native"}, records
  # The strided conv's clipped sum is fused, the other's is TF's.
  assert {r.get("weighted_sum") for r in records
          if r["form"] == "weighted_sum" and r["op_type"] == "Conv2D"} == {
              "native", None}, records


def test_large_filters_take_tfs_filter_gradient(lib):
  """A one-group filter of more than `FUSED_SUM_MAX_FILTER` entries (3x3,
  256 -> 512, stride 2): native norms, the weighted sum from TF's filter
  gradient of the scaled dz, equal to the reference loop."""
  del lib
  from tf_pxg.rules import conv
  rng = np.random.default_rng(5)
  w = tf.Variable(0.05 * rng.standard_normal((3, 3, 256, 512)), dtype=F32)
  assert w.shape.num_elements() > conv.FUSED_SUM_MAX_FILTER
  model = lambda x: tf.nn.conv2d(x, w, 2, "SAME")
  x = tf.constant(rng.standard_normal((3, 3, 3, 256)), F32)
  labels = tf.constant(rng.standard_normal((3, 2, 2, 512)), F32)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(_loss, model, [w], x, labels,
                                            mode="function")
  forms = {(r["form"], r.get(r["form"])) for r in records
           if r["op_type"] == "Conv2D" and r["form"] != "per_example"}
  assert ("sq_norm", "native") in forms, records
  assert ("weighted_sum", "native") not in forms, records


def test_without_the_library_the_patch_path_runs(monkeypatch):
  monkeypatch.setenv("TF_PXG_NATIVE", "0")
  name = "VALID"
  model, w = _model(name, F32)
  x, labels = _data(name, F32, 3, model)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(_loss, model, [w], x, labels,
                                            mode="function")
  forms = {r.get("sq_norm") for r in records
           if r["form"] == "sq_norm" and r["op_type"] == "Conv2D"}
  assert forms and "native" not in forms, records


# Depthwise convolutions ------------------------------------------------------------


def _depthwise_per_example(x, dz, ksize, strides, dilations, pads, examples,
                           minor=False):
  """[B, kh, kw, C, M] per-example filter gradients of a depthwise conv
  (output channel c M + m from input channel c), in float64 NumPy: x's
  strided slice at tap offset (i d_h, j d_w) of the zero-padded input times
  dz, summed over positions and over the example's rows."""
  top, left, bottom, right = pads
  x = np.pad(np.asarray(x, np.float64),
             [[0, 0], [top, bottom], [left, right], [0, 0]])
  dz = np.asarray(dz, np.float64)
  n, oh, ow, co = dz.shape
  c = x.shape[-1]
  dz = dz.reshape(n, oh, ow, c, co // c)
  k = n // examples
  (kh, kw), (sh, sw), (dh, dw) = ksize, strides, dilations
  out = np.zeros((examples, kh, kw, c, co // c))
  for b in range(examples):
    rows = ([r * examples + b for r in range(k)] if minor else
            range(b * k, (b + 1) * k))
    for row in rows:
      for i in range(kh):
        for j in range(kw):
          patch = x[row, i * dh:i * dh + (oh - 1) * sh + 1:sh,
                    j * dw:j * dw + (ow - 1) * sw + 1:sw]
          out[b, i, j] += np.einsum("hwc,hwcm->cm", patch, dz[row])
  return out


# (rows, H, W, C, M, ksize, strides, dilations, (top, left, bottom, right),
#  examples, examples minor)
DEPTHWISE_CASES = {
    # ConvNeXt's 7x7 SAME blocks at 32x32 inputs: 8x8x96 (whole vectors,
    # two channel blocks) and 1x1x768 (every tap but the centre is padding).
    "convnext_stage0": (4, 8, 8, 96, 1, (7, 7), (1, 1), (1, 1),
                        (3, 3, 3, 3), 4, False),
    "convnext_stage3": (3, 1, 1, 768, 1, (7, 7), (1, 1), (1, 1),
                        (3, 3, 3, 3), 3, False),
    "multiplier3_strides2": (3, 7, 6, 5, 3, (3, 2), (2, 2), (1, 1),
                             (1, 0, 1, 1), 3, False),
    "partial_vector_dilated": (2, 7, 7, 37, 2, (3, 3), (1, 2), (2, 1),
                               (2, 1, 2, 1), 2, False),
    "2_rows_each": (6, 5, 5, 20, 1, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 3,
                    False),
    "2_rows_each_minor": (6, 5, 5, 3, 2, (2, 2), (1, 1), (1, 1),
                          (0, 0, 0, 0), 3, True),
    "kernel_larger_than_image": (2, 2, 3, 70, 1, (5, 7), (1, 1), (1, 1),
                                 (2, 3, 2, 3), 2, False),
}


def _depthwise_data(name, dtype):
  (n, h, w, c, m, ksize, strides, dilations, pads, examples,
   minor) = DEPTHWISE_CASES[name]
  rng = np.random.default_rng(sorted(DEPTHWISE_CASES).index(name))
  oh = (h + pads[0] + pads[2] - (ksize[0] - 1) * dilations[0] - 1) // (
      strides[0]) + 1
  ow = (w + pads[1] + pads[3] - (ksize[1] - 1) * dilations[1] - 1) // (
      strides[1]) + 1
  x = rng.standard_normal((n, h, w, c))
  dz = rng.standard_normal((n, oh, ow, c * m))
  attrs = dict(ksize=ksize, strides=strides, dilations=dilations,
               pads=pads[:2], batch_minor=minor)
  want = _depthwise_per_example(x, dz, ksize, strides, dilations, pads,
                                examples, minor)
  return (tf.constant(x, dtype), tf.constant(dz, dtype), examples, attrs,
          want, rng)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(DEPTHWISE_CASES))
def test_depthwise_sq_norm_matches_its_definition(lib, name, dtype):
  x, dz, examples, attrs, g, _ = _depthwise_data(name, dtype)
  for index_dtype in (tf.int32, tf.int64):
    got = lib.tf_pxg_depthwise_conv2d_filter_sq_norm(
        x, dz, tf.constant(examples, index_dtype), **attrs)
    assert got.dtype == dtype and got.shape == [examples]
    np.testing.assert_allclose(
        got.numpy(), np.sum(g.reshape(examples, -1) ** 2, axis=1),
        rtol=1e-5 if dtype == F32 else 1e-12, atol=0)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", sorted(DEPTHWISE_CASES))
def test_depthwise_weighted_sum_matches_its_definition(lib, name, dtype):
  """sum_b c[b] G_b, [kh, kw, C, M]; an example with factor 0 whose rows
  hold inf and NaN adds exactly nothing."""
  x, dz, examples, attrs, g, rng = _depthwise_data(name, dtype)
  c = rng.uniform(0.1, 2.0, examples)
  c[0] = 0.0
  want = np.einsum("b,b...->...", c, g)
  k = x.shape[0] // examples
  first = ([r * examples for r in range(k)] if attrs["batch_minor"] else
           list(range(k)))  # example 0's rows
  bad = np.zeros(x.shape[0], bool)
  bad[first] = True
  x = tf.where(bad[:, None, None, None], tf.constant(np.inf, dtype), x)
  dz = tf.where(bad[:, None, None, None], tf.constant(np.nan, dtype), dz)
  got = lib.tf_pxg_depthwise_conv2d_filter_weighted_sum(
      x, dz, tf.constant(c, dtype), **attrs)
  assert got.dtype == dtype and got.shape == want.shape
  scale = np.max(np.abs(want))
  np.testing.assert_allclose(got.numpy(), want,
                             rtol=0, atol=(1e-5 if dtype == F32 else 1e-12) *
                             scale)


def test_depthwise_ops_reject_inconsistent_shapes(lib):
  attrs = dict(ksize=[2, 2], strides=[1, 1], dilations=[1, 1], pads=[0, 0])
  x, dz = tf.zeros([4, 4, 4, 3]), tf.zeros([4, 3, 3, 6])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="4 rows are not a whole number per example"):
    lib.tf_pxg_depthwise_conv2d_filter_sq_norm(x, dz, 3, **attrs)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="4 rows are not a whole number per example"):
    lib.tf_pxg_depthwise_conv2d_filter_weighted_sum(x, dz, tf.ones([3]),
                                                    **attrs)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="not a multiple of x's 3"):
    lib.tf_pxg_depthwise_conv2d_filter_sq_norm(x, dz[..., :5], 2, **attrs)
  with pytest.raises(tf.errors.InvalidArgumentError, match="dz 3"):
    lib.tf_pxg_depthwise_conv2d_filter_sq_norm(x, dz[:3], 4, **attrs)


def test_depthwise_ops_on_an_empty_batch(lib):
  attrs = dict(ksize=[2, 2], strides=[1, 1], dilations=[1, 1], pads=[0, 0])
  x, dz = tf.zeros([0, 4, 4, 3]), tf.zeros([0, 3, 3, 6])
  assert lib.tf_pxg_depthwise_conv2d_filter_sq_norm(
      x, dz, 0, **attrs).shape == [0]
  g = lib.tf_pxg_depthwise_conv2d_filter_weighted_sum(x, dz, tf.zeros([0]),
                                                      **attrs)
  np.testing.assert_array_equal(g.numpy(), np.zeros([2, 2, 3, 2]))


def _keras_depthwise(kind):
  """A depthwise layer as Keras writes it: `DepthwiseConv2D` (the
  `DepthwiseConv2dNative` op) or `Conv2D(groups=C)` (a grouped `Conv2D`,
  as in Keras' ConvNeXt)."""
  if kind == "DepthwiseConv2D":
    return tf.keras.layers.DepthwiseConv2D(3, depth_multiplier=2,
                                           padding="same", use_bias=False)
  return tf.keras.layers.Conv2D(8, 3, groups=4, padding="same",
                                use_bias=False)


@pytest.mark.parametrize("mode", pxg_testing.MODES)
@pytest.mark.parametrize("kind", ["DepthwiseConv2D", "Conv2D_groups"])
def test_depthwise_rules_use_the_ops(lib, kind, mode):
  """Both depthwise forms: norms and clipped sums from the native ops
  outside XLA, tap by tap under XLA, equal to the reference loop."""
  del lib
  tf.keras.utils.set_random_seed(0)
  layer = _keras_depthwise(kind)
  rng = np.random.default_rng(0)
  x = tf.constant(rng.standard_normal((5, 6, 6, 4)), F32)
  layer(x)
  op = "DepthwiseConv2dNative" if kind == "DepthwiseConv2D" else "Conv2D"
  labels = tf.constant(rng.standard_normal((5, 6, 6, 8)), F32)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(
        _loss, layer, layer.trainable_variables, x, labels, mode=mode)
  forms = {(r["form"], r.get(r["form"])) for r in records
           if r["op_type"] == op and r["form"] != "per_example"}
  if mode == "jit":  # Tap by tap; the weighted sum from the kept taps.
    assert forms == {("sq_norm", "taps"),
                     ("weighted_sum", "from per-example")}, records
  else:
    assert forms == {("sq_norm", "native"), ("weighted_sum", "native")}, (
        records)


def test_keras_fit_step_with_the_depthwise_ops(lib):
  """A ConvNeXt-style block (Conv2D stem, 7x7 depthwise as groups,
  LayerNorm, Dense over the pixels, LayerScale): one DP `fit` step runs the
  native depthwise ops and equals the noiseless DP-SGD step of the
  reference loop."""
  del lib
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 8, 8, 3)).astype("float32")
  y = rng.integers(0, 3, 8).astype("int32")

  def make_layers():
    return [tf.keras.layers.Conv2D(16, 2, strides=2),
            tf.keras.layers.Conv2D(16, 7, groups=16, padding="same"),
            tf.keras.layers.LayerNormalization(),
            tf.keras.layers.Dense(32, activation="gelu"),
            tf.keras.layers.Dense(16),
            tf.keras.layers.GlobalAveragePooling2D(),
            tf.keras.layers.Dense(3)]

  with pxg_testing.trace_rules() as records:
    check_one_dp_fit_step(make_layers, x, y, build_shape=x.shape)
  # Both Conv2Ds (the stem's one group and the depthwise groups): native
  # norms and weighted sums.
  assert {r.get(r["form"]) for r in records if r["op_type"] == "Conv2D" and
          r["form"] != "per_example"} == {"native"}, records
  assert sum(r["op_type"] == "Conv2D" and r.get("weighted_sum") == "native"
             for r in records) >= 2, records


# Row sums of squares -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("shape", [(256, 512), (5, 3), (7, 1, 33),
                                   (1, 1_000_003), (4,), (3, 0), (0, 4)],
                         ids=str)
def test_row_sum_of_squares_matches_numpy(lib, shape, dtype):
  x = np.random.default_rng(len(shape)).standard_normal(shape)
  got = lib.tf_pxg_row_sum_of_squares(tf.constant(x, dtype))
  assert got.dtype == dtype and got.shape == [shape[0]]
  want = np.sum(np.square(x).reshape(shape[0], -1), axis=1) if x.size else (
      np.zeros(shape[0]))
  # Float32 partial sums over blocks of 4096 squares, added in double.
  np.testing.assert_allclose(got.numpy(), want,
                             rtol=2e-6 if dtype == F32 else 1e-13, atol=0)


def test_row_sum_of_squares_gradient(lib):
  v = tf.Variable(np.random.default_rng(1).standard_normal((3, 2, 2)),
                  dtype=F64)
  weights = tf.constant([1.0, -2.0, 3.0], F64)
  with tf.GradientTape() as tape:
    y = tf.reduce_sum(lib.tf_pxg_row_sum_of_squares(v) * weights)
  np.testing.assert_allclose(tape.gradient(y, v).numpy(),
                             2 * v.numpy() * weights.numpy()[:, None, None],
                             rtol=1e-15, atol=0)


def _dense_model(dtype, units):
  rng = np.random.default_rng(units)
  w = tf.Variable(rng.standard_normal((6, units)), dtype=dtype, name="w")
  return (lambda x: tf.nn.relu(tf.matmul(x, w))), w


@pytest.mark.parametrize("mode", pxg_testing.MODES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_dense_ghost_norms_use_the_row_op(lib, dtype, batch, mode):
  """A Dense layer's ghost norm ||a||^2 ||dz||^2 takes the row op outside
  XLA and TF's reduction inside; both match the reference loop."""
  del lib
  model, w = _dense_model(dtype, 4)
  rng = np.random.default_rng(batch)
  x = tf.constant(rng.standard_normal((batch, 6)), dtype)
  labels = tf.constant(rng.standard_normal((batch, 4)), dtype)
  pxg_testing.check_per_example_gradients(_loss, model, [w], x, labels,
                                          mode=mode)

  @tf.function(jit_compile=mode == "jit")
  def norms(x, labels):
    with tf_pxg.GradientTape() as tape:
      losses = _loss(labels, model(x))
    return tape.per_example_norms(losses, [w])

  ops = {op.type for op in norms.get_concrete_function(
      x, labels).graph.get_operations()}
  assert ("TfPxgRowSumOfSquares" in ops) == (mode != "jit"), ops


# Rows scaled by their example's factor --------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("shape,examples", [((256, 512), 256), ((6, 3, 5), 3),
                                            ((4, 0), 2), ((0, 3), 0),
                                            ((5,), 5)], ids=str)
def test_scale_rows_matches_numpy(lib, shape, examples, dtype):
  rng = np.random.default_rng(len(shape))
  t = rng.standard_normal(shape).astype(dtype.as_numpy_dtype)
  c = rng.uniform(0.1, 2.0, examples).astype(dtype.as_numpy_dtype)
  got = lib.tf_pxg_scale_rows(tf.constant(t), tf.constant(c))
  assert got.dtype == dtype and got.shape == shape
  k = shape[0] // examples if examples else 0
  # One rounded product per element, as NumPy's in the same dtype.
  want = t * np.repeat(c, k).reshape((-1,) + (1,) * (len(shape) - 1))
  np.testing.assert_array_equal(got.numpy(), want)


def test_scale_rows_rejects_a_wrong_count(lib):
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="5 rows are not a whole number per example"):
    lib.tf_pxg_scale_rows(tf.zeros([5, 2]), tf.ones([2]))


def test_scale_rows_gradient(lib):
  rng = np.random.default_rng(3)
  t = tf.Variable(rng.standard_normal((4, 3)))
  c = tf.Variable(rng.standard_normal(2))
  w = tf.constant(rng.standard_normal((4, 3)))
  with tf.GradientTape() as tape:
    y = tf.reduce_sum(lib.tf_pxg_scale_rows(t, c) * w)
  dt, dc = tape.gradient(y, [t, c])
  rows = np.repeat(c.numpy(), 2)[:, None]
  np.testing.assert_allclose(dt.numpy(), w.numpy() * rows, rtol=1e-15)
  np.testing.assert_allclose(
      dc.numpy(), (w.numpy() * t.numpy()).reshape(2, -1).sum(axis=1),
      rtol=1e-14)
