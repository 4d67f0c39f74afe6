"""The per-example table: every layer and op case against the reference loop.

Each case builds a tiny model (a Keras layer, or a function of raw TF ops on
`tf.Variable`s) and is run through `tf_pxg.testing.check_per_example_gradients`
(per-example gradients, global norms and the clipped sum, all compared with a
plain `tf.GradientTape` loop over single examples) in eager mode, in
`tf.function` and under XLA, at B=1 and B=4, in float32 and float64: in a
pairwise design, each case in all six (mode, batch size) pairs with the
dtype alternating, so every pair of levels of two factors is run
(`TF_PXG_FULL_TABLE=1` runs the full product, 12 runs a case).

Expected values come only from the reference loop. The loss is
`sum((output - label)**2)` over the non-batch axes, one value per example.

Each case also declares, per interface op type, the rule it expects and,
for rules with a choice, the squared-norm form ("ghost" or "materialised"
under XLA; a 2-D convolution's is "native" in the other modes when the
native op library loads);
`tf_pxg.testing.trace_rules` records what ran, and the case fails if another
rule, the vectorized fallback or the other form ran. The `*_ghost` cases have
sizes that select the ghost form with R > 1 summed rows for every rule that
has one.

Every case also passes `tf_pxg.testing.check_gradient_invariants` (no clip:
the clipped sum equals `tf.GradientTape`, per-example gradients sum to it,
no non-zero gradient gets a zero per-example one), at B=4 in `tf.function`.

`test_every_registered_op_has_a_case` fails when a rule is registered for an
op type that no raw-op case exercises (computed from the registry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from typing import Any, Callable, Dict, Optional, Tuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
from tf_pxg import registry
from tf_pxg import testing as pxg_testing

F32, F64 = tf.float32, tf.float64
MODES = pxg_testing.MODES
BATCH_SIZES = (1, 4)


# Building blocks -------------------------------------------------------------


@dataclasses.dataclass
class Setup:
  model: Callable
  variables: list
  inputs: Any


@dataclasses.dataclass(frozen=True)
class Case:
  """One row of the table.

  Attributes:
    name: the test id.
    build: `build(dtype, batch_size, rng) -> Setup`.
    op_types: raw TF op types this case is written to exercise (checked to
      appear in the traced graph; used for registry coverage).
    dtypes: the dtypes the layer/op supports.
    tolerance: `(rtol, atol)` overriding the dtype default.
    without_rule: op type whose rule is removed while the case runs (forces
      the vectorized fallback).
    rules: for each op type that consumes a parameter, the rule expected to
      run, as "RuleClass" or "RuleClass/form" with form the squared-norm
      form ("ghost" or "materialised"); "_VectorizedFallback" for the
      fallback. Op types not listed must not reach a rule.
    invariant_dtypes: the dtypes `check_gradient_invariants` runs in (its
      plain `tf.GradientTape` differentiates the ops tf_pxg's tape
      recorded, nested functions inlined).
  """
  name: str
  build: Callable
  op_types: Tuple[str, ...] = ()
  dtypes: Tuple[tf.DType, ...] = (F32, F64)
  tolerance: Optional[Tuple[float, float]] = None
  without_rule: Optional[str] = None
  rules: Dict[str, str] = dataclasses.field(default_factory=dict)
  invariant_dtypes: Tuple[tf.DType, ...] = (F32, F64)


@contextlib.contextmanager
def without_rule(op_type: Optional[str]):
  """Removes the rule of `op_type` (if any) and re-registers it afterwards."""
  if op_type is None:
    yield
    return
  rule = registry.lookup(op_type)
  registry.unregister(op_type)
  try:
    yield
  finally:
    if rule is not None:
      tf_pxg.register(op_type, override=True)(rule)


def _normal(rng, shape, dtype):
  return tf.constant(rng.standard_normal(shape), dtype)


def _var(rng, shape, dtype, name, positive=False):
  v = rng.standard_normal(shape)
  if positive:
    v = 1.0 + np.abs(v)
  return tf.Variable(tf.constant(v, dtype), name=name)


def _ids(rng, shape, vocab):
  """Token ids with repeats inside each example."""
  ids = rng.integers(0, vocab, size=shape)
  if len(shape) >= 2 and shape[1] >= 2:
    ids[:, 1] = ids[:, 0]
  return tf.constant(ids, tf.int32)


# The rule each op type's cases expect (by class name), unless a case says.
RULE_OF = {
    "MatMul": "MatMulRule", "BatchMatMulV2": "BatchMatMulRule",
    "BatchMatMulV3": "BatchMatMulRule", "Einsum": "EinsumRule",
    "BiasAdd": "BiasAddRule", "AddV2": "AddRule", "Add": "AddRule",
    "Sub": "SubRule", "Mul": "MulRule", "Conv2D": "ConvRule",
    "Conv3D": "ConvRule", "DepthwiseConv2dNative": "DepthwiseConvRule",
    "Conv2DBackpropInput": "ConvTransposeRule", "GatherV2": "_GatherRule",
    "ResourceGather": "_GatherRule",
    "BroadcastTo": "BroadcastToRule", "Tile": "TileRule",
}
FALLBACK = "_VectorizedFallback"


def expect(*op_types, sq=None, **by_op):
  """`{op_type: "Rule[/sq]"}` from RULE_OF, `sq` the form for `op_types`."""
  out = {t: RULE_OF[t] + (f"/{sq}" if sq else "") for t in op_types}
  out.update(by_op)
  return out


def layer_case(name, make_layer, input_shape, *, call=None, ids_vocab=None,
               setup_layer=None, **kw) -> Case:
  """A Keras layer on an input of shape `[B, *input_shape]`."""

  def build(dtype, b, rng):
    keras.utils.set_random_seed(0)
    layer = make_layer(dtype.name)
    if ids_vocab is not None:
      x = _ids(rng, (b,) + tuple(input_shape), ids_vocab)
    else:
      x = _normal(rng, (b,) + tuple(input_shape), dtype)
    fn = layer if call is None else (lambda inp: call(layer, inp))
    fn(x)  # builds the layer
    if setup_layer is not None:
      setup_layer(layer, rng)
    return Setup(fn, list(layer.trainable_variables), x)

  return Case(name, build, **kw)


def raw_case(name, op_types, fn, input_shape, param_shapes, *,
             positive_params=False, ids_vocab=None, sq=None, **kw) -> Case:
  """`fn(x, *params)` of raw TF ops, params `tf.Variable`s of given shapes.

  Unless `rules=` is given, each of `op_types` expects its RULE_OF rule
  (the fallback if `without_rule`) with squared-norm form `sq`.
  """
  if "rules" not in kw:
    if kw.get("without_rule"):
      kw["rules"] = {t: f"{FALLBACK}/materialised" for t in op_types}
    else:
      kw["rules"] = expect(*op_types, sq=sq)

  def build(dtype, b, rng):
    params = [_var(rng, s, dtype, f"w{i}", positive_params)
              for i, s in enumerate(param_shapes)]
    if ids_vocab is not None:
      x = _ids(rng, (b,) + tuple(input_shape), ids_vocab)
    else:
      x = _normal(rng, (b,) + tuple(input_shape), dtype)
    return Setup(lambda inp: fn(inp, *params), params, x)

  return Case(name, build, tuple(op_types), **kw)


def _t(x):
  return tf.transpose(x)


# Layer cases -----------------------------------------------------------------

L = keras.layers


def _mixed_dense(dtype):
  """A Dense built under the mixed_float16 policy (policy restored)."""
  old = keras.config.dtype_policy()
  keras.config.set_dtype_policy("mixed_float16")
  try:
    layer = L.Dense(3, activation="tanh")
  finally:
    keras.config.set_dtype_policy(old)
  del dtype
  return layer


def _lora_dense(dtype):
  layer = L.Dense(4, dtype=dtype)
  layer.build((None, 5))
  layer.enable_lora(2)
  return layer


def _randomize_lora(layer, rng):
  assert not layer._kernel.trainable, "the frozen base kernel must not train"
  assert {v.path.split("/")[-1] for v in layer.trainable_variables} == {
      "bias", "lora_kernel_a", "lora_kernel_b"}
  # lora_kernel_b starts at zero, which would make lora_kernel_a's gradient 0.
  b = layer.lora_kernel_b
  b.assign(rng.standard_normal(b.shape).astype(b.dtype))


# "taps": a depthwise convolution's norms under XLA, tap by tap
# (`tf_pxg.rules.conv._DepthwiseTaps`; native outside XLA, or without the
# native ops the patch path, which materialises). "taps|ghost": the same,
# for sizes where the patch path takes the ghost form.
M, G, T = "materialised", "ghost", "taps"
T_OR_G = "taps|ghost"
BIAS = {"BiasAdd": "BiasAddRule/materialised"}

LAYER_CASES = [
    layer_case("Dense_2d", lambda d: L.Dense(3, activation="tanh", dtype=d),
               (5,), rules=expect("MatMul", sq=G, **BIAS)),
    layer_case("Dense_3d_sequence", lambda d: L.Dense(3, dtype=d), (4, 5),
               rules=expect("MatMul", sq=M, **BIAS)),
    # R = 4 summed rows, d = u = 16: 4 * (16 + 16) < 16 * 16 selects ghost.
    layer_case("Dense_3d_sequence_ghost", lambda d: L.Dense(16, dtype=d),
               (4, 16), rules=expect("MatMul", sq=G, **BIAS)),
    # A widening Dense (8 -> 48 over R = 4 rows): ghost.
    layer_case("Dense_3d_widening_ghost", lambda d: L.Dense(48, dtype=d),
               (4, 8), rules=expect("MatMul", sq=G, **BIAS)),
    layer_case("EinsumDense", lambda d: L.EinsumDense(
        "abc,cd->abd", output_shape=(4, 3), bias_axes="d", dtype=d), (4, 5),
               rules=expect("BatchMatMulV2", sq=M, **BIAS)),
    layer_case("Conv1D_same_strided", lambda d: L.Conv1D(
        3, 3, strides=2, padding="same", dtype=d), (7, 2),
               rules=expect("Conv2D", sq=M, **BIAS)),
    layer_case("Conv2D_same_strides2", lambda d: L.Conv2D(
        3, 3, strides=2, padding="same", dtype=d), (6, 6, 2),
               rules=expect("Conv2D", sq=M, **BIAS)),
    # P = 4 positions, K * C_in = 32, C_out = 16: ghost.
    layer_case("Conv2D_ghost", lambda d: L.Conv2D(16, 2, dtype=d), (3, 3, 8),
               rules=expect("Conv2D", sq=G, **BIAS)),
    layer_case("Conv2D_valid_dilation2", lambda d: L.Conv2D(
        3, 2, dilation_rate=2, padding="valid", dtype=d), (6, 5, 2),
               rules=expect("Conv2D", sq=M, **BIAS)),
    layer_case("Conv3D", lambda d: L.Conv3D(2, 2, dtype=d), (3, 4, 3, 2),
               rules=expect("Conv3D", sq=M, **BIAS)),
    layer_case("DepthwiseConv2D", lambda d: L.DepthwiseConv2D(
        3, depth_multiplier=2, padding="same", dtype=d), (5, 5, 2),
               rules=expect("DepthwiseConv2dNative", sq=T, **BIAS)),
    # Depthwise as a grouped Conv2D (one input channel per group, as Keras'
    # ConvNeXt writes it): native norms and weighted sums outside XLA.
    # Keras runs a grouped Conv2D in an XLA function (TF has no float64
    # grouped Conv2D kernels on CPU); tf_pxg's tape inlines it, so the plain
    # tape of the invariants check, differentiating the inlined op, runs in
    # float32 only. The reference loop and tf_pxg run float64 too.
    layer_case("Conv2D_groups_one_channel_each", lambda d: L.Conv2D(
        6, 3, groups=3, padding="same", dtype=d), (5, 5, 3),
               rules=expect("Conv2D", sq=T, **BIAS),
               invariant_dtypes=(F32,)),
    # ConvNeXt's late stages: a 7x7 kernel over a 2x2 image (most taps fall
    # in the padding), 70 channels (whole vectors and a partial one).
    layer_case("Conv2D_groups_7x7_on_2x2", lambda d: L.Conv2D(
        70, 7, groups=70, padding="same", dtype=d), (2, 2, 70),
               rules=expect("Conv2D", sq=T, **BIAS),
               invariant_dtypes=(F32,)),
    layer_case("SeparableConv2D", lambda d: L.SeparableConv2D(
        3, 3, depth_multiplier=2, dtype=d), (5, 5, 2),
               rules={**expect("DepthwiseConv2dNative", sq=T),
                      **expect("Conv2D", sq=M, **BIAS)}),
    layer_case("Conv2DTranspose", lambda d: L.Conv2DTranspose(
        3, 3, strides=2, padding="same", dtype=d), (3, 3, 2),
               rules=expect("Conv2DBackpropInput", sq=M, **BIAS)),
    layer_case("Embedding_repeated_tokens",
               lambda d: L.Embedding(7, 3, dtype=d), (5,), ids_vocab=7,
               rules=expect("GatherV2")),
    layer_case("LayerNormalization", lambda d: L.LayerNormalization(dtype=d),
               (4, 5), rules=expect("AddV2", "Mul", sq=M)),
    layer_case("GroupNormalization", lambda d: L.GroupNormalization(
        groups=2, dtype=d), (3, 4), rules=expect("AddV2", "Mul", sq=M)),
    layer_case("MultiHeadAttention", lambda d: L.MultiHeadAttention(
        num_heads=2, key_dim=3, dtype=d), (4, 5),
               call=lambda layer, x: layer(x, x),
               rules=expect("BatchMatMulV2", "AddV2", sq=M, **BIAS)),
    # Weights shared over the unrolled steps: norms materialise the sum.
    layer_case("SimpleRNN_unroll", lambda d: L.SimpleRNN(
        3, unroll=True, return_sequences=True, dtype=d), (4, 2),
               rules=expect("MatMul", "BiasAdd")),
    layer_case("LSTM_unroll", lambda d: L.LSTM(3, unroll=True, dtype=d),
               (4, 2), rules=expect("MatMul", "BiasAdd")),
    layer_case("GRU_unroll", lambda d: L.GRU(3, unroll=True, dtype=d),
               (4, 2), rules=expect("MatMul", "BiasAdd", "AddV2")),
    # T = 8 steps: each weight's uses merge into chunks of steps
    # (`merge_uses`), whose norm sums the ghost terms of every chunk pair:
    # 8 rows * (16 + 64) < 16 * 64 for the kernel and the recurrent kernel.
    layer_case("LSTM_unroll_chunked_ghost", lambda d: L.LSTM(
        16, unroll=True, dtype=d), (8, 16),
               rules={**expect("MatMul", sq=G), **expect("BiasAdd")}),
    layer_case("Dense_mixed_float16", _mixed_dense, (5,), dtypes=(F32,),
               tolerance=(2e-2, 2e-3), rules=expect("MatMul", sq=G, **BIAS)),
    # Keras creates the LoRA weights in float32 even for a float64 layer, so
    # the float64 row is a mixed-dtype case held to float32 tolerances.
    # (The kernel is base + A @ B: its norm materialises.)
    layer_case("Dense_LoRA", _lora_dense, (5,), setup_layer=_randomize_lora,
               rules=expect("MatMul", **BIAS)),
]

# Raw-op cases ----------------------------------------------------------------

RAW_CASES = []

# MatMul: every transpose combination, parameter as argument 1 and 0. The data
# operand is x ([B, d]) or its transpose, the output is brought to [B, u].
for ta in (False, True):
  for tb in (False, True):
    RAW_CASES.append(raw_case(
        f"MatMul_param1_ta{int(ta)}_tb{int(tb)}", ["MatMul"],
        lambda x, w, ta=ta, tb=tb: tf.linalg.matmul(
            _t(x) if ta else x, w, transpose_a=ta, transpose_b=tb),
        (5,), [(3, 5) if tb else (5, 3)], sq=G))
    RAW_CASES.append(raw_case(
        f"MatMul_param0_ta{int(ta)}_tb{int(tb)}", ["MatMul"],
        lambda x, w, ta=ta, tb=tb: _t(tf.linalg.matmul(
            w, x if tb else _t(x), transpose_a=ta, transpose_b=tb)),
        (5,), [(5, 3) if ta else (3, 5)], sq=G))


def _bmm(x, y, adj_x=False, adj_y=False, v3=False):
  if v3:
    return tf.raw_ops.BatchMatMulV3(x=x, y=y, Tout=x.dtype, adj_x=adj_x,
                                    adj_y=adj_y)
  return tf.raw_ops.BatchMatMulV2(x=x, y=y, adj_x=adj_x, adj_y=adj_y)


def _depthwise_dilated_by_space_to_batch(x, w):
  blocks, zeros = [2, 2], [[0, 0], [0, 0]]
  y = tf.raw_ops.SpaceToBatchND(input=x, block_shape=blocks, paddings=zeros)
  y = tf.raw_ops.DepthwiseConv2dNative(input=y, filter=w, strides=[1] * 4,
                                       padding="VALID", data_format="NHWC")
  return tf.raw_ops.BatchToSpaceND(input=y, block_shape=blocks, crops=zeros)


for op, v3 in (("BatchMatMulV2", False), ("BatchMatMulV3", True)):
  RAW_CASES += [
      raw_case(f"{op}_param1_broadcast", [op],
               lambda x, w, v3=v3: _bmm(x, w, v3=v3), (4, 5), [(5, 3)], sq=M),
      raw_case(f"{op}_param1_adj_y", [op],
               lambda x, w, v3=v3: _bmm(x, w, adj_y=True, v3=v3), (4, 5),
               [(3, 5)], sq=M),
      raw_case(f"{op}_param1_adj_x", [op],
               lambda x, w, v3=v3: _bmm(x, w, adj_x=True, v3=v3), (5, 4),
               [(5, 3)], sq=M),
      raw_case(f"{op}_param1_rank3", [op],
               lambda x, w, v3=v3: _bmm(x, w, v3=v3), (4, 5), [(1, 5, 3)],
               sq=M),
      raw_case(f"{op}_param0", [op],
               lambda x, w, v3=v3: _bmm(w, x, v3=v3), (4, 5), [(3, 4)], sq=M),
      raw_case(f"{op}_param0_adj_x", [op],
               lambda x, w, v3=v3: _bmm(w, x, adj_x=True, v3=v3), (4, 5),
               [(4, 3)], sq=M),
  ]

# Einsum: batch on axis 0 of the data operand.
# The `_ghost` rows have T = 4 summed rows and large enough parameter sides
# (R (Pd + Po) < Pd Po) to select the ghost norm.
for eq, x_shape, w_shape, sq, suffix in (
    ("bi,io->bo", (5,), (5, 3), G, ""),
    ("bti,io->bto", (4, 5), (5, 3), M, ""),
    ("io,bti->bto", (4, 5), (5, 3), M, ""),
    ("btd,dhk->bthk", (4, 5), (5, 2, 3), M, ""),
    ("bti,i->bt", (4, 5), (5,), M, ""),
    ("bti,io->bto", (4, 16), (16, 16), G, "_ghost"),
    ("io,bti->bto", (4, 16), (16, 16), G, "_ghost"),
    ("btd,dhk->bthk", (4, 16), (16, 2, 8), G, "_ghost"),
):
  param_first = eq.index(",") == 2 and not eq.startswith("b")
  RAW_CASES.append(raw_case(
      "Einsum_" + eq.replace(",", "_").replace("->", "_to_") + suffix,
      ["Einsum"],
      (lambda x, w, eq=eq: tf.einsum(eq, w, x)) if param_first else
      (lambda x, w, eq=eq: tf.einsum(eq, x, w)), x_shape, [w_shape], sq=sq))

RAW_CASES += [
    raw_case("BiasAdd_2d", ["BiasAdd"], lambda x, b: tf.nn.bias_add(x, b),
             (5,), [(5,)], sq=M),
    raw_case("BiasAdd_NHWC", ["BiasAdd"], lambda x, b: tf.nn.bias_add(x, b),
             (3, 3, 2), [(2,)], sq=M),
    raw_case("BiasAdd_NCHW", ["BiasAdd"],
             lambda x, b: tf.nn.bias_add(x, b, data_format="NCHW"),
             (2, 3, 3), [(2,)], sq=M),
    # Elementwise with broadcasting, parameter on either side.
    raw_case("AddV2_x_plus_w", ["AddV2"], lambda x, w: x + w, (4, 5), [(5,)],
             sq=M),
    raw_case("AddV2_w_plus_x", ["AddV2"], lambda x, w: w + x, (4, 5),
             [(4, 5)], sq=M),
    raw_case("AddV2_w_1x5", ["AddV2"], lambda x, w: tf.tanh(x) + w, (5,),
             [(1, 5)], sq=M),
    raw_case("Add_x_plus_w", ["Add"], lambda x, w: tf.raw_ops.Add(x=x, y=w),
             (4, 5), [(5,)], sq=M),
    raw_case("Add_w_plus_x", ["Add"], lambda x, w: tf.raw_ops.Add(x=w, y=x),
             (4, 5), [(4, 1)], sq=M),
    raw_case("Sub_x_minus_w", ["Sub"], lambda x, w: x - w, (4, 5), [(5,)],
             sq=M),
    raw_case("Sub_w_minus_x", ["Sub"], lambda x, w: w - x, (4, 5), [(4, 5)],
             sq=M),
    raw_case("Mul_x_times_w", ["Mul"], lambda x, w: x * w, (4, 5), [(5,)],
             sq=M),
    raw_case("Mul_w_times_x", ["Mul"], lambda x, w: w * x, (4, 5), [(4, 1)],
             sq=M),
    raw_case("Mul_scalar_param", ["Mul"], lambda x, w: w * x, (5,), [()], sq=M),
    raw_case("Mul_param_squared_times_x", ["Mul"],
             lambda x, w: x * (w * w), (5,), [(5,)]),
    # Convolutions.
    raw_case("Conv2D_SAME_strides2", ["Conv2D"],
             lambda x, w: tf.nn.conv2d(x, w, strides=2, padding="SAME"),
             (5, 5, 2), [(3, 3, 2, 3)], sq=M),
    raw_case("Conv2D_VALID_dilation2", ["Conv2D"],
             lambda x, w: tf.nn.conv2d(x, w, strides=1, padding="VALID",
                                       dilations=2), (6, 5, 2),
             [(2, 2, 2, 3)], sq=M),
    raw_case("Conv2D_VALID_strides_2x1", ["Conv2D"],
             lambda x, w: tf.nn.conv2d(x, w, strides=[1, 2, 1, 1],
                                       padding="VALID"), (5, 4, 1),
             [(2, 3, 1, 2)], sq=M),
    raw_case("Conv3D_SAME", ["Conv3D"],
             lambda x, w: tf.nn.conv3d(x, w, strides=[1, 1, 2, 1, 1],
                                       padding="SAME"), (3, 4, 3, 2),
             [(2, 2, 2, 2, 2)], sq=M),
    raw_case("DepthwiseConv2dNative_SAME", ["DepthwiseConv2dNative"],
             lambda x, w: tf.raw_ops.DepthwiseConv2dNative(
                 input=x, filter=w, strides=[1, 1, 1, 1], padding="SAME"),
             (4, 4, 2), [(3, 3, 2, 2)], sq=T),
    raw_case("DepthwiseConv2dNative_VALID_strides2", ["DepthwiseConv2dNative"],
             lambda x, w: tf.raw_ops.DepthwiseConv2dNative(
                 input=x, filter=w, strides=[1, 2, 2, 1], padding="VALID"),
             (5, 5, 2), [(2, 2, 2, 1)], sq=T),
    raw_case("Conv2DBackpropInput_SAME_strides2", ["Conv2DBackpropInput"],
             lambda x, w: tf.nn.conv2d_transpose(
                 x, w, tf.stack([tf.shape(x)[0], 6, 6, 3]), strides=2,
                 padding="SAME"), (3, 3, 2), [(3, 3, 3, 2)], sq=M),
    raw_case("Conv2DBackpropInput_VALID", ["Conv2DBackpropInput"],
             lambda x, w: tf.nn.conv2d_transpose(
                 x, w, tf.stack([tf.shape(x)[0], 4, 5, 2]), strides=1,
                 padding="VALID"), (3, 3, 2), [(2, 3, 2, 2)], sq=M),
    raw_case("DepthwiseConv2dNative_SAME_strides2_70_channels",
             ["DepthwiseConv2dNative"],
             lambda x, w: tf.raw_ops.DepthwiseConv2dNative(
                 input=x, filter=w, strides=[1, 2, 2, 1], padding="SAME"),
             (5, 4, 70), [(3, 2, 70, 1)], sq=T),
    # A dilated depthwise conv as TF writes it: SpaceToBatchND, the op on
    # rows [k, B] (the examples minor), BatchToSpaceND.
    raw_case("DepthwiseConv2dNative_space_to_batch_examples_minor",
             ["DepthwiseConv2dNative"], _depthwise_dilated_by_space_to_batch,
             (6, 6, 3), [(2, 2, 3, 2)], sq=T),
    # TF has no float64 grouped Conv2D kernel on CPU (the reference loop
    # cannot run it); Keras runs its grouped Conv2D under XLA, see the
    # Conv2D_groups_* layer cases for float64.
    raw_case("Conv2D_one_input_channel_per_group_strides2", ["Conv2D"],
             lambda x, w: tf.nn.conv2d(x, w, strides=2, padding="SAME"),
             (5, 5, 4), [(3, 3, 1, 8)], sq=T, dtypes=(F32,)),
    # Ghost-norm sizes: P positions, K * C_in and C_out large enough.
    raw_case("Conv2D_VALID_ghost", ["Conv2D"],
             lambda x, w: tf.nn.conv2d(x, w, strides=1, padding="VALID"),
             (3, 3, 8), [(2, 2, 8, 16)], sq=G),
    raw_case("Conv3D_VALID_ghost", ["Conv3D"],
             lambda x, w: tf.nn.conv3d(x, w, strides=[1] * 5,
                                       padding="VALID"), (3, 2, 2, 4),
             [(2, 2, 2, 4, 16)], sq=G),
    # (Depthwise convolutions take the taps under XLA whatever the sizes;
    # the patch path, without the native ops, the ghost form.)
    raw_case("DepthwiseConv2dNative_VALID_ghost", ["DepthwiseConv2dNative"],
             lambda x, w: tf.raw_ops.DepthwiseConv2dNative(
                 input=x, filter=w, strides=[1, 1, 1, 1], padding="VALID"),
             (4, 4, 2), [(3, 3, 2, 16)], sq=T_OR_G),
    raw_case("Conv2DBackpropInput_SAME_strides2_ghost", ["Conv2DBackpropInput"],
             lambda x, w: tf.nn.conv2d_transpose(
                 x, w, tf.stack([tf.shape(x)[0], 4, 4, 8]), strides=2,
                 padding="SAME"), (2, 2, 16), [(3, 3, 8, 16)], sq=G),
    # Gathers (repeated tokens inside an example).
    raw_case("GatherV2_tokens", ["GatherV2"],
             lambda ids, w: tf.gather(tf.convert_to_tensor(w), ids), (4,),
             [(6, 3)], ids_vocab=6),
    raw_case("GatherV2_one_token", ["GatherV2"],
             lambda ids, w: tf.gather(tf.convert_to_tensor(w), ids), (),
             [(6, 3)], ids_vocab=6),
    raw_case("ResourceGather_tokens", ["ResourceGather"],
             lambda ids, w: tf.gather(w, ids), (4,), [(6, 3)], ids_vocab=6),
    raw_case("ResourceGather_embedding_lookup", ["ResourceGather"],
             lambda ids, w: tf.nn.embedding_lookup(w, ids), (3,), [(5, 2)],
             ids_vocab=5),
]

# Parameters copied along the batch axis (`tf_pxg.rules.copies`): the copy
# op is the interface; what follows it is data (no other rule runs).


def _position_table(x, w):
  """KerasHub's PositionEmbedding: the table's first T rows broadcast to
  the batch (`ops.broadcast_to(table[:T], ops.shape(x))`)."""
  t = keras.ops.slice(keras.ops.convert_to_tensor(w), (0, 0),
                      (x.shape[1], x.shape[2]))
  return x + keras.ops.broadcast_to(t, keras.ops.shape(x))


def _class_token(x, cls):
  """ViT's class token: tiled to the batch, concatenated with the patches."""
  tokens = keras.ops.tile(cls, (keras.ops.shape(x)[0], 1, 1))
  return tf.tanh(tf.concat([tokens, x], axis=1))


