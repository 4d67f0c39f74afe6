"""Per-example norms over chunks of examples.

`tf_pxg.rules.base.map_example_chunks` is checked against the same function
on the whole batch. The convolution rules' `sq_norm`, which runs over chunks
of `conv.NORM_CHUNK_BYTES` of patches, is checked with a budget of two
examples' patches (so B = 4 is two chunks and B = 5 three, the last one
overlapping the second) against the plain `tf.GradientTape` loop over single
examples: eagerly, in `tf.function` and under XLA (where the rules take the
batch at once), with a static and a dynamic batch, in float32 and float64,
for the ghost and the materialised form. A spy on `map_example_chunks`
checks that the chunks really were two examples, i.e. that the budget is
turned into the intended chunk size.

With a dynamic batch the rows per example of a contraction are known only
at run time; the ghost-or-materialised choice is then made by `tf.cond`,
checked to run the form the static batch takes.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Tuple

import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import testing as pxg_testing
from tf_pxg.rules import base
from tf_pxg.rules import contraction
from tf_pxg.rules import conv

F32, F64 = tf.float32, tf.float64


# map_example_chunks ----------------------------------------------------------


def _row_sums_and_doubled(parts, n):
  """Per example: the sum of its 2 rows of `a`, and twice its row of `b`."""
  a, b = parts
  return (tf.reduce_sum(tf.reshape(a, [n, -1]), axis=1), 2.0 * b)


def _chunk_inputs(batch):
  rng = np.random.default_rng(batch)
  a = rng.standard_normal((2 * batch, 3))  # 2 rows per example
  b = rng.standard_normal((batch, 4))
  want = (a.reshape(batch, 6).sum(axis=1), 2.0 * b)
  return tf.constant(a), tf.constant(b), want


@pytest.mark.parametrize("mode", ["eager", "function", "jit",
                                  "function_dynamic", "jit_dynamic"])
@pytest.mark.parametrize("batch,chunk", [(1, 3), (5, 3), (7, 3), (8, 3),
                                         (5, 1), (8, 8), (4, 2)])
def test_map_example_chunks_matches_whole_batch(mode, batch, chunk):
  a, b, want = _chunk_inputs(batch)
  calls = []

  def fn(parts, n):
    calls.append(n)
    return _row_sums_and_doubled(parts, n)

  def run(a, b):
    rows = tf.shape(b)[0] if mode.endswith("dynamic") else batch
    return base.map_example_chunks(fn, [a, b], rows, chunk,
                                   (tf.float64, tf.float64))

  if mode == "eager":
    got = run(a, b)
    # One call per chunk: ceil(B / chunk) chunks, or the batch at once.
    assert len(calls) == -(-batch // chunk), calls
    assert all(n <= chunk for n in calls), calls
  else:
    sig = None
    if mode.endswith("dynamic"):
      sig = [tf.TensorSpec([None, 3], F64), tf.TensorSpec([None, 4], F64)]
    got = tf.function(run, jit_compile=mode.startswith("jit"),
                      input_signature=sig)(a, b)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(g.numpy(), w, rtol=1e-12,
                               atol=1e-12 * np.max(np.abs(w)))


def test_map_example_chunks_rejects_empty_chunks():
  a, b, _ = _chunk_inputs(3)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    base.map_example_chunks(_row_sums_and_doubled, [a, b], 3, 0,
                            (tf.float64, tf.float64))


# Convolution norms in chunks -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  """`fn(x, w)` on `x` of shape `[B, *input_shape]`, `w` of `filter_shape`.

  `patch_elements`: for a convolution, one example's patch tensor (kernel
  offsets x patched channels x positions), worked out by hand (0 for other
  ops); `form`: the sq_norm form with a static batch.
  """
  name: str
  fn: Callable
  input_shape: Tuple[int, ...]
  filter_shape: Tuple[int, ...]
  patch_elements: int
  form: str


def _transpose_conv(out_hw, strides, padding):
  def fn(x, w):
    shape = tf.stack([tf.shape(x)[0], *out_hw, w.shape[2]])
    return tf.nn.conv2d_transpose(x, w, shape, strides=strides,
                                  padding=padding)
  return fn


CASES = [
    # 2x2 positions x (2x2 offsets x 8 channels).
    Case("Conv2D_VALID_ghost",
             lambda x, w: tf.nn.conv2d(x, w, 1, "VALID"),
             (3, 3, 8), (2, 2, 8, 16), 4 * 4 * 8, "ghost"),
    # 3x3 positions x (3x3 offsets x 2 channels).
    Case("Conv2D_SAME_strides2",
             lambda x, w: tf.nn.conv2d(x, w, 2, "SAME"),
             (5, 5, 2), (3, 3, 2, 3), 9 * 9 * 2, "materialised"),
    # 4x3 positions x (2x2 offsets x 2 channels), patches by extract_patches.
    Case("Conv2D_VALID_dilation2",
             lambda x, w: tf.nn.conv2d(x, w, 1, "VALID", dilations=2),
             (6, 5, 2), (2, 2, 2, 3), 12 * 4 * 2, "materialised"),
    # 2x1x1 positions x (2x2x2 offsets x 4 channels).
    Case("Conv3D_VALID_ghost",
             lambda x, w: tf.nn.conv3d(x, w, [1] * 5, "VALID"),
             (3, 2, 2, 4), (2, 2, 2, 4, 16), 2 * 8 * 4, "ghost"),
    # 2x2 positions x (3x3 offsets x 2 channels).
    Case("DepthwiseConv2dNative_VALID_ghost",
             lambda x, w: tf.raw_ops.DepthwiseConv2dNative(
                 input=x, filter=w, strides=[1, 1, 1, 1], padding="VALID"),
             (4, 4, 2), (3, 3, 2, 16), 4 * 9 * 2, "ghost"),
    # Patches of the 4x4x8 output gradient at the input's 2x2 positions.
    Case("Conv2DBackpropInput_SAME_strides2_ghost",
             _transpose_conv((4, 4), 2, "SAME"),
             (2, 2, 16), (3, 3, 8, 16), 4 * 9 * 8, "ghost"),
    # Patches of the 6x6x3 output gradient at the input's 3x3 positions.
    Case("Conv2DBackpropInput_SAME_strides2",
             _transpose_conv((6, 6), 2, "SAME"),
             (3, 3, 2), (3, 3, 3, 2), 9 * 9 * 3, "materialised"),
]
_BY_NAME = {c.name: c for c in CASES}


def _op_type(case):
  return case.name.split("_")[0]


def _loss(labels, outputs):
  d = outputs - tf.cast(labels, outputs.dtype)
  return 0.5 * tf.reduce_sum(tf.reshape(d * d, [tf.shape(d)[0], -1]), axis=1)


def _model(case, dtype):
  """(model, filter variable), seeded by the case's name."""
  rng = np.random.default_rng(zlib.crc32(case.name.encode()))
  w = tf.Variable(rng.standard_normal(case.filter_shape), dtype=dtype,
                  name="w")
  return (lambda inp: case.fn(inp, w)), w


