"""The model zoo: Keras models written as the keras.io examples write them.

Each model is built by a factory the way a user copies it from keras.io
(Sequential without an Input, numpy arrays, string losses, default RNNs with
`unroll=False`, lazily built layers), once as a plain Keras model and once as
a DP model (`DPSequential`, `DPModel`, `make_dp_model_class`), with the same
seed and so the same initial weights.

Deterministic models: ONE `fit` step with `noise_multiplier=0`,
`SGD(learning_rate=1)` and a clip below every example's gradient norm must
give `w - mean_b (C / ||g_b||) g_b`, the `g_b` coming from a plain
`tf.GradientTape` loop over single examples of the plain twin (its
`compute_loss` on a batch of one), to 1e-4 of the update size, in eager
(`run_eagerly=True`), `tf.function` and `jit_compile=True`. They also pass
`tf_pxg.testing.check_gradient_invariants` (no clip: the clipped sum equals
the plain gradient; no non-zero gradient gets a zero per-example one), and
no op takes the vectorized fallback unless the model declares it (today only
Conv3DTranspose's `Conv3DBackpropInputV2`, which has no rule).

Stochastic models (Dropout, augmentation) must train with noise and stay
finite, in the three modes.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import testing as pxg_testing

from _keras_models import MinimalRNNCell

L = keras.layers
B = 4  # examples per batch
MODES = ("eager", "function", "jit")
VOCAB, SEQ = 30, 6


# How users build models ------------------------------------------------------


def sequential(make_layers, build_shape=None):
  """`keras.Sequential(make_layers())` / `DPSequential(...)`."""

  def build(dp):
    layers = make_layers()
    model = (keras.Sequential(layers) if dp is None else
             dpk.DPSequential(layers, **dp))
    if build_shape is not None:
      model.build(build_shape)
    return model

  return build


def functional(make_graph, after=None):
  """`keras.Model(inputs, outputs)` / `DPModel(inputs, outputs, ...)`."""

  def build(dp):
    inputs, outputs = make_graph()
    model = (keras.Model(inputs, outputs) if dp is None else
             dpk.DPModel(inputs, outputs, **dp))
    if after is not None:
      after(model)
    return model

  return build


def subclassed(cls, **kwargs):
  """`cls(**kwargs)` / `make_dp_model_class(cls)(**kwargs, **dp)`."""

  def build(dp):
    if dp is None:
      return cls(**kwargs)
    return dpk.make_dp_model_class(cls)(**kwargs, **dp)

  return build


# Data (numpy, as keras.io feeds it) -----------------------------------------


def images(shape, classes=3):
  def data(rng):
    return (rng.standard_normal((B, *shape)).astype("float32"),
            rng.integers(0, classes, size=B))
  return data


def tokens(classes=2, binary=False, padded=False):
  """Token ids `[B, SEQ]`; `padded`: zero padding, a different length each."""
  def data(rng):
    x = rng.integers(1, VOCAB, size=(B, SEQ))
    if padded:
      for b, n in enumerate([SEQ, 2, 4, 3][:B]):
        x[b, n:] = 0
    y = (rng.integers(0, 2, size=(B, 1)).astype("float32") if binary else
         rng.integers(0, classes, size=B))
    return x, y
  return data


def sequences(shape, units):
  def data(rng):
    return (rng.standard_normal((B, *shape)).astype("float32"),
            rng.standard_normal((B, units)).astype("float32"))
  return data


# Custom layers and models as keras.io writes them ---------------------------


class Linear(L.Layer):
  """keras.io "Making new layers and models via subclassing"."""

  def __init__(self, units=4, **kwargs):
    super().__init__(**kwargs)
    self.units = units

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1], self.units),
                             initializer="random_normal", trainable=True)
    self.b = self.add_weight(shape=(self.units,), initializer="random_normal",
                             trainable=True)

  def call(self, inputs):
    return keras.ops.matmul(inputs, self.w) + self.b


class TokenAndPositionEmbedding(L.Layer):
  """keras.io "Text classification with Transformer"."""

  def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
    super().__init__(**kwargs)
    self.token_emb = L.Embedding(input_dim=vocab_size, output_dim=embed_dim)
    self.pos_emb = L.Embedding(input_dim=maxlen, output_dim=embed_dim)

  def call(self, x):
    maxlen = keras.ops.shape(x)[-1]
    positions = keras.ops.arange(start=0, stop=maxlen, step=1)
    return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(L.Layer):
  """keras.io "Text classification with Transformer" (dropout as given)."""

  def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
    super().__init__(**kwargs)
    self.att = L.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
    self.ffn = keras.Sequential([L.Dense(ff_dim, activation="relu"),
                                 L.Dense(embed_dim)])
    self.layernorm1 = L.LayerNormalization(epsilon=1e-6)
    self.layernorm2 = L.LayerNormalization(epsilon=1e-6)
    self.dropout1 = L.Dropout(rate)
    self.dropout2 = L.Dropout(rate)

  def call(self, inputs):
    attn_output = self.att(inputs, inputs)
    attn_output = self.dropout1(attn_output)
    out1 = self.layernorm1(inputs + attn_output)
    ffn_output = self.ffn(out1)
    ffn_output = self.dropout2(ffn_output)
    return self.layernorm2(out1 + ffn_output)


class MLP(keras.Model):
  """A subclassed model (keras.io "The Model class")."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense1 = L.Dense(8, activation="relu")
    self.dense2 = L.Dense(3, activation="softmax")

  def call(self, inputs):
    return self.dense2(self.dense1(inputs))