def _folded_rows(x, w):
  """A [B, T, d] copy folded into [B*T, d] rows (the batch major)."""
  rows = tf.reshape(tf.broadcast_to(w, tf.shape(x)), [-1, x.shape[-1]])
  return tf.reshape(tf.reshape(x, [-1, x.shape[-1]]) * rows, tf.shape(x))


def _tiled_rows(x, w):
  """`tf.tile(w, [B, 1])` of a [T, d] weight: [B*T, d], T rows an example."""
  rows = tf.tile(w, [tf.shape(x)[0], 1])
  return tf.reshape(tf.reshape(x, [-1, x.shape[-1]]) + rows, tf.shape(x))


def _time_major_copy(x, w):
  """A [T, 1, d] weight broadcast along the batch on axis 1 (time-major)."""
  xt = tf.transpose(x, [1, 0, 2])
  return tf.transpose(xt * tf.broadcast_to(w, tf.shape(xt)), [1, 0, 2])


RAW_CASES += [
    raw_case("BroadcastTo_position_table", ["BroadcastTo"], _position_table,
             (3, 5), [(6, 5)], sq=M),
    raw_case("BroadcastTo_tf_shape", ["BroadcastTo"],
             lambda x, w: x * tf.broadcast_to(w, tf.shape(x)), (3, 5),
             [(1, 5)], sq=M),
    raw_case("BroadcastTo_folded_into_rows", ["BroadcastTo"], _folded_rows,
             (3, 4), [(3, 4)], sq=M),
    raw_case("BroadcastTo_time_major_batch_axis_1", ["BroadcastTo"],
             _time_major_copy, (3, 4), [(3, 1, 4)], sq=M),
    raw_case("Tile_class_token_concat", ["Tile"], _class_token, (3, 4),
             [(1, 1, 4)], sq=M),
    raw_case("Tile_merged_rows", ["Tile"], _tiled_rows, (2, 4), [(2, 4)],
             sq=M),
    raw_case("Tile_within_example", ["Tile"],
             lambda x, w: x * tf.tile(w[None], [tf.shape(x)[0], 2, 1]),
             (4, 3), [(2, 3)], sq=M),
    # tf.repeat / keras.ops.repeat: ExpandDims, Tile (batch on axis 1),
    # Reshape (DeBERTa's relative table).
    raw_case("Tile_tf_repeat", ["Tile"],
             lambda x, w: x + tf.repeat(w[None], tf.shape(x)[0], axis=0),
             (3, 4), [(3, 4)], sq=M),
    raw_case("Tile_keras_repeat", ["Tile"],
             lambda x, w: x * keras.ops.repeat(
                 keras.ops.expand_dims(w, 0), keras.ops.shape(x)[0], axis=0),
             (3, 4), [(3, 4)], sq=M),
]

