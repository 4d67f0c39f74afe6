"""An op's knowledge lives on its rule: registering one rule adds an op.

`SparseMatMul` (a dense matmul with sparsity hints, which tf_pxg knows
nothing about) is registered here, in one place: a `Rule` whose `layouts`
says how it moves the batch axis (a contraction `ij,jk->ik`, so it need not
be on the row-wise allowlist), whose `batch_axes` says where it takes the
examples (the rows of the data matrix, axis 1 of a transposed one) and
whose `mergeable` flag lets the uses of one weight be merged. Each test
checks that the engine reads these attributes, against a plain
`tf.GradientTape` loop over examples.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg.interface import batch_axis
from tf_pxg import registry
from tf_pxg import testing as pxg_testing
from tf_pxg.rules import contraction
from tf_pxg.tape import recording

B, D, U, T = 4, 3, 2, 3
RNG = np.random.default_rng(7)
X = tf.constant(RNG.standard_normal((B, T, D)), tf.float32)


class SparseMatMulRule(contraction.MatMulRule):
  """`SparseMatMul(a, b)`: `MatMul`'s rule (same attrs), plus its layout."""

  @staticmethod
  def layouts(entry, layouts):
    ta = recording.get_attr(entry, "transpose_a")
    tb = recording.get_attr(entry, "transpose_b")
    return batch_axis.contract(entry, ["ji" if ta else "ij",
                                       "kj" if tb else "jk"], "ik", layouts)


@pytest.fixture
def sparse_matmul_rule():
  """Registers `SparseMatMulRule` for the test, then removes it."""
  assert registry.lookup("SparseMatMul") is None
  assert "SparseMatMul" not in batch_axis.row_wise_op_types()
  rule = SparseMatMulRule()
  tf_pxg.register("SparseMatMul")(rule)
  try:
    yield rule
  finally:
    registry.unregister("SparseMatMul")


def _sparse_matmul(x, w, transposed):
  if transposed:  # The examples are the columns of a [D, B] data operand.
    return tf.raw_ops.SparseMatMul(a=tf.transpose(x), b=w, transpose_a=True)
  return tf.raw_ops.SparseMatMul(a=x, b=w)


def _loss(w, x, transposed=False):
  """`[B]`: sum over the T steps of tanh(x_t @ w)^2 summed over units."""
  return tf.add_n([tf.reduce_sum(tf.tanh(_sparse_matmul(
      x[:, t], w, transposed)) ** 2, axis=1) for t in range(x.shape[1])])


def _reference(w):
  out = []
  for b in range(B):
    with tf.GradientTape() as tape:
      loss = _loss(w, X[b:b + 1])[0]
    out.append(tape.gradient(loss, w))
  return tf.stack(out).numpy()


def _weight():
  return tf.Variable(RNG.standard_normal((D, U)), dtype=tf.float32)


def test_unknown_op_is_refused_before_its_rule_is_registered():
  w = _weight()
  with tf_pxg.GradientTape() as tape:
    losses = _loss(w, X)
  with pytest.raises(ValueError, match="SparseMatMul.*allowlist"):
    tape.per_example_gradient(losses, [w])


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_registered_rule_gives_layout_and_batch_axes(sparse_matmul_rule,
                                                     transposed, mode):
  """The engine follows the batch axis through the op by the rule's
  `layouts` and, with the examples on axis 1 of a transposed data operand,
  takes them where the rule's `batch_axes` says (the default, axis 0,
  would be refused: the op is not `permutable`)."""
  del sparse_matmul_rule
  w = _weight()

  def run(x):
    with tf_pxg.GradientTape(persistent=True) as tape:
      losses = _loss(w, x, transposed)
    return (tape.per_example_gradient(losses, [w])[0],
            tape.per_example_norms(losses, [w]))

  fn = run if mode == "eager" else tf.function(run)
  with pxg_testing.trace_rules() as records:
    got, norms = fn(X)
  assert {r["rule"] for r in records
          if r["op_type"] == "SparseMatMul"} == {"SparseMatMulRule"}
  ref = _reference(w)
  scale = np.abs(ref).max()
  np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=1e-5 * scale)
  ref_norms = np.sqrt((ref ** 2).reshape(B, -1).sum(axis=1))
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-5,
                             atol=1e-6 * ref_norms.max())


@pytest.mark.parametrize("mergeable", [True, False])
def test_mergeable_rule_merges_the_uses_of_one_weight(sparse_matmul_rule,
                                                      mergeable,
                                                      monkeypatch):
  """The T uses of one weight are one interface (one `sq_norm` call) when
  the rule is `mergeable`, T interfaces otherwise (each materialised, or
  each use's own norm with the cross terms from outer-product factors:
  tests/test_tied_embedding.py); the norms agree with
  the reference either way (a tied weight's norm is the norm of the sum)."""
  monkeypatch.setattr(sparse_matmul_rule, "mergeable", mergeable)
  w = _weight()
  with tf_pxg.GradientTape() as tape:
    losses = _loss(w, X)
  with pxg_testing.trace_rules() as records:
    norms = tape.per_example_norms(losses, [w])
  calls = [r["form"] for r in records if r["op_type"] == "SparseMatMul"]
  if mergeable:
    assert calls == ["sq_norm"]
  else:  # T interfaces: materialised, or each use's own norm plus the
    # cross terms from the uses' outer-product factors (rules/factors.py).
    assert calls in (["per_example"] * T,
                     ["outer_factors"] * T + ["sq_norm"] * T), calls
  ref = _reference(w)
  ref_norms = np.sqrt((ref ** 2).reshape(B, -1).sum(axis=1))
  np.testing.assert_allclose(norms.numpy(), ref_norms, rtol=1e-5,
                             atol=1e-6 * ref_norms.max())