# Functional graphs ----------------------------------------------------------


def _transformer(rate):
  def graph():
    inputs = L.Input(shape=(SEQ,))
    x = TokenAndPositionEmbedding(SEQ, VOCAB, 8)(inputs)
    x = TransformerBlock(8, 2, 8, rate)(x)
    x = L.GlobalAveragePooling1D()(x)
    outputs = L.Dense(2, activation="softmax")(x)
    return inputs, outputs
  return graph


def _resnet():
  inputs = keras.Input(shape=(6, 6, 3))
  x = L.Conv2D(8, 3, padding="same")(inputs)
  x = L.GroupNormalization(groups=4)(x)
  x = L.Activation("relu")(x)
  previous = x
  for _ in range(2):
    x = L.Conv2D(8, 3, padding="same")(x)
    x = L.GroupNormalization(groups=4)(x)
    x = L.Activation("relu")(x)
    x = L.add([x, previous])
    previous = x
  x = L.GlobalAveragePooling2D()(x)
  return inputs, L.Dense(3, activation="softmax")(x)


def _two_inputs():
  text = keras.Input(shape=(SEQ,), name="text")
  meta = keras.Input(shape=(3,), name="meta")
  t = L.Embedding(VOCAB, 6)(text)
  t = L.GRU(4)(t)
  m = L.Dense(4, activation="relu")(meta)
  x = L.concatenate([t, m])
  return [text, meta], L.Dense(2, activation="softmax")(x)


def _two_input_data(rng):
  x, y = tokens()(rng)
  return [x, rng.standard_normal((B, 3)).astype("float32")], y


def _dict_inputs():
  a = keras.Input(shape=(4,), name="a")
  b = keras.Input(shape=(2,), name="b")
  x = L.concatenate([L.Dense(3)(a), b])
  return {"a": a, "b": b}, L.Dense(1)(x)


def _dict_data(rng):
  return ({"a": rng.standard_normal((B, 4)).astype("float32"),
           "b": rng.standard_normal((B, 2)).astype("float32")},
          rng.standard_normal((B, 1)).astype("float32"))


def _frozen_base():
  """keras.io "Transfer learning": a frozen base called with training=False,
  BatchNormalization inside it, and a new trainable head."""
  base = keras.Sequential([keras.Input((6, 6, 3)), L.Conv2D(4, 3),
                           L.BatchNormalization(), L.Activation("relu")])
  base.trainable = False
  inputs = keras.Input(shape=(6, 6, 3))
  x = base(inputs, training=False)
  x = L.GlobalAveragePooling2D()(x)
  return inputs, L.Dense(3, activation="softmax")(x)