# Parameter sharing and parameter-only preprocessing ---------------------------


def _tied_embedding(ids, e):
  h = tf.reduce_mean(tf.gather(e, ids), axis=1)          # [B, d]
  return tf.linalg.matmul(h, e, transpose_b=True)         # [B, V]


def _twice(dtype, b, rng):
  keras.utils.set_random_seed(0)
  layer = L.Dense(4, activation="tanh", dtype=dtype.name)
  x = _normal(rng, (b, 4), dtype)
  fn = lambda inp: layer(layer(inp))
  fn(x)
  return Setup(fn, list(layer.trainable_variables), x)


def _mlp_with_bias(x, w1, b1, w2):
  return tf.linalg.matmul(tf.tanh(tf.linalg.matmul(x, w1) + b1), w2)


STRUCTURE_CASES = [
    # Tied or transformed weights. A tied table's norm is the uses' own
    # norms plus their cross term from outer-product factors where that is
    # cheaper (`tf_pxg.rules.factors`, tests/test_tied_embedding.py); at
    # this size materialising is, so no sq_norm call is declared.
    raw_case("tied_embedding_gather_and_matmul_transpose_b", (),
             _tied_embedding, (4,), [(6, 3)], ids_vocab=6,
             rules=expect("ResourceGather", "MatMul")),
    Case("layer_called_twice", _twice, rules=expect("MatMul", "BiasAdd")),
    raw_case("kernel_reshaped_and_scaled", (),
             lambda x, w: tf.linalg.matmul(x, 2.0 * tf.reshape(w, [5, 3])),
             (5,), [(15,)], rules=expect("MatMul")),
    raw_case("kernel_is_sum_of_param_and_param_product", (),
             lambda x, w, a: tf.linalg.matmul(x, w + tf.matmul(a, a)),
             (3,), [(3, 3), (3, 3)], rules=expect("MatMul")),
    raw_case("mlp_two_layers_with_bias", (), _mlp_with_bias, (5,),
             [(5, 4), (4,), (4, 2)], rules=expect("MatMul", sq=G,
                                                  AddV2="AddRule/" + M)),
]

