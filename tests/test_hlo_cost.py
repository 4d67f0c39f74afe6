"""`benchmarks.hlo_cost`: the static FLOP and byte counts of an optimized
HLO module, checked against hand counts (issue 51, item 3).

A written module exercises each rule (a batched dot, a grouped
convolution, a fusion counted once at kernel level, a reducer and a
fusion body left out of the bytes, a while loop, tuple shapes with index
comments); then XLA's own optimized HLO of a single matmul and of Keras'
compiled train step of a Dense model and of a valid-padding Conv2D
model, each against counts worked out by hand from the layers' shapes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks import hlo_cost

MODULE = """\
HloModule written, entry_computation_layout={(f32[2,3,4]{2,1,0})->f32[]}

%add.r (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%fused_computation (p0: f32[2,3,5], p1: f32[]) -> f32[2,3,5] {
  %p0 = f32[2,3,5]{2,1,0} parameter(0)
  %p1 = f32[] parameter(1)
  %b = f32[2,3,5]{2,1,0} broadcast(%p1), dimensions={}
  ROOT %m = f32[2,3,5]{2,1,0} multiply(%p0, %b), metadata={op_type="Mul"}
}

%body (t: (s32[], f32[2,3,5])) -> (s32[], f32[2,3,5]) {
  %t = (s32[], /*index=1*/f32[2,3,5]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[2,3,5]{2,1,0} get-tuple-element(%t), index=1
  %n = f32[2,3,5]{2,1,0} negate(%v)
  ROOT %o = (s32[], f32[2,3,5]) tuple(%i, %n)
}

%cond (t: (s32[], f32[2,3,5])) -> pred[] {
  %t = (s32[], f32[2,3,5]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (a: f32[2,3,4]) -> f32[] {
  %a = f32[2,3,4]{2,1,0} parameter(0)
  %w = f32[2,4,5]{2,1,0} constant({...})
  %d = f32[2,3,5]{2,1,0} dot(%a, %w), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}, metadata={op_type="BatchMatMulV2"}
  %img = f32[1,6,6,8]{3,2,1,0} constant({...})
  %ker = f32[3,3,1,8]{3,2,1,0} constant({...})
  %c = f32[1,4,4,8]{3,2,1,0} convolution(%img, %ker), window={size=3x3}, dim_labels=b01f_01io->b01f, feature_group_count=8, metadata={op_type="DepthwiseConv2dNative"}
  %s = f32[] constant(2)
  %f = f32[2,3,5]{2,1,0} fusion(%d, %s), kind=kLoop, calls=%fused_computation
  %z = s32[] constant(0)
  %t0 = (s32[], f32[2,3,5]) tuple(%z, %f)
  %wl = (s32[], f32[2,3,5]) while(%t0), condition=%cond, body=%body
  %r = f32[2,3,5]{2,1,0} get-tuple-element(%wl), index=1
  %zero = f32[] constant(0)
  ROOT %sum = f32[] reduce(%r, %zero), dimensions={0,1,2}, to_apply=%add.r
}
"""


def test_a_written_module_against_hand_counts():
  c = hlo_cost.cost(MODULE)
  dot = 2 * (2 * 3 * 5) * 4          # |result| * contracting width 4
  conv = 2 * (4 * 4 * 8) * (3 * 3 * 1)  # kernel's i = 1 (8 groups)
  assert (c.dots, c.convolutions, c.while_loops) == (1, 1, 1)
  assert c.flops == dot + conv
  assert c.flops_by_op_type == {"BatchMatMulV2": dot,
                                "DepthwiseConv2dNative": conv}
  f4 = 4  # bytes per f32; each kernel-level instruction: result + operands
  expected = sum([
      f4 * (30 + 24 + 40),        # the dot
      f4 * (128 + 288 + 72),      # the convolution
      f4 * (30 + 30) + f4,        # the fusion, once (not its body)
      2 * (4 + f4 * 30),          # the while: its tuple in and out
      f4 * 30 + f4 * 30,          # the body's negate
      1 + 4 + 4,                  # the condition's compare
      4 + f4 * 30 + 4,            # the reduce (not its reducer)
  ])  # parameters, constants, tuples, get-tuple-element: no traffic
  assert c.bytes == expected


def test_parse_errors_name_the_text():
  with pytest.raises(ValueError, match="not an HLO shape"):
    hlo_cost.parse_shape("banana")
  with pytest.raises(ValueError, match="no HLO computation"):
    hlo_cost.cost("HloModule empty\n")


def _ir(fn, *args):
  return tf.function(fn, jit_compile=True).experimental_get_compiler_ir(
      *args)(stage="optimized_hlo")


def test_xla_matmul_against_hand_counts():
  m, k, n = 8, 16, 4
  c = hlo_cost.cost(_ir(lambda a, b: tf.matmul(a, b), tf.ones([m, k]), tf.ones([k, n])))
  assert c.flops == 2 * m * k * n
  assert c.bytes == 4 * (m * k + k * n + m * n)


B = 4


def _step_cost(layers, input_shape):
  model = keras.Sequential([keras.Input(input_shape), *layers])
  model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  x = np.ones((B, *input_shape), "float32")
  y = np.zeros((B,), "int32")
  return hlo_cost.cost(hlo_cost.step_hlo(model, x, y))


def test_keras_dense_step_against_hand_counts():
  c = _step_cost([keras.layers.Dense(5), keras.layers.Dense(3)], (6,))
  forward = 2 * B * (6 * 5 + 5 * 3)
  kernel_gradients = 2 * B * (6 * 5 + 5 * 3)
  input_gradient = 2 * B * 5 * 3  # into the first layer's output only
  assert c.flops == forward + kernel_gradients + input_gradient
  assert c.dots == 5


def test_keras_conv_step_against_hand_counts():
  c = _step_cost([keras.layers.Conv2D(4, 3), keras.layers.Flatten(),
                  keras.layers.Dense(3)], (8, 8, 2))
  conv = 2 * B * (6 * 6 * 4) * (3 * 3 * 2)  # forward = kernel gradient
  dense = 2 * B * (6 * 6 * 4) * 3            # forward = kernel = input grad
  assert c.flops == 2 * conv + 3 * dense
  assert (c.dots, c.convolutions) == (3, 2)