def _nested():
  inner_seq = keras.Sequential([L.Dense(6, activation="relu"), L.Dense(5)])
  i = keras.Input((5,))
  inner_fn = keras.Model(i, L.Dense(4, activation="tanh")(i))
  inputs = keras.Input((4,))
  x = inner_seq(inputs)
  x = inner_fn(x)
  return inputs, L.Dense(3, activation="softmax")(x)


def _enable_lora(model):
  model.layers[0].enable_lora(2)
  model.layers[1].enable_lora(2)


def _normalized_features():
  """keras.io structured data: an adapted Normalization layer."""
  norm = L.Normalization()
  norm.adapt(np.random.default_rng(7).standard_normal((32, 5)) * 3 + 1)
  inputs = keras.Input((5,))
  x = norm(inputs)
  x = L.Dense(6, activation="relu")(x)
  return inputs, L.Dense(1)(x)


def _one_hot_categories():
  """Integer categories through IntegerLookup + CategoryEncoding."""
  inputs = keras.Input(shape=(1,), dtype="int64")
  lookup = L.IntegerLookup(vocabulary=[3, 5, 7, 9], output_mode="one_hot")
  x = lookup(inputs)
  x = L.Dense(4, activation="relu")(x)
  return inputs, L.Dense(1, activation="sigmoid")(x)


def _categories(rng):
  return (rng.choice([3, 5, 7, 9, 11], size=(B, 1)).astype("int64"),
          rng.integers(0, 2, size=(B, 1)).astype("float32"))


def _bf16_mlp():
  old = keras.config.dtype_policy()
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    layers = [L.Dense(8, activation="relu"),
              L.Dense(3, activation="softmax", dtype="float32")]
  finally:
    keras.config.set_dtype_policy(old)
  return layers


def _attention_layers():
  """Luong (dot) and Bahdanau (additive) attention, both with a scale."""
  query = keras.Input((4, 3))
  value = keras.Input((5, 3))
  a = L.Attention(use_scale=True)([query, value])
  b = L.AdditiveAttention(use_scale=True)([query, value])
  x = L.GlobalAveragePooling1D()(L.concatenate([a, b]))
  return [query, value], L.Dense(2, activation="softmax")(x)


def _attention_data(rng):
  return ([rng.standard_normal((B, 4, 3)).astype("float32"),
           rng.standard_normal((B, 5, 3)).astype("float32")],
          rng.integers(0, 2, size=B))


def _group_query_attention():
  inputs = keras.Input((5, 6))
  x = L.GroupQueryAttention(head_dim=4, num_query_heads=2,
                            num_key_value_heads=1)(inputs, inputs)
  x = L.GlobalAveragePooling1D()(x)
  return inputs, L.Dense(3, activation="softmax")(x)


def _tied_reversible_embedding():
  """Input and output embeddings tied (keras_hub-style language models)."""
  inputs = keras.Input((SEQ,))
  embedding = L.ReversibleEmbedding(VOCAB, 8)
  x = L.GlobalAveragePooling1D()(embedding(inputs))
  logits = embedding(x, reverse=True)
  return inputs, L.Softmax()(logits)


# The zoo ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Zoo:
  """A zoo model.

  Attributes:
    name: test id.
    build: `build(dp)`: the plain model (dp None) or the DP one with DP
      keyword arguments `dp`.
    data: `data(rng) -> (x, y)` numpy arrays (nests for several inputs).
    loss: the `compile` loss, as a keras.io example passes it.
    deterministic: False for models with random layers in training.
    sample_weight: pass per-example sample weights to `fit`.
    tolerance: error bound in units of the update size.
    fallback: op types expected to take the vectorized fallback (no rule);
      any other op that does fails the invariants test.
  """
  name: str
  build: Callable
  data: Callable
  loss: object = "sparse_categorical_crossentropy"
  deterministic: bool = True
  sample_weight: bool = False
  tolerance: float = 1e-4
  fallback: tuple = ()