# Unregistered ops consuming a parameter: the vectorized fallback --------------

FALLBACK_CASES = [
    raw_case("fallback_SquaredDifference", ["SquaredDifference"],
             lambda x, w: tf.math.cumsum(tf.math.squared_difference(x, w),
                                         axis=1), (5,), [(5,)],
             without_rule="SquaredDifference"),
    raw_case("fallback_RealDiv", ["RealDiv"], lambda x, w: x / w, (4, 3),
             [(3,)], positive_params=True, without_rule="RealDiv"),
    raw_case("fallback_Maximum", ["Maximum"],
             lambda x, w: tf.maximum(x, w), (4, 3), [(4, 3)],
             without_rule="Maximum"),
    raw_case("fallback_Conv2D_rule_removed", ["Conv2D"],
             lambda x, w: tf.nn.conv2d(x, w, strides=1, padding="SAME"),
             (4, 4, 2), [(3, 3, 2, 2)], without_rule="Conv2D"),
    raw_case("fallback_MatMul_rule_removed", ["MatMul"],
             lambda x, w: tf.linalg.matmul(x, w), (5,), [(5, 3)],
             without_rule="MatMul"),
]

CASES = LAYER_CASES + RAW_CASES + STRUCTURE_CASES + FALLBACK_CASES
_CASES_BY_NAME = {c.name: c for c in CASES}
assert len(_CASES_BY_NAME) == len(CASES), "duplicate case names"


