"""The benchmarked training modes: one `fit` step each, on a fixed batch.

Every mode trains one of `benchmarks.models` with SGD(0.01) on sparse
categorical cross-entropy from logits; DP modes use `l2_norm_clip` C = 1 and
`noise_multiplier` sigma = 1.1. `make(mode, model, batch, seq_len)` returns a
`Step`: a no-argument callable running one training step, plus what the mode
reports about itself (e.g. which path TensorFlow Privacy took).

Modes and the non-private mode each is compared with (`BASELINE`):

| mode | what | baseline |
|---|---|---|
| keras / keras_xla | Keras 3 `fit` step, without / with XLA | |
| keras_tfconv | Keras 3 `fit` step, grouped convs on TF's kernels | |
| pxg / pxg_xla | tf_pxg `make_private` DP model | keras / keras_xla |
| pxg_naive | tf_pxg: per-example gradients materialised, clipped | keras |
| noise | drawing one DP step's noise alone (tf_pxg) | keras |
| tf_keras / tf_keras_xla | tf_keras `fit` step | |
| tfp_dpmodel(_xla) | TF Privacy DPModel, fullest registry | tf_keras(_xla) |
| tfp_optimizer | TF Privacy DPKerasSGDOptimizer | tf_keras |

TensorFlow Privacy modes need the benchmark venv (`benchmarks.venv`).

`keras_tfconv` is a second baseline for models with grouped convolutions
(ConvNeXt's 7x7 depthwise convs are `Conv2D(groups=C)`): on CPU, Keras'
TF backend compiles every grouped convolution with XLA (`_conv_xla` in
`keras/src/backend/tensorflow/nn.py`: "grouped convolutions are broken on
CPU without XLA"), forward and backward, which made Keras' own ConvNeXtTiny
step take 1760 ms against 413 ms with TF's grouped `Conv2D` kernels
(oneDNN; same loss, gradients equal to 1e-6). tf_pxg's DP step inlines
Keras' nested `tf.function`s while its tape records, so it runs TF's
kernels; `ALT_BASELINE` gives its ratio to this mode too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import numpy as np

from benchmarks import models

L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.01

BASELINE = {
    "pxg": "keras",
    "pxg_xla": "keras_xla",
    "pxg_naive": "keras",
    "noise": "keras",
    "tfp_dpmodel": "tf_keras",
    "tfp_dpmodel_xla": "tf_keras_xla",
    "tfp_optimizer": "tf_keras",
}
# A DP mode's ratios to further baselines (`timing.add_ratios`).
ALT_BASELINE = {"pxg": ("keras_tfconv",)}
ALL_MODES = ("keras", "keras_xla", "pxg", "pxg_xla", "pxg_naive", "noise",
             "tf_keras", "tf_keras_xla", "tfp_dpmodel", "tfp_dpmodel_xla",
             "tfp_optimizer")
TFP_MODES = frozenset({"tf_keras", "tf_keras_xla", "tfp_dpmodel",
                       "tfp_dpmodel_xla", "tfp_optimizer"})


@dataclasses.dataclass
class Step:
  """One training step of a mode: `fn()` runs it; `info` describes it
  (JSON-able); `model` is the model it trains (None for "noise")."""
  fn: Callable[[], object]
  info: Dict[str, object] = dataclasses.field(default_factory=dict)
  model: object = None


def sync(result) -> None:
  """Waits for a step's outputs (TF runs ops asynchronously)."""
  import tensorflow as tf  # noqa: PLC0415
  for t in tf.nest.flatten(result):
    if hasattr(t, "numpy"):
      t.numpy()


def _iterator(x, y):
  import tensorflow as tf  # noqa: PLC0415
  return iter(tf.data.Dataset.from_tensors((x, y)).repeat())


def _fit_step(model, x, y, k, jit_compile, optimizer=None, loss=None):
  """`model.train_function` on a repeated batch, compiled as `fit` does."""
  model.compile(
      optimizer=optimizer or k.optimizers.SGD(LEARNING_RATE),
      loss=loss or k.losses.SparseCategoricalCrossentropy(from_logits=True),
      jit_compile=jit_compile)
  model.make_train_function()
  iterator = _iterator(x, y)
  return lambda: model.train_function(iterator)


# Keras 3 and tf_pxg.