SCE = "sparse_categorical_crossentropy"
ZOO = [
    Zoo("mlp_unbuilt_sequential", sequential(lambda: [
        L.Flatten(), L.Dense(16, activation="relu"),
        L.Dense(3, activation="softmax")]), images((4, 4))),
    Zoo("mlp_input_sequential_mse", sequential(lambda: [
        keras.Input((5,)), L.Dense(8, activation="relu"), L.Dense(1)]),
        sequences((5,), 1), loss="mse"),
    Zoo("mnist_convnet", sequential(lambda: [
        keras.Input((8, 8, 1)), L.Conv2D(4, 3, activation="relu"),
        L.MaxPooling2D(2), L.Flatten(), L.Dense(3, activation="softmax")]),
        images((8, 8, 1))),
    Zoo("text_embedding_lstm", sequential(lambda: [
        L.Embedding(VOCAB, 8), L.LSTM(6), L.Dense(1, activation="sigmoid")]),
        tokens(binary=True), loss="binary_crossentropy"),
    Zoo("text_embedding_gru", sequential(lambda: [
        L.Embedding(VOCAB, 8), L.GRU(6), L.Dense(2, activation="softmax")]),
        tokens()),
    Zoo("text_embedding_simple_rnn", sequential(lambda: [
        L.Embedding(VOCAB, 8), L.SimpleRNN(5),
        L.Dense(2, activation="softmax")]), tokens()),
    Zoo("text_bidirectional_lstm", sequential(lambda: [
        L.Embedding(VOCAB, 8), L.Bidirectional(L.LSTM(4,
                                                      return_sequences=True)),
        L.Bidirectional(L.LSTM(4)), L.Dense(1, activation="sigmoid")]),
        tokens(binary=True), loss="binary_crossentropy"),
    # The item 3: built with a float input spec, tokens are cast.
    Zoo("text_conv1d_built_float_spec", sequential(lambda: [
        L.Embedding(VOCAB, 8), L.Conv1D(8, 3, activation="relu"),
        L.GlobalMaxPooling1D(), L.Dense(2, activation="softmax")],
        build_shape=(None, SEQ)), tokens()),
    Zoo("text_fasttext_pooling", sequential(lambda: [
        L.Embedding(VOCAB, 8), L.GlobalAveragePooling1D(),
        L.Dense(2, activation="softmax")]), tokens()),
    Zoo("masked_lstm_classifier", sequential(lambda: [
        L.Embedding(VOCAB, 8, mask_zero=True), L.LSTM(6),
        L.Dense(2, activation="softmax")]), tokens(padded=True)),
    Zoo("masked_gru_sequence_labelling", sequential(lambda: [
        L.Embedding(VOCAB, 8, mask_zero=True),
        L.GRU(5, return_sequences=True),
        L.TimeDistributed(L.Dense(3, activation="softmax"))]),
        lambda rng: (tokens(padded=True)(rng)[0],
                     rng.integers(0, 3, size=(B, SEQ)))),
    Zoo("gru_go_backwards_sequences", sequential(lambda: [
        keras.Input((5, 3)), L.GRU(4, go_backwards=True,
                                   return_sequences=True),
        L.GlobalAveragePooling1D(), L.Dense(2)]), sequences((5, 3), 2),
        loss="mse"),
    Zoo("rnn_custom_cell", sequential(lambda: [
        keras.Input((5, 3)), L.RNN(MinimalRNNCell(4)), L.Dense(2)]),
        sequences((5, 3), 2), loss="mse"),
    Zoo("time_distributed_conv_gru", sequential(lambda: [
        keras.Input((3, 5, 5, 1)), L.TimeDistributed(L.Conv2D(2, 3)),
        L.TimeDistributed(L.GlobalAveragePooling2D()), L.GRU(4),
        L.Dense(3, activation="softmax")]), images((3, 5, 5, 1))),
    Zoo("conv_lstm2d", sequential(lambda: [
        keras.Input((3, 5, 5, 1)), L.ConvLSTM2D(2, 3), L.Flatten(),
        L.Dense(3, activation="softmax")]), images((3, 5, 5, 1))),
    Zoo("conv_lstm1d", sequential(lambda: [
        keras.Input((3, 5, 1)), L.ConvLSTM1D(2, 3), L.Flatten(),
        L.Dense(3, activation="softmax")]), images((3, 5, 1))),
    Zoo("small_resnet_groupnorm_add", functional(_resnet), images((6, 6, 3))),
    Zoo("separable_conv", sequential(lambda: [
        keras.Input((6, 6, 2)), L.SeparableConv2D(4, 3, activation="relu"),
        L.GlobalAveragePooling2D(), L.Dense(3, activation="softmax")]),
        images((6, 6, 2))),
    Zoo("depthwise_conv", sequential(lambda: [
        keras.Input((6, 6, 2)), L.DepthwiseConv2D(3, depth_multiplier=2),
        L.Conv2D(4, 1), L.GlobalMaxPooling2D(),
        L.Dense(3, activation="softmax")]), images((6, 6, 2))),
    Zoo("conv3d_volumes", sequential(lambda: [
        keras.Input((4, 4, 4, 1)), L.Conv3D(2, 2, activation="relu"),
        L.MaxPooling3D(2), L.GlobalAveragePooling3D(),
        L.Dense(3, activation="softmax")]), images((4, 4, 4, 1))),
    Zoo("conv_transpose_autoencoder", sequential(lambda: [
        keras.Input((6, 6, 1)),
        L.Conv2D(4, 3, strides=2, padding="same", activation="relu"),
        L.Conv2DTranspose(4, 3, strides=2, padding="same", activation="relu"),
        L.Conv2D(1, 3, padding="same")]),
        lambda rng: (lambda x: (x, x))(
            rng.standard_normal((B, 6, 6, 1)).astype("float32")),
        loss="mse"),
    Zoo("causal_dilated_conv1d", sequential(lambda: [
        keras.Input((8, 2)),
        L.Conv1D(4, 2, dilation_rate=2, padding="causal", activation="relu"),
        L.Flatten(), L.Dense(1)]), sequences((8, 2), 1), loss="mse"),
    Zoo("transformer_block", functional(_transformer(0.0)), tokens()),
    Zoo("two_input_functional", functional(_two_inputs), _two_input_data),
    Zoo("dict_inputs", functional(_dict_inputs), _dict_data, loss="mse"),
    Zoo("frozen_base_new_head", functional(_frozen_base), images((6, 6, 3))),
    Zoo("nested_models", functional(_nested), images((4,))),
    Zoo("lora_dense", sequential(lambda: [
        keras.Input((5,)), L.Dense(6, activation="relu"), L.Dense(3)],
    ), sequences((5,), 3), loss="mse"),
    Zoo("custom_layer_add_weight", sequential(lambda: [
        keras.Input((5,)), Linear(4), L.Activation("tanh"), Linear(2)]),
        sequences((5,), 2), loss="mse"),
    Zoo("subclassed_model", subclassed(MLP), images((5,))),
    Zoo("sample_weight_mlp", sequential(lambda: [
        L.Dense(6, activation="relu"), L.Dense(3, activation="softmax")]),
        images((5,)), sample_weight=True),
    Zoo("normalization_preprocessing", functional(_normalized_features),
        sequences((5,), 1), loss="mse"),
    Zoo("integer_lookup_one_hot", functional(_one_hot_categories),
        _categories, loss="binary_crossentropy"),
    Zoo("layer_normalization_mlp", sequential(lambda: [
        L.Dense(6), L.LayerNormalization(), L.Activation("gelu"),
        L.Dense(3, activation="softmax")]), images((5,))),
    Zoo("attention_additive_attention", functional(_attention_layers),
        _attention_data),
    Zoo("group_query_attention", functional(_group_query_attention),
        images((5, 6))),
    Zoo("conv1d_transpose", sequential(lambda: [
        keras.Input((6, 2)), L.Conv1DTranspose(3, 3, strides=2),
        L.Flatten(), L.Dense(3, activation="softmax")]), images((6, 2))),
    Zoo("conv3d_transpose", sequential(lambda: [
        keras.Input((2, 2, 2, 1)), L.Conv3DTranspose(2, 2, strides=2),
        L.Flatten(), L.Dense(3, activation="softmax")]),
        images((2, 2, 2, 1)), fallback=("Conv3DBackpropInputV2",)),
    Zoo("separable_depthwise_conv1d", sequential(lambda: [
        keras.Input((8, 2)), L.SeparableConv1D(4, 3, activation="relu"),
        L.DepthwiseConv1D(3), L.GlobalAveragePooling1D(),
        L.Dense(3, activation="softmax")]), images((8, 2))),
    Zoo("prelu_rms_normalization", sequential(lambda: [
        L.Dense(6), L.PReLU(), L.RMSNormalization(),
        L.Dense(3, activation="softmax")]), images((5,))),
    Zoo("stacked_rnn_cells", sequential(lambda: [
        keras.Input((5, 3)),
        L.RNN(L.StackedRNNCells([L.LSTMCell(4), L.GRUCell(3)])),
        L.Dense(2)]), sequences((5, 3), 2), loss="mse"),
    Zoo("tied_reversible_embedding", functional(_tied_reversible_embedding),
        tokens(classes=VOCAB)),
    # bfloat16 compute: compared to the bfloat16 twin at bfloat16 precision.
    Zoo("mixed_bfloat16_mlp", sequential(_bf16_mlp), images((5,)),
        tolerance=1e-2),
    # Stochastic in training: they must train and stay finite.
    Zoo("dropout_mlp", sequential(lambda: [
        L.Dense(8, activation="relu"), L.Dropout(0.5),
        L.Dense(3, activation="softmax")]), images((5,)), deterministic=False),
    Zoo("augmentation_cnn", sequential(lambda: [
        keras.Input((8, 8, 3)), L.RandomFlip("horizontal"),
        L.RandomRotation(0.1), L.Conv2D(4, 3, activation="relu"),
        L.GlobalAveragePooling2D(), L.Dense(3, activation="softmax")]),
        images((8, 8, 3)), deterministic=False),
    Zoo("transformer_block_dropout", functional(_transformer(0.1)), tokens(),
        deterministic=False),
    # Power iteration updates its (non-trainable) vector at every call.
    Zoo("spectral_normalization", sequential(lambda: [
        L.SpectralNormalization(L.Dense(6)), L.Activation("relu"),
        L.Dense(3, activation="softmax")]), images((5,)),
        deterministic=False),
    Zoo("gaussian_noise_mlp", sequential(lambda: [
        L.GaussianNoise(0.1), L.Dense(6, activation="relu"),
        L.Dense(3, activation="softmax")]), images((5,)),
        deterministic=False),
]
_ZOO = {z.name: z for z in ZOO}
assert len(_ZOO) == len(ZOO), "duplicate zoo names"


