"""The batch axis through TensorLists (a `tf.TensorArray` in a `tf.function`).

In a traced function a `tf.TensorArray` is a TensorList variant:
`TensorListReserve`, then `TensorListSetItem` / `GetItem` / `Stack` /
`Gather` / `FromTensor` (`unstack`) / `ScatterIntoExistingList`
(`scatter`); `EmptyTensorList`, `PushBack` and `PopBack` are the raw list
ops. `tf_pxg.interface.batch_axis` gives a list the layout of its elements, so a list
of `[B, ...]` steps (KerasHub's RWKV-7 writes its time steps this way) is
followed exactly, against the `tf.GradientTape` loop over single examples;
a list whose index would be the batch (a batch-major tensor unstacked into
it, or two writes with the examples on different axes) is refused at trace
time, naming the op.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import testing as pxg_testing

B, T, D, U = 3, 4, 2, 5


class Fn:
  """A function of TF ops on given variables, as the reference wants."""

  def __init__(self, fn, variables):
    self.fn, self.trainable_variables = fn, list(variables)

  def __call__(self, x):
    return self.fn(x)


def _dense(units=U):
  keras.utils.set_random_seed(0)
  layer = keras.layers.Dense(units, activation="tanh")
  layer.build((None, D))
  return layer


def _x():
  return tf.constant(np.random.default_rng(0).standard_normal((B, T, D)),
                     tf.float32)


def _steps_through_lists():
  """Time steps of a Dense layer through every list op a TensorArray (and
  a raw list stack) builds; each element holds the batch on its axis 0."""
  layer = _dense()
  v = tf.Variable(np.random.default_rng(1).standard_normal(U), dtype=tf.float32)

  def fn(x):  # [B, T, D] -> [B]
    steps = tf.TensorArray(tf.float32, size=T).unstack(
        tf.transpose(x, [1, 0, 2]))                      # FromTensor
    out = tf.TensorArray(tf.float32, size=T)            # Reserve
    for t in range(T):
      out = out.write(t, layer(steps.read(t)))          # GetItem, SetItem
    h = tf.transpose(out.stack(), [1, 0, 2])            # Stack: [B, T, U]
    ends = out.gather([0, T - 1])                       # Gather: [2, B, U]
    swapped = tf.TensorArray(tf.float32, size=2).scatter(
        [1, 0], ends).stack()                           # ScatterInto...
    pushed = tf.raw_ops.TensorListPushBack(
        input_handle=tf.raw_ops.EmptyTensorList(
            element_shape=tf.constant([-1, U]), max_num_elements=-1,
            element_dtype=tf.float32),
        tensor=h[:, 1] * v)
    _, popped = tf.raw_ops.TensorListPopBack(
        input_handle=pushed, element_shape=tf.constant([-1, U]),
        element_dtype=tf.float32)                       # [B, U]
    return (tf.reduce_sum(tf.square(h), axis=[1, 2]) +
            tf.reduce_sum(swapped[0] * ends[0] * v, axis=1) +
            tf.reduce_sum(tf.sin(popped), axis=1))
  return Fn(fn, layer.trainable_variables + [v])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_list_of_steps_matches_reference(mode):
  """Per-example gradients, norms and clipped sums through the lists equal
  the batch-of-one `tf.GradientTape` loop. A TensorArray is a TensorList
  only in a `tf.function`; eagerly it is a Python list, and only the raw
  PushBack/PopBack are list ops."""
  model = _steps_through_lists()
  pxg_testing.check_per_example_gradients(
      None, model, model.trainable_variables, _x(), mode=mode)


def _batch_unstacked(layer):
  def fn(x):  # Each list element one example's [U] row.
    rows = tf.TensorArray(tf.float32, size=B).unstack(layer(x[:, 0]))
    return tf.reduce_sum(tf.square(rows.stack()), axis=1)
  return fn


def _written_on_two_axes(layer):
  def fn(x):  # Element 0 holds the examples on axis 0, element 1 on axis 1
    # (`layer` has B units, so both are [B, B]).
    out = tf.TensorArray(tf.float32, size=2)
    out = out.write(0, layer(x[:, 0])).write(1, tf.transpose(layer(x[:, 1])))
    return tf.reduce_sum(tf.square(out.stack()), axis=[0, 2])
  return fn


@pytest.mark.parametrize("make,op,why", [
    (_batch_unstacked, "TensorListFromTensor", "each list element would "
     "hold one example"),
    (_written_on_two_axes, "TensorListSetItem", "into a list whose elements "
     "hold them on axis 0")], ids=["unstack_batch", "set_item_axes"])
def test_list_indexed_by_examples_is_refused_by_name(make, op, why):
  layer = _dense(units=B)
  fn = make(layer)

  @tf.function
  def norms(x):
    with tf_pxg.GradientTape() as tape:
      losses = fn(x)
    return tape.per_example_norms(losses, layer.trainable_variables)

  with pytest.raises(ValueError) as info:
    norms(_x())
  msg = str(info.value)
  assert f"op '{op}'" in msg and "mixes examples" in msg, msg
  assert why in msg and "TensorArray" in msg, msg


def _written_steps(dtype):
  """RWKV-7's pattern alone (reserve, write each `[B, U]` step, stack): the
  list ops XLA compiles (it has no kernel for `ScatterIntoExistingList`,
  which `_steps_through_lists` uses)."""
  keras.utils.set_random_seed(0)
  layer = keras.layers.Dense(U, activation="tanh", dtype=dtype)
  layer.build((None, D))

  def fn(x):  # [B, T, D] -> [B]
    steps = tf.TensorArray(dtype, size=T).unstack(tf.transpose(x, [1, 0, 2]))
    out = tf.TensorArray(dtype, size=T, element_shape=[None, U])
    for t in range(T):
      out = out.write(t, layer(steps.read(t)))
    return tf.reduce_sum(tf.square(out.stack()), axis=[0, 2])
  return Fn(fn, layer.trainable_variables)


@pytest.mark.parametrize("mode,batch,dtype", [
    ("jit", 1, "float64"), ("jit", B, "float32"), ("function", 1, "float32"),
    ("function", B, "float64")])
def test_written_steps_match_reference(mode, batch, dtype):
  """Batch 1 and N, float32 and float64 (pairwise with the mode), under XLA
  (`jit_compile=True`) too."""
  model = _written_steps(dtype)
  pxg_testing.check_per_example_gradients(
      None, model, model.trainable_variables,
      tf.cast(_x()[:batch], dtype), mode=mode)