def _data(case, dtype, batch, model):
  """(x, labels) for `batch` examples, seeded by the case and batch."""
  rng = np.random.default_rng(zlib.crc32(case.name.encode()) + batch)
  x = tf.constant(rng.standard_normal((batch, *case.input_shape)), dtype)
  labels = tf.constant(rng.standard_normal(model(x).shape), dtype)
  return x, labels


@pytest.fixture
def two_example_chunks(monkeypatch):
  """Sets the budget per case to two examples' patches and records the
  `(batch_size, chunk)` of every `map_example_chunks` call."""
  calls = []
  real = base.map_example_chunks

  def spy(fn, tensors, batch_size, chunk, signature):
    calls.append((batch_size, chunk))
    return real(fn, tensors, batch_size, chunk, signature)

  monkeypatch.setattr(base, "map_example_chunks", spy)
  # The patch path under test; the native ops that replace it for 2-D and
  # depthwise convolutions on CPU are tested in test_native_norms.py.
  # (Under XLA depthwise convolutions go tap by tap: off here too.)
  for rule in (conv.ConvRule, conv.DepthwiseConvRule):
    monkeypatch.setattr(rule, "native_sq_norm", lambda self, ctx: None)
    monkeypatch.setattr(rule, "native_weighted_sum",
                        lambda self, ctx, c: None)
    monkeypatch.setattr(rule, "taps", lambda self, ctx: None)

  def set_budget(case, dtype):
    monkeypatch.setattr(conv, "NORM_CHUNK_BYTES",
                        2 * case.patch_elements * dtype.size)
    return calls

  return set_budget


def _check_chunks(calls, batch, jit):
  """Each norm call of a batch larger than 2 ran in chunks of 2 examples;
  a batch of 1 fits a chunk and runs without the loop, and under XLA no
  batch is chunked."""
  if batch <= 2 or jit:
    assert not calls, calls
  else:
    assert calls and all(chunk == 2 for _, chunk in calls), calls


@pytest.mark.parametrize("mode", pxg_testing.MODES)
@pytest.mark.parametrize("batch", [1, 4, 5])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_conv_norms_in_chunks_match_reference(name, dtype, batch, mode,
                                              two_example_chunks):
  case = _BY_NAME[name]
  calls = two_example_chunks(case, dtype)
  model, w = _model(case, dtype)
  x, labels = _data(case, dtype, batch, model)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(_loss, model, [w], x, labels,
                                            mode=mode)
  forms = {r.get("sq_norm") for r in records if r["form"] == "sq_norm" and
           r["op_type"] == _op_type(case)}
  assert forms == {case.form}, records
  # Every materialised case here is small enough to be kept: the weighted
  # sum reuses the gradients the chunks returned.
  sums = {r.get("weighted_sum") for r in records
          if r["form"] == "weighted_sum" and r["op_type"] == _op_type(case)}
  assert sums == {"from per-example" if case.form == "materialised" else
                  None}, records
  _check_chunks(calls, batch, mode == "jit")