def _lora_builder(inner):
  def build(dp):
    model = inner(dp)
    _enable_lora(model)
    # lora_kernel_b starts at zero (so lora_kernel_a's gradient would be 0):
    # give it values, as after some training.
    for layer in model.layers[:2]:
      b = layer.lora_kernel_b
      b.assign((np.random.default_rng(3).standard_normal(b.shape) *
                0.5).astype("float32"))
    return model
  return build


_ZOO["lora_dense"] = dataclasses.replace(
    _ZOO["lora_dense"], build=_lora_builder(_ZOO["lora_dense"].build))
ZOO = list(_ZOO.values())


# Layers newer than the lowest supported Keras (README "Supported
# versions"): their models are skipped where Keras lacks them.
_NEEDS_LAYER = {"prelu_rms_normalization": "RMSNormalization",
                "tied_reversible_embedding": "ReversibleEmbedding"}


def _make(zoo: Zoo, dp=None):
  layer = _NEEDS_LAYER.get(zoo.name)
  if layer and not hasattr(keras.layers, layer):
    pytest.skip(f"Keras {keras.version()} has no keras.layers.{layer}")
  keras.utils.set_random_seed(1234)
  return zoo.build(dp)


def _data(zoo: Zoo):
  rng = np.random.default_rng(len(zoo.name))
  x, y = zoo.data(rng)
  sw = (np.linspace(0.5, 2.0, B).astype("float32") if zoo.sample_weight else
        None)
  return x, y, sw


