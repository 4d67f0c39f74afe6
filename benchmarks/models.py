"""The benchmark models, buildable with Keras 3 or with tf_keras.

Each builder takes the Keras package to use (`keras` for Keras 3, `tf_keras`
for TensorFlow Privacy) and a size (`batch` for the batch-size series,
`seq_len` for sequence models), so the two frameworks train the same
architecture on the same batch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Tuple

import numpy as np

VOCAB_EMBED = 20_000
VOCAB_TRANSFORMER = 1_000
CLASSES = 10


def mlp(k, seq_len=None):
  """MLP 784-512-512-10."""
  del seq_len
  return k.Sequential([
      k.Input((784,)),
      k.layers.Dense(512, activation="relu"),
      k.layers.Dense(512, activation="relu"),
      k.layers.Dense(CLASSES),
  ])


def cnn(k, seq_len=None):
  """Conv2D 16 5x5 s2 -> Conv2D 32 4x4 s2 -> Dense 32 -> Dense 10, 28x28x1."""
  del seq_len
  return k.Sequential([
      k.Input((28, 28, 1)),
      k.layers.Conv2D(16, 5, strides=2, activation="relu"),
      k.layers.Conv2D(32, 4, strides=2, activation="relu"),
      k.layers.Flatten(),
      k.layers.Dense(32, activation="relu"),
      k.layers.Dense(CLASSES),
  ])


def embed(k, seq_len=32):
  """Embedding 20000x64 over `seq_len` tokens -> mean -> Dense 10."""
  return k.Sequential([
      k.Input((seq_len,), dtype="int32"),
      k.layers.Embedding(VOCAB_EMBED, 64),
      k.layers.GlobalAveragePooling1D(),
      k.layers.Dense(CLASSES),
  ])


def transformer(k, seq_len=128):
  """One post-LN encoder block, d=64, 4 heads, FFN 128, mean-pooled."""
  inp = k.Input((seq_len,), dtype="int32")
  h = k.layers.Embedding(VOCAB_TRANSFORMER, 64)(inp)
  a = k.layers.MultiHeadAttention(num_heads=4, key_dim=16)(h, h)
  h = k.layers.LayerNormalization()(k.layers.Add()([h, a]))
  f = k.layers.Dense(128, activation="relu")(h)
  f = k.layers.Dense(64)(f)
  h = k.layers.LayerNormalization()(k.layers.Add()([h, f]))
  h = k.layers.GlobalAveragePooling1D()(h)
  return k.Model(inp, k.layers.Dense(CLASSES)(h))


def lstm(k, seq_len=64):
  """Embedding(20000, 64) -> LSTM(128) (a while loop) -> Dense 2."""
  return k.Sequential([
      k.Input((seq_len,), dtype="int32"),
      k.layers.Embedding(VOCAB_EMBED, 64),
      k.layers.LSTM(128),
      k.layers.Dense(2),
  ])


@dataclasses.dataclass(frozen=True)
class Spec:
  """A benchmark model: builder, default batch, input kind and length."""
  build: Callable
  batch: int
  input_shape: Callable[[int], Tuple[int, ...]]  # seq_len -> example shape
  vocab: int = 0  # > 0: integer token inputs below vocab
  seq_len: int = 0
  classes: int = CLASSES


SPECS = {
    "mlp": Spec(mlp, 256, lambda t: (784,)),
    "cnn": Spec(cnn, 256, lambda t: (28, 28, 1)),
    "embed": Spec(embed, 256, lambda t: (t,), VOCAB_EMBED, 32),
    "transformer": Spec(transformer, 64, lambda t: (t,), VOCAB_TRANSFORMER,
                        128),
    "lstm": Spec(lstm, 64, lambda t: (t,), VOCAB_EMBED, 64, classes=2),
}


def build(k, name: str, seq_len: int = 0):
  """Builds model `name` with Keras package `k` (seq_len 0: the default)."""
  spec = SPECS[name]
  if spec.seq_len:
    return spec.build(k, seq_len or spec.seq_len)
  return spec.build(k)


def batch(name: str, batch_size: int, seq_len: int = 0, seed: int = 0):
  """A fixed random batch `(x, y)` for model `name` (NumPy arrays)."""
  spec = SPECS[name]
  rng = np.random.default_rng(seed)
  shape = (batch_size, *spec.input_shape(seq_len or spec.seq_len))
  if spec.vocab:
    x = rng.integers(0, spec.vocab, size=shape).astype("int32")
  else:
    x = rng.normal(size=shape).astype("float32")
  y = rng.integers(0, spec.classes, size=(batch_size,)).astype("int32")
  return x, y