# The table -------------------------------------------------------------------


def _loss(labels, outputs):
  outputs = tf.cast(outputs, labels.dtype)
  d = outputs - labels
  return 0.5 * tf.reduce_sum(tf.reshape(d * d, [tf.shape(d)[0], -1]), axis=1)


_BUILT = {}
_ERRORS = {}


def _built(case: Case, dtype, b):
  """The case's model, variables, inputs, labels and reference, memoised so
  the three modes share one reference computation."""
  key = (case.name, dtype.name, b)
  if key not in _BUILT:
    rng = np.random.default_rng(zlib.crc32(case.name.encode()) + b)
    setup = case.build(dtype, b, rng)
    out = tf.convert_to_tensor(setup.model(setup.inputs))
    label_dtype = F64 if dtype == F64 else F32
    labels = _normal(rng, out.shape, label_dtype)
    with without_rule(case.without_rule):
      reference = pxg_testing.reference_per_example_gradients(
          _loss, setup.model, setup.variables, setup.inputs, labels)
    _BUILT[key] = (setup, labels, reference)
  return _BUILT[key]


# `TF_PXG_FULL_TABLE=1`: every case in the full product of modes, batch
# sizes and dtypes (12 runs a case) instead of the pairwise design below.
FULL_TABLE = os.environ.get("TF_PXG_FULL_TABLE", "0") == "1"