def _keras(name, x, y, seq_len, jit, size):
  import keras  # noqa: PLC0415
  model = models.build(keras, name, seq_len, size)
  return Step(_fit_step(model, x, y, keras, jit), model=model)


def tf_grouped_conv():
  """A context in which Keras 3's TF backend runs grouped convolutions with
  TF's own kernels (`tf.nn.convolution`) instead of its XLA-compiled
  function; only for the tracing of the step built inside it."""
  import contextlib  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  from keras.src.backend.tensorflow import nn as tf_nn  # noqa: PLC0415

  @contextlib.contextmanager
  def patched():
    original = tf_nn.conv

    def conv(inputs, kernel, strides=1, padding="valid", data_format=None,
             dilation_rate=1):
      channels_last = data_format in (None, "channels_last")
      if not channels_last or inputs.shape[-1] == kernel.shape[-2]:
        return original(inputs, kernel, strides, padding, data_format,
                        dilation_rate)
      return tf.nn.convolution(inputs, kernel, strides, padding.upper(),
                               dilations=dilation_rate)

    tf_nn.conv = conv
    try:
      yield
    finally:
      tf_nn.conv = original

  return patched()


def _keras_tfconv(name, x, y, seq_len, jit, size):
  """Keras 3's step, grouped convolutions on TF's kernels (module doc)."""
  import keras  # noqa: PLC0415
  model = models.build(keras, name, seq_len, size)
  with tf_grouped_conv():
    fn = _fit_step(model, x, y, keras, jit)
    first = fn()  # traces the step while the patch is in place
  return Step(fn, {"path": "grouped convolutions on TF's Conv2D kernels",
                   "first_loss": float(first["loss"])}, model=model)


def _pxg(name, x, y, seq_len, jit, size):
  import keras  # noqa: PLC0415
  import tf_pxg.keras as pxk  # noqa: PLC0415
  model = pxk.make_private(models.build(keras, name, seq_len, size),
                           l2_norm_clip=L2_NORM_CLIP,
                           noise_multiplier=NOISE_MULTIPLIER)
  return Step(_fit_step(model, x, y, keras, jit), model=model)