def _slice(nest, b):
  return tf.nest.map_structure(lambda t: t[b:b + 1], nest)


_REFERENCE = {}


def _reference(zoo: Zoo):
  """(plain twin, w0, per-example gradients: one `[B, *shape]` per weight)."""
  if zoo.name in _REFERENCE:
    return _REFERENCE[zoo.name]
  x, y, sw = _data(zoo)
  twin = _make(zoo)
  twin.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0),
               loss=zoo.loss)
  twin(x)  # builds a lazily built model
  variables = twin.trainable_variables
  per_example = []
  for b in range(B):
    xb, yb = _slice(x, b), _slice(y, b)
    with tf.GradientTape() as tape:
      y_pred = twin(xb, training=True)
      loss = twin.compute_loss(
          x=xb, y=yb, y_pred=y_pred,
          sample_weight=None if sw is None else sw[b:b + 1])
    grads = tape.gradient(loss, variables)
    per_example.append([np.zeros(v.shape) if g is None else
                        np.asarray(tf.convert_to_tensor(g), np.float64)
                        for g, v in zip(grads, variables)])
  w0 = [np.asarray(v.numpy(), np.float64) for v in variables]
  per_example = [np.stack([gb[i] for gb in per_example])
                 for i in range(len(variables))]
  _REFERENCE[zoo.name] = (twin, w0, per_example)
  return _REFERENCE[zoo.name]