def _check_dynamic_batch(case, dtype, jit, batches=(5, 1)):
  """Runs one `tf.function` with a `None` batch (traced on the first of
  `batches`) on each batch size and checks its per-example norms and
  clipped sum (C = 1) against the reference loop. Returns the
  `trace_rules` records of the tracing call."""
  model, w = _model(case, dtype)

  def compute(x, labels):
    with tf_pxg.GradientTape() as tape:
      losses = _loss(labels, model(x))
    norms = tape.per_example_norms(losses, [w])
    with tf_pxg.GradientTape() as tape:
      losses = _loss(labels, model(x))
    (clipped,), _ = tape.clipped_gradient_sum(losses, [w], 1.0)
    return norms, clipped

  # The labels' rank is known (a None batch): with a label tensor of
  # unknown rank the engine cannot follow the batch axis through the loss
  # and refuses (tf_pxg.interface.batch_axis).
  out_rank = model(tf.zeros([1, *case.input_shape], dtype)).shape.rank
  compute = tf.function(
      compute, jit_compile=jit, autograph=False,
      input_signature=[tf.TensorSpec([None, *case.input_shape], dtype),
                       tf.TensorSpec([None] * out_rank, dtype)])
  traced = None
  for batch in batches:
    x, labels = _data(case, dtype, batch, model)
    (ref,) = pxg_testing.reference_per_example_gradients(
        _loss, model, [w], x, labels)
    ref = ref.numpy().reshape(batch, -1)
    want_norms = np.sqrt(np.sum(ref ** 2, axis=1))
    want_sum = (np.minimum(1.0, 1.0 / want_norms) @ ref).reshape(w.shape)
    with pxg_testing.trace_rules() as records:
      norms, got_sum = compute(x, labels)
    traced = records if traced is None else traced
    np.testing.assert_allclose(norms.numpy(), want_norms, rtol=1e-5,
                               atol=1e-6 * np.max(want_norms))
    np.testing.assert_allclose(got_sum.numpy(), want_sum, rtol=1e-5,
                               atol=1e-5 * np.max(np.abs(want_sum)))
  return traced


@pytest.mark.parametrize("jit", [False, True], ids=["function", "jit"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", ["Conv2D_VALID_ghost", "Conv2D_SAME_strides2",
                                  "Conv2DBackpropInput_SAME_strides2_ghost"])
def test_conv_norms_in_chunks_dynamic_batch(name, dtype, jit,
                                            two_example_chunks):
  """One `tf.function` with a `None` batch, called on B = 5 and B = 1."""
  case = _BY_NAME[name]
  calls = two_example_chunks(case, dtype)
  records = _check_dynamic_batch(case, dtype, jit)
  # A dynamic batch has no static size to weigh, so no per-example
  # gradient is kept for the sum.
  sums = [r.get("weighted_sum") for r in records
          if r["form"] == "weighted_sum"]
  assert sums and not any(sums), records
  if jit:
    assert not calls, calls
  else:
    assert calls and all(chunk == 2 and isinstance(b, tf.Tensor)
                         for b, chunk in calls), calls


# The form chosen at run time (dynamic batch) ----------------------------------

# `form`: the form the static batch takes, which the run-time choice must
# take too (rows per example are 1, 4 and 4).
RUN_TIME_CASES = [
    Case("MatMul_ghost", tf.matmul, (5,), (5, 3), 0, "ghost"),
    # 4 rows x (16 + 16) < 16 x 16.
    Case("Einsum_sequence_ghost",
             lambda x, w: tf.einsum("btd,de->bte", x, w), (4, 16), (16, 16),
             0, "ghost"),
    # 4 rows x (5 + 3) > 5 x 3.
    Case("Einsum_sequence_materialised",
             lambda x, w: tf.einsum("btd,de->bte", x, w), (4, 5), (5, 3), 0,
             "materialised"),
]


@pytest.mark.parametrize("jit", [False, True], ids=["function", "jit"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", RUN_TIME_CASES, ids=lambda c: c.name)
def test_dynamic_batch_runs_the_cheaper_form(case, dtype, jit, monkeypatch):
  """With a `None` batch the rows per example are known only at run time:
  both forms are built and the one the static batch would take runs (a
  counter on the ghost form tells which)."""
  ghost_runs = tf.Variable(0, dtype=tf.int64)
  real = contraction._Operands.ghost_terms

  def counted(*args):
    with tf.control_dependencies([ghost_runs.assign_add(1)]):
      return tf.identity(real(*args))

  monkeypatch.setattr(contraction._Operands, "ghost_terms", counted)
  records = _check_dynamic_batch(case, dtype, jit)
  assert {r.get("sq_norm") for r in records if r["form"] == "sq_norm"} == {
      "chosen at run time"}, records
  # Two calls (B = 5, 1), one per-example_norms and one clipped sum each.
  assert int(ghost_runs.numpy()) == (4 if case.form == "ghost" else 0)