def _params():
  """Each case in every (mode, batch size) pair, with the dtype alternating
  so that every pair of factors (mode and batch size, mode and dtype,
  batch size and dtype) is covered: 6 runs a case instead of the full
  product's 12 (a pairwise covering design, as JAX's tests sample their
  parameter products; `FULL_TABLE` runs them all)."""
  for case in CASES:
    for i, mode in enumerate(MODES):
      for j, b in enumerate(BATCH_SIZES):
        dtypes = (case.dtypes if FULL_TABLE else
                  (case.dtypes[(i + j) % len(case.dtypes)],))
        for dtype in dtypes:
          yield pytest.param(case.name, dtype, b, mode,
                             id=f"{case.name}-{mode}-B{b}-{dtype.name}")


@pytest.fixture(scope="module", autouse=True)
def _report_worst_error():
  """Prints (pytest -s) the worst relative error over the passing checks."""
  yield
  if _ERRORS:
    print(f"\n[per-example table] {len(_ERRORS)} checks passed")
    for group in ("float64", "float32", "mixed_float16"):
      errs = {k: e for k, e in _ERRORS.items()
              if (group == "mixed_float16") == ("mixed_float16" in k) and
              (group == "mixed_float16" or k.endswith(group))}
      if errs:
        worst = max(errs, key=errs.get)
        print(f"  worst relative error, {group}: {errs[worst]:.3g} at {worst}")
  _BUILT.clear()


# Rules whose squared norms a native op computes on CPU outside XLA for
# float32/float64 (the declared form is the patch path's, which XLA runs):
# 2-D convolutions with one group or one input channel per group
# (`TfPxgConv2DFilterSqNorm`, `TfPxgDepthwiseConv2DFilterSqNorm`).
NATIVE_SQ_NORM = {"Conv2D", "DepthwiseConv2dNative"}


def _native_ops() -> bool:
  from tf_pxg import native  # pylint: disable=g-import-not-at-top
  return native.library() is not None


def _declared_form(case: Case, op: str, form: str, mode: str,
                   dtype: tf.DType) -> str:
  """The squared-norm form `op` must take in `mode` and `dtype`: the
  declared one (what XLA runs), except outside XLA for the convolutions a
  native op serves (`NATIVE_SQ_NORM`): "native" where the library loads,
  else the patch path's (for "taps": materialised; for "taps|ghost":
  ghost). With `TF_PXG_NATIVE=0` (or no compiler) the table thus checks
  the fallbacks the native ops replace."""
  xla_form, _, patch_form = form.partition("|")
  if not form or mode == "jit" or op not in NATIVE_SQ_NORM:
    return xla_form
  if dtype in (F32, F64) and case.without_rule is None and _native_ops():
    return "native"
  return patch_form or (M if xla_form == T else xla_form)


# Rule calls that compute a parameter's squared norms (the second for the
# chunks of merged uses, `tf_pxg.per_example.merge_uses`).
_NORM_FORMS = ("sq_norm", "chunked_sq_norm")


def rule_problems(case: Case, records, mode: str = "eager",
                  dtype: tf.DType = F32) -> list:
  """What in `records` (from `trace_rules`) differs from `case.rules`; in
  `mode` and `dtype` (where the native conv norms replace the declared
  form)."""
  by_op = {}
  for r in records:
    by_op.setdefault(r["op_type"], []).append(r)
  problems = [f"{op}: reached {sorted({r['rule'] for r in by_op[op]})}, but "
              "the case declares no rule for it"
              for op in sorted(set(by_op) - set(case.rules))]
  for op, spec in sorted(case.rules.items()):
    rule, _, form = spec.partition("/")
    form = _declared_form(case, op, form, mode, dtype)
    calls = by_op.get(op, [])
    if not calls:
      problems.append(f"{op}: no rule ran (expected {spec})")
    for r in calls:
      if r["rule"] != rule:
        problems.append(f"{op}.{r['form']}: ran {r['rule']}, expected {rule}")
      vectorized = r.get("per_example") == "vectorized"
      if vectorized and rule != FALLBACK:
        problems.append(f"{op}.{r['form']}: {rule} fell back to the "
                        "vectorized TF gradient")
      if (rule == FALLBACK and r["form"] == "per_example" and
          not vectorized):
        problems.append(f"{op}.per_example: the fallback did not vectorize")
      if (form and r["form"] in _NORM_FORMS and
          r.get("sq_norm") != form):
        problems.append(f"{op}.{r['form']}: took the {r.get('sq_norm')} "
                        f"form, expected {form}")
    if form and not any(r["form"] in _NORM_FORMS for r in calls):
      problems.append(f"{op}: norms never called the rule's sq_norm "
                      f"(expected the {form} form)")
  return problems


@pytest.mark.parametrize("name,dtype,batch_size,mode", list(_params()))
def test_per_example_table(name, dtype, batch_size, mode):
  case = _CASES_BY_NAME[name]
  setup, labels, reference = _built(case, dtype, batch_size)
  kwargs = {}
  if case.tolerance is not None:
    kwargs["rtol"], kwargs["atol"] = case.tolerance
  with without_rule(case.without_rule):
    with pxg_testing.trace_rules() as records:
      err = pxg_testing.check_per_example_gradients(
          _loss, setup.model, setup.variables, setup.inputs, labels,
          mode=mode, reference=reference, **kwargs)
    problems = rule_problems(case, records, mode, dtype)
    assert not problems, (
        f"{name}: the rules that ran differ from the case's declaration:\n  "
        + "\n  ".join(problems))
    # Implied by the reference check in every mode; run at B=4 in
    # `tf.function` (float32 in the pairwise design) to keep the table lean.
    if (batch_size > 1 and mode == "function" and
        dtype in case.invariant_dtypes):
      pxg_testing.check_gradient_invariants(
          _loss, setup.model, setup.variables, setup.inputs, labels,
          mode=mode, **kwargs)
  _ERRORS[f"{name}-{mode}-B{batch_size}-{dtype.name}"] = err


def test_mixed_precision_policy_restored():
  assert keras.config.dtype_policy().name == "float32"


# Coverage and sanity of the table --------------------------------------------


def test_every_registered_op_has_a_case():
  covered = {t for c in RAW_CASES + FALLBACK_CASES for t in c.op_types
             if c.without_rule is None}
  missing = sorted(set(tf_pxg.registered_op_types()) - covered)
  assert not missing, (
      f"Registered op types without a raw-op case in the per-example table: "
      f"{missing}. Add a raw_case(...) for each to RAW_CASES in "
      f"{__file__}.")