class _InitialWeights(keras.callbacks.Callback):
  """The trainable weights just before the first step (after a lazy build)."""

  def on_train_batch_begin(self, batch, logs=None):
    if batch == 0 and not hasattr(self, "weights"):
      self.weights = [np.asarray(v.numpy(), np.float64)
                      for v in self.model.trainable_variables]


def _fixed_batches(model) -> dict:
  """`fit` kwargs for Keras' own fixed batches (the exact check needs the
  batch as given; a DP `fit` that Poisson-samples by default takes
  `sampling="shuffled"` for that)."""
  if "sampling" in inspect.signature(model.fit).parameters:
    return {"sampling": "shuffled"}
  return {}


def _compile(model, zoo: Zoo, mode: str, optimizer):
  model.compile(optimizer=optimizer, loss=zoo.loss,
                run_eagerly=mode == "eager", jit_compile=mode == "jit")


DETERMINISTIC = [z.name for z in ZOO if z.deterministic]
STOCHASTIC = [z.name for z in ZOO if not z.deterministic]


def test_zoo_size_and_coverage():
  assert len(ZOO) >= 30, len(ZOO)
  assert len(DETERMINISTIC) >= 30, len(DETERMINISTIC)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_one_fit_step_equals_clipped_reference(name, mode):
  zoo = _ZOO[name]
  x, y, sw = _data(zoo)
  _, w0, per_example = _reference(zoo)
  norms = pxg_testing.per_example_global_norms(per_example)
  assert np.all(norms > 0), f"{name}: an example has a zero gradient {norms}"
  clip = 0.5 * float(norms.min())  # active for every example
  expected = pxg_testing.expected_dp_sgd_weights(w0, per_example, clip)
  size = max(float(np.max(np.abs(e - w))) for e, w in zip(expected, w0)
             if w.size)

  model = _make(zoo, dict(l2_norm_clip=clip, noise_multiplier=0.0))
  _compile(model, zoo, mode, keras.optimizers.SGD(learning_rate=1.0))
  initial = _InitialWeights()
  model.fit(x, y, sample_weight=sw, batch_size=B, epochs=1, shuffle=False,
            verbose=0, callbacks=[initial], **_fixed_batches(model))
  got = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
  assert len(got) == len(w0), (len(got), len(w0))
  for i, (a, b) in enumerate(zip(initial.weights, w0)):
    np.testing.assert_array_equal(a, b, err_msg=f"initial weights {i}")
  # One tolerance relative to the largest update over all the variables
  # (bfloat16 models need more than 1e-4), not per variable as
  # `pxg_testing.assert_dp_step_matches_reference` checks.
  errors = [float(np.max(np.abs(g - e))) / size if g.size else 0.0
            for g, e in zip(got, expected)]
  worst = int(np.argmax(errors))
  assert max(errors) <= zoo.tolerance, (
      f"{name} ({mode}): the DP step is off by {max(errors):.3g} of the "
      f"update size {size:.3g} at variable {worst} "
      f"({model.trainable_variables[worst].path}); tolerance "
      f"{zoo.tolerance:g}. Errors per variable: "
      f"{[f'{e:.2g}' for e in errors]}")


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_gradient_invariants(name):
  zoo = _ZOO[name]
  # bfloat16 compute: tf_pxg's backward pass and TF's round differently.
  tolerance = {} if zoo.tolerance <= 1e-4 else dict(rtol=zoo.tolerance,
                                                    atol=1e-4)
  twin, _, _ = _reference(zoo)
  x, y, sw = _data(zoo)

  def losses(labels, y_pred):
    y, sw = labels if zoo.sample_weight else (labels, None)
    return dpk.per_example_losses(twin, y, y_pred, sw)

  with pxg_testing.trace_rules() as records:
    pxg_testing.check_gradient_invariants(
        losses, twin, twin.trainable_variables, x,
        (y, sw) if zoo.sample_weight else y, mode="function", training=True,
        **tolerance)
  fallback = {r["op_type"] for r in records
              if r["rule"] == "_VectorizedFallback" or
              r.get("per_example") == "vectorized"}
  assert fallback == set(zoo.fallback), (
      f"{name}: ops on the vectorized fallback {sorted(fallback)}, "
      f"expected {sorted(zoo.fallback)}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", STOCHASTIC)