def _pxg_naive(name, x, y, seq_len, jit, size):
  """Per-example gradients materialised ([B, *w] each), clipped, summed."""
  del jit
  import keras  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  import tf_pxg  # noqa: PLC0415
  from tf_pxg import dp  # noqa: PLC0415
  model = models.build(keras, name, seq_len, size)
  variables = model.trainable_variables
  optimizer = keras.optimizers.SGD(LEARNING_RATE)
  optimizer.build(variables)
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=None)
  generator = dp.make_generator()
  x, y = tf.constant(x), tf.constant(y)

  @tf.function
  def step(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = loss_fn(y, model(x, training=True))
    grads = [tf.convert_to_tensor(g)
             for g in tape.per_example_gradient(losses, variables)]
    b = tf.shape(losses)[0]
    sq = tf.add_n([tf.reduce_sum(tf.square(tf.reshape(g, [b, -1])), 1)
                   for g in grads])
    clip = tf.minimum(1.0, L2_NORM_CLIP / tf.maximum(tf.sqrt(sq), 1e-12))
    sums = [tf.tensordot(clip, g, 1) for g in grads]
    noisy = dp.add_gaussian_noise(sums, NOISE_MULTIPLIER * L2_NORM_CLIP,
                                  generator=generator)
    optimizer.apply([g / tf.cast(b, g.dtype) for g in noisy], variables)
    return tf.reduce_mean(losses)

  return Step(lambda: step(x, y), model=model)


def _noise(name, x, y, seq_len, jit, size):
  """Draws the noise of one DP step of `name` (one Gaussian per weight)."""
  del x, y
  import keras  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  from tf_pxg import dp  # noqa: PLC0415
  shapes = [v.shape for v in models.build(keras, name, seq_len, size)
            .trainable_variables]
  generator = dp.make_generator()

  @tf.function(jit_compile=jit)
  def draw():
    return dp.add_gaussian_noise([tf.zeros(s) for s in shapes],
                                 NOISE_MULTIPLIER * L2_NORM_CLIP,
                                 generator=generator)
  return Step(draw, {"weights": int(sum(np.prod(s) for s in shapes))})


# tf_keras and TensorFlow Privacy 0.9.0 (in the benchmark venv).


def _tf_keras_model(name, seq_len, size):
  import tf_keras  # noqa: PLC0415
  return models.build(tf_keras, name, seq_len, size)


def _tf_keras(name, x, y, seq_len, jit, size):
  import tf_keras  # noqa: PLC0415
  model = _tf_keras_model(name, seq_len, size)
  return Step(_fit_step(model, x, y, tf_keras, jit), model=model)


def fullest_registry():
  """TF Privacy 0.9.0's registry with every layer it has a function for.

  Dense and Embedding (its default registry) plus EinsumDense,
  LayerNormalization and MultiHeadAttention. (Its NLP registry functions are
  for `tensorflow_models` layers, which these models do not use.)
  """
  import importlib  # noqa: PLC0415
  import tf_keras  # noqa: PLC0415
  fgc = "tensorflow_privacy.privacy.fast_gradient_clipping"
  functions = importlib.import_module(f"{fgc}.registry_functions")
  registry = importlib.import_module(
      f"{fgc}.layer_registry").make_default_layer_registry()
  for layer, module, fn in (
      ("EinsumDense", "einsum_dense", "einsum_layer_computation"),
      ("LayerNormalization", "layer_normalization",
       "layer_normalization_computation"),
      ("MultiHeadAttention", "multi_head_attention",
       "multi_head_attention_layer_computation")):
    importlib.import_module(f"{functions.__name__}.{module}")
    registry.insert(getattr(tf_keras.layers, layer),
                    getattr(getattr(functions, module), fn))
  return registry


def _tfp_dpmodel(name, x, y, seq_len, jit, size):
  import tf_keras  # noqa: PLC0415
  from tensorflow_privacy.privacy.keras_models import (  # noqa: PLC0415
      dp_keras_model)
  base = _tf_keras_model(name, seq_len, size)
  model = dp_keras_model.DPModel(
      L2_NORM_CLIP, NOISE_MULTIPLIER, None, jit, fullest_registry(),
      inputs=base.inputs, outputs=base.outputs)
  fast = bool(model._enable_fast_peg_computation)  # pylint: disable=W0212
  info = {"path": "registry fast path" if fast
          else "vectorized fallback (tf.vectorized_map over examples)"}
  # DPModel compiles its own train_step with XLA when use_xla (= jit).
  return Step(_fit_step(model, x, y, tf_keras, False), info, model)


def _tfp_optimizer(name, x, y, seq_len, jit, size):
  import tf_keras  # noqa: PLC0415
  from tensorflow_privacy.privacy.optimizers import (  # noqa: PLC0415
      dp_optimizer_keras)
  optimizer = dp_optimizer_keras.DPKerasSGDOptimizer(
      l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER,
      num_microbatches=None, learning_rate=LEARNING_RATE)
  loss = tf_keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=tf_keras.losses.Reduction.NONE)
  model = _tf_keras_model(name, seq_len, size)
  return Step(_fit_step(model, x, y, tf_keras, jit, optimizer=optimizer,
                        loss=loss),
              {"path": "per-example jacobian (num_microbatches=None)"}, model)


_BUILDERS = {
    "keras": (_keras, False),
    "keras_xla": (_keras, True),
    "keras_tfconv": (_keras_tfconv, False),
    "pxg": (_pxg, False),
    "pxg_xla": (_pxg, True),
    "pxg_naive": (_pxg_naive, False),
    "noise": (_noise, False),
    "tf_keras": (_tf_keras, False),
    "tf_keras_xla": (_tf_keras, True),
    "tfp_dpmodel": (_tfp_dpmodel, False),
    "tfp_dpmodel_xla": (_tfp_dpmodel, True),
    "tfp_optimizer": (_tfp_optimizer, False),
}


def make(mode: str, name: str, batch_size: int,
         seq_len: Optional[int] = None, seed: int = 0,
         size: str = "full") -> Step:
  """Builds mode `mode` for model `name`; the returned step is not yet run.

  `size`: "full", or "tiny" for the smoke test's size of a real model
  (`benchmarks.models.Spec.tiny`).

  Raises:
    KeyError: unknown mode or model.
  """
  import keras  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  builder, jit = _BUILDERS[mode]
  keras.utils.set_random_seed(seed)
  tf.random.set_seed(seed)
  x, y = models.batch(name, batch_size, seq_len or 0, seed, size)
  return builder(name, x, y, seq_len or 0, jit, size)