@pytest.mark.parametrize(
    "name", [c.name for c in RAW_CASES + FALLBACK_CASES if c.op_types])
def test_raw_case_emits_its_op_types(name):
  """A raw-op case really builds the op types it claims to cover."""
  case = _CASES_BY_NAME[name]
  setup = case.build(F32, 2, np.random.default_rng(0))
  spec = tf.TensorSpec(setup.inputs.shape, setup.inputs.dtype)
  graph = tf.function(setup.model).get_concrete_function(spec).graph
  types = {op.type for op in graph.get_operations()}
  assert set(case.op_types) <= types, (case.op_types, sorted(types))


# Errors ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_batch_normalization_raises(mode):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((4,)),
      L.Dense(3),
      L.BatchNormalization(name="my_batch_norm"),
      L.Dense(2),
  ])
  x = _normal(np.random.default_rng(0), (4, 4), F32)
  labels = _normal(np.random.default_rng(1), (4, 2), F32)
  model(x)

  def fn(inp):
    return model(inp, training=True)

  with pytest.raises(ValueError) as info:
    pxg_testing.check_per_example_gradients(
        _loss, fn, model.trainable_variables, x, labels, mode=mode,
        reference=[tf.zeros([4] + list(v.shape))
                   for v in model.trainable_variables])
  msg = str(info.value)
  assert "GroupNormalization" in msg and "LayerNormalization" in msg, msg
  assert "op '" in msg, msg  # names the op
  assert "my_batch_norm" in msg, msg  # names the layer


@pytest.mark.parametrize("mode", MODES)
def test_fallback_that_cannot_work_raises(mode):
  """MatrixSolve with the batch on axis 1 of its data operand (tracked
  through the transpose): batched linear algebra is on the allowlist only
  with the examples on a leading (batch) axis, so this raises before any
  fallback could split examples out of axis 0; the error names the op and
  the axis."""
  rng = np.random.default_rng(0)
  w = _var(rng, (3, 3), F32, "w")
  w.assign(w + 4.0 * tf.eye(3))
  x = _normal(rng, (2, 3), F32)
  labels = _normal(rng, (2, 3), F32)

  def fn(inp):
    return tf.transpose(tf.linalg.solve(w, tf.transpose(inp)))

  with without_rule("MatrixSolve"):
    with pytest.raises(ValueError) as info:
      pxg_testing.check_per_example_gradients(_loss, fn, [w], x, labels,
                                              mode=mode)
  msg = str(info.value)
  assert "MatrixSolve" in msg and "axis 1" in msg, msg
  assert "mixes examples" in msg, msg


@pytest.mark.parametrize("op", ["ConcatV2", "AddV2"])
@pytest.mark.parametrize("mode", MODES)
def test_parameter_rows_per_example_raise_at_trace_time(op, mode):
  """A parameter operand whose axis 0 lines up with the batch (its own row
  per example, not a copy of a shared weight along the batch) raises a
  clear error naming the op and the way to copy a weight, before anything
  runs: never a raw runtime error from inside the fallback (ConcatOffset)
  nor a wrong per-example gradient."""
  rng = np.random.default_rng(0)
  x = _normal(rng, (4, 3, 5), F32)
  w = _var(rng, (4, 1, 5) if op == "ConcatV2" else (4, 3, 5), F32, "rows")

  def fn(inp):
    if op == "ConcatV2":
      return tf.concat([tf.identity(w), inp], axis=1)
    return inp + w

  labels = _normal(rng, fn(x).shape, F32)
  with pytest.raises(ValueError) as info:
    pxg_testing.check_per_example_gradients(
        _loss, fn, [w], x, labels, mode=mode,
        reference=[tf.zeros([4] + list(w.shape))])
  msg = str(info.value)
  assert f"op '{op}'" in msg and "tf.tile" in msg, msg
  assert "lines up with the batch axis" in msg, msg


class _WrongRule(tf_pxg.rules.base.Rule):
  """The fallback's per-example gradient with one form deliberately wrong."""

  def __init__(self, wrong):
    self.wrong = wrong

  def per_example(self, ctx):
    g = tf_pxg.rules.base.vectorized_per_example(ctx)
    return 2.0 * g if self.wrong == "per_example" else g

  def sq_norm(self, ctx):
    n = super().sq_norm(ctx)
    return 2.0 * n if self.wrong == "sq_norm" else n

  def weighted_sum(self, ctx, c):
    s = super().weighted_sum(ctx, c)
    return 2.0 * s if self.wrong == "weighted_sum" else s


@pytest.mark.parametrize("wrong,quantity", [
    ("per_example", "per_example_gradient"),
    ("sq_norm", "per_example_norms"),
    ("weighted_sum", "clipped_gradient_sum"),
])
def test_check_reports_a_wrong_rule(wrong, quantity):
  """The reference check catches a wrong rule form and names the quantity."""
  rng = np.random.default_rng(0)
  w = _var(rng, (3,), F32, "w")
  x = _normal(rng, (4, 3), F32)
  labels = _normal(rng, (4, 3), F32)
  with without_rule("SquaredDifference"):
    tf_pxg.register("SquaredDifference")(_WrongRule(wrong))
    try:
      with pytest.raises(AssertionError, match=quantity):
        pxg_testing.check_per_example_gradients(
            _loss, lambda inp: tf.math.squared_difference(inp, w), [w], x,
            labels)
    finally:
      registry.unregister("SquaredDifference")


# The reference itself ----------------------------------------------------------


def test_reference_matches_closed_form():
  """For 0.5 * ||x W - y||^2, example b's gradient is outer(x_b, x_b W - y_b)."""
  rng = np.random.default_rng(0)
  w = _var(rng, (3, 2), F64, "w")
  x, y = _normal(rng, (4, 3), F64), _normal(rng, (4, 2), F64)
  ref, = pxg_testing.reference_per_example_gradients(
      _loss, lambda inp: tf.linalg.matmul(inp, w), [w], x, y)
  r = x.numpy() @ w.numpy() - y.numpy()
  np.testing.assert_allclose(ref.numpy(), np.einsum("bi,bo->bio", x.numpy(), r),
                             rtol=1e-12)


def test_check_rejects_a_loss_that_is_not_per_example():
  rng = np.random.default_rng(0)
  w = _var(rng, (3, 2), F32, "w")
  x = _normal(rng, (4, 3), F32)
  with pytest.raises(ValueError, match=r"shape \[B\]"):
    pxg_testing.check_per_example_gradients(
        None, lambda inp: tf.reduce_sum(tf.linalg.matmul(inp, w)), [w], x)