def test_stochastic_model_trains_and_stays_finite(name, mode):
  zoo = _ZOO[name]
  x, y, _ = _data(zoo)
  model = _make(zoo, dict(l2_norm_clip=1.0, noise_multiplier=1.0))
  _compile(model, zoo, mode, "adam")
  initial = _InitialWeights()
  history = model.fit(np.concatenate([x, x]), np.concatenate([y, y]),
                      batch_size=B, epochs=1, verbose=0, callbacks=[initial],
                      unprotected_training_metrics=True)
  assert int(model.optimizer.iterations) == 2
  assert np.all(np.isfinite(history.history["unprotected_loss"]))
  assert "dp_skipped_steps" not in history.history
  for w, v in zip(initial.weights, model.trainable_variables):
    now = v.numpy()
    assert np.all(np.isfinite(now)), v.path
    assert np.any(now != w), f"{v.path} did not move"


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop", "sgd"])
def test_unbuilt_sequential_with_string_optimizer_trains(optimizer):
  """The issue's item 1: `compile(optimizer="adam")` on an unbuilt model."""
  zoo = _ZOO["mlp_unbuilt_sequential"]
  x, y, _ = _data(zoo)
  model = _make(zoo, dict(l2_norm_clip=1.0, noise_multiplier=0.5))
  model.compile(optimizer=optimizer, loss=zoo.loss, metrics=["accuracy"])
  history = model.fit(x, y, epochs=2, batch_size=2, verbose=0,
                      unprotected_training_metrics=True)
  assert int(model.optimizer.iterations) == 4
  assert np.all(np.isfinite(history.history["unprotected_loss"]))


def test_mixed_precision_policy_restored():
  assert keras.config.dtype_policy().name == "float32"