@pytest.mark.parametrize("op", ["FusedBatchNormV3", "fused_batch_norm_v1"])
@pytest.mark.parametrize("mode", MODES)
def test_fused_batch_norm_in_training_raises(op, mode):
  """A raw fused batch norm in training mixes examples (batch statistics):
  no per-example gradient exists, and the error says what to use instead."""
  rng = np.random.default_rng(0)
  x = _normal(rng, (4, 3, 3, 2), F32)
  labels = _normal(rng, (4, 3, 3, 2), F32)
  scale = _var(rng, (2,), F32, "scale", positive=True)
  offset = _var(rng, (2,), F32, "offset")

  def fn(inp):
    if op == "FusedBatchNormV3":
      return tf.raw_ops.FusedBatchNormV3(
          x=inp, scale=scale, offset=offset, mean=tf.zeros([0]),
          variance=tf.zeros([0]), is_training=True)[0]
    return tf.compat.v1.nn.fused_batch_norm(inp, scale, offset,
                                            is_training=True)[0]

  with pytest.raises(ValueError) as info:
    pxg_testing.check_per_example_gradients(
        _loss, fn, [scale, offset], x, labels, mode=mode,
        reference=[tf.zeros([4, 2]), tf.zeros([4, 2])])
  msg = str(info.value)
  assert "FusedBatchNorm" in msg, msg
  assert "GroupNormalization" in msg and "LayerNormalization" in msg, msg


# The tooling itself: it must be able to fail --------------------------------


def test_rule_declaration_catches_the_fallback_and_the_other_form():
  """`rule_problems` flags a case whose rule silently fell back, and a norm
  that took the other form than declared."""
  case = _CASES_BY_NAME["Einsum_bti_io_to_bto_ghost"]
  setup, labels, reference = _built(case, F32, 4)
  with pxg_testing.trace_rules() as records:
    pxg_testing.check_per_example_gradients(
        _loss, setup.model, setup.variables, setup.inputs, labels,
        reference=reference)
  assert not rule_problems(case, records)
  as_materialised = dataclasses.replace(
      case, rules={"Einsum": "EinsumRule/materialised"})
  assert any("ghost form, expected materialised" in p
             for p in rule_problems(as_materialised, records))
  with without_rule("Einsum"):
    with pxg_testing.trace_rules() as records:
      pxg_testing.check_per_example_gradients(  # exact, so it passes...
          _loss, setup.model, setup.variables, setup.inputs, labels,
          reference=reference)
  problems = rule_problems(case, records)  # ...but the declaration does not
  assert any(f"ran {FALLBACK}, expected EinsumRule" in p for p in problems)
  assert any("fell back to the vectorized" in p for p in problems)


def _conv_per_example_numpy(x, dz, rates, kernel):
  """Example b's filter gradient of sum(conv(x, w) * dz), VALID, stride 1,
  by explicit loops over output positions and kernel taps."""
  b_total, out_h, out_w, c_out = dz.shape
  kh, kw = kernel
  g = np.zeros((b_total, kh, kw, x.shape[-1], c_out))
  for i in range(kh):
    for j in range(kw):
      patch = x[:, i * rates[0]:i * rates[0] + out_h,
                j * rates[1]:j * rates[1] + out_w, :]
      g[:, i, j] = np.einsum("bhwc,bhwo->bco", patch, dz)
  return g


@pytest.mark.parametrize("dtype", [F32, F64])
def test_dilation_free_reference_matches_explicit_loops(dtype):
  """The reference's dilated-conv gradient (zero-dilated filter, needs no
  dilated backprop kernel) is the exact filter gradient."""
  rng = np.random.default_rng(0)
  x = _normal(rng, (3, 7, 6, 2), dtype)
  w = _var(rng, (2, 3, 2, 4), dtype, "w")
  dz = _normal(rng, (3, 5, 2, 4), dtype)  # output: 7 - 2, 6 - 2 * 2

  def fn(inputs):
    inp, d = inputs
    out = tf.nn.conv2d(inp, w, strides=1, padding="VALID", dilations=[2, 2])
    return tf.reduce_sum(out * d, axis=[1, 2, 3])

  ref, = pxg_testing.reference_per_example_gradients(None, fn, [w], (x, dz))
  ref = ref.numpy()
  want = _conv_per_example_numpy(x.numpy(), dz.numpy(), (2, 2), (2, 3))
  tol = 1e-12 if dtype == F64 else 1e-5
  np.testing.assert_allclose(ref, want, rtol=tol, atol=tol)


def test_noise_floor_is_relative_to_the_gradient_set():
  """A gradient that is zero in exact arithmetic, compared with float noise
  at the scale of the other gradients, passes; a 1% error in a real gradient
  100x smaller than the largest still fails."""
  rng = np.random.default_rng(0)
  big = _var(rng, (3,), F32, "big")
  small = _var(rng, (3,), F32, "small")
  zero = _var(rng, (3,), F32, "zero")
  x = _normal(rng, (4, 3), F32)
  labels = tf.zeros([4, 3])

  def model(inp):  # zero's gradient is exactly 0 for tf_pxg and reference
    return tf.stack([tf.reduce_sum(inp * big, 1) * 100.0,
                     tf.reduce_sum(inp * small, 1),
                     tf.reduce_sum(inp * zero, 1) * 0.0], 1)

  loss = lambda y, out: tf.reduce_sum(out, 1)
  variables = [big, small, zero]
  ref = pxg_testing.reference_per_example_gradients(loss, model, variables, x,
                                                    labels)
  largest = float(tf.reduce_max(tf.abs(ref[0])))
  assert largest > 50.0 and float(tf.reduce_max(tf.abs(ref[1]))) < 5.0
  # Float noise of 5e-8 of the largest entry (the MHA key bias's level) in
  # place of zero: over atol (1e-6) and any rtol of zero, but not over the
  # noise floor.
  noise = tf.constant(rng.choice([-1.0, 1.0], (4, 3)) * 5e-8 * largest,
                      tf.float32)
  check = lambda r: pxg_testing.check_per_example_gradients(
      loss, model, variables, x, labels, reference=r)
  assert check([ref[0], ref[1], ref[2] + noise]) <= 1e-4
  with pytest.raises(AssertionError, match="small"):
    check([ref[0], ref[1] * 1.01, ref[2]])


class _ZeroRule(tf_pxg.rules.base.Rule):
  """Per-example gradients and weighted sums of zero (a "lost" variable)."""

  def per_example(self, ctx):
    return 0.0 * tf_pxg.rules.base.vectorized_per_example(ctx)

  def weighted_sum(self, ctx, c):
    return 0.0 * super().weighted_sum(ctx, c)


def _wrong(form):
  return _ZeroRule() if form == "zero" else _WrongRule(form)


@pytest.mark.parametrize("wrong,message", [
    ("weighted_sum", "clipped_gradient_sum"),
    ("per_example", "sum_b per_example_gradient"),
    ("zero", "all zero"),
])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_invariants_report_a_wrong_rule(wrong, message, mode):
  rng = np.random.default_rng(0)
  w = _var(rng, (3,), F32, "w")
  x = _normal(rng, (4, 3), F32)
  labels = _normal(rng, (4, 3), F32)
  fn = lambda inp: tf.math.squared_difference(inp, w)
  pxg_testing.check_gradient_invariants(_loss, fn, [w], x, labels, mode=mode)
  with without_rule("SquaredDifference"):
    tf_pxg.register("SquaredDifference")(_wrong(wrong))
    try:
      with pytest.raises(AssertionError, match=message):
        pxg_testing.check_gradient_invariants(_loss, fn, [w], x, labels,
                                              mode=mode)
    finally:
      registry.unregister("SquaredDifference")
