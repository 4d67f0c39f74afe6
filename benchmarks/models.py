"""The benchmark models, buildable with Keras 3 or with tf_keras.

Each builder takes the Keras package to use (`keras` for Keras 3, `tf_keras`
for TensorFlow Privacy; Keras 3 on JAX for jax-privacy) and a size (`batch`
for the batch-size series, `seq_len` for sequence models), so the frameworks
train the same architecture on the same batch.

Two groups of models:

* the small models `mlp`, `cnn`, `embed`, `transformer` (and `lstm`), each
  near its limit in earlier rounds;
* the real architectures (issue 22, `REAL_MODELS`), at batch 32:
  `convnext` (`keras.applications.ConvNeXtTiny` at 32x32x3), `wrn_gn`
  (WRN-16-4 with GroupNorm, De et al. 2022), `vit` (a ViT-S/4-style
  encoder at 32x32), `bert` (a BERT-style text encoder, T = 128) and
  `lstm`;
* the fine-tuning models of issue 28 (`FINETUNE_MODELS`), KerasHub
  backbones built from constructor arguments with random weights (no
  preset download), batch 8: `gpt2_ft` (a GPT-2-small-like causal LM, 12
  layers, d = 768, T = 256, its tied token embedding as the LM head; every
  weight trains), `gpt2_lora` (the same with `backbone.enable_lora(4)`:
  only the query and value projections' LoRA factors and biases train) and
  `bert_ft` (a BERT-base-like classifier, 12 layers, d = 768, T = 128,
  Dense 2 on the pooled output; every weight trains). Their `Spec.small`
  is 4 of the 12 layers at d = 768 (GPT-2: with a 16384-token vocabulary,
  which keeps the LM head's share of the FLOPs), for 2-core machines.

Every real model's sizes are keyword arguments of its builder; `Spec.tiny`
holds a tiny size of each (a few channels, short sequences) that builds and
trains in a second, for the smoke test (`build(..., size="tiny")`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Tuple

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


def lstm(k, seq_len=64, vocab=VOCAB_EMBED, dim=64, units=128):
  """Embedding(20000, 64) -> LSTM(128) (a while loop) -> Dense 2."""
  return k.Sequential([
      k.Input((seq_len,), dtype="int32"),
      k.layers.Embedding(vocab, dim),
      k.layers.LSTM(units),
      k.layers.Dense(2),
  ])


# The real architectures (issue 22). Images are 32x32x3, batch 32.

IMAGE = (32, 32, 3)
VOCAB_BERT = 30_000


def convnext(k, seq_len=None, depths=None, dims=None):
  """`ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=10)`.

  With `depths`/`dims` (the tiny size of the smoke test), the same
  `ConvNeXt` builder of the Keras package with other stage depths and
  widths. The classifier returns logits (`classifier_activation=None`), as
  the benchmarks' loss expects; everything else is the application's
  default (its `Normalization` pre-stem included).
  """
  del seq_len
  kwargs = dict(weights=None, input_shape=IMAGE, classes=CLASSES,
                classifier_activation=None)
  if depths is None:
    return k.applications.ConvNeXtTiny(**kwargs)
  import importlib  # noqa: PLC0415
  module = importlib.import_module(f"{k.__name__}.src.applications.convnext")
  return module.ConvNeXt(depths=list(depths), projection_dims=list(dims),
                         default_size=IMAGE[0], **kwargs)


def wrn_gn(k, seq_len=None, widths=(64, 128, 256), stem=16, blocks=2,
           groups=16):
  """WRN-16-4 with GroupNorm, as De et al. 2022 train it with DP.

  Conv 3x3 (16) on 32x32x3, then 3 groups of `blocks` pre-activation wide
  basic blocks (GroupNorm(16 groups), ReLU, Conv 3x3, GroupNorm, ReLU,
  Conv 3x3; a 1x1 conv shortcut where the shape changes), widths 64, 128,
  256, strides 1, 2, 2; GroupNorm, ReLU, global average pool, Dense 10.
  (De et al. also standardise the conv weights; this model does not.)
  """
  del seq_len
  L = k.layers  # noqa: N806
  inp = k.Input(IMAGE)
  h = L.Conv2D(stem, 3, padding="same", use_bias=False)(inp)
  for g, width in enumerate(widths):
    for b in range(blocks):
      stride = 2 if (g > 0 and b == 0) else 1
      a = L.Activation("relu")(L.GroupNormalization(groups)(h))
      r = L.Conv2D(width, 3, strides=stride, padding="same",
                   use_bias=False)(a)
      r = L.Activation("relu")(L.GroupNormalization(groups)(r))
      r = L.Conv2D(width, 3, padding="same", use_bias=False)(r)
      if stride != 1 or h.shape[-1] != width:
        h = L.Conv2D(width, 1, strides=stride, use_bias=False)(a)
      h = L.Add()([h, r])
  h = L.Activation("relu")(L.GroupNormalization(groups)(h))
  h = L.GlobalAveragePooling2D()(h)
  return k.Model(inp, L.Dense(CLASSES)(h))


def _position_embedding(k):
  """A learned position embedding added to `[B, T, d]` (one weight of
  `[T, d]`), for the Keras package `k`."""

  class PositionEmbedding(k.layers.Layer):

    def build(self, input_shape):
      self.position = self.add_weight(
          name="position", shape=tuple(input_shape[1:]),
          initializer=k.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
      return x + self.position

  return PositionEmbedding()


def _pre_ln_block(k, h, heads, dim, mlp):
  L = k.layers  # noqa: N806
  a = L.LayerNormalization(epsilon=1e-6)(h)
  a = L.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(a, a)
  h = L.Add()([h, a])
  f = L.LayerNormalization(epsilon=1e-6)(h)
  f = L.Dense(mlp, activation="gelu")(f)
  f = L.Dense(dim)(f)
  return L.Add()([h, f])


def vit(k, seq_len=None, dim=384, depth=6, heads=6, patch=4):
  """ViT-S/4-style encoder at 32x32: patch embedding Conv2D 4x4 stride 4
  (64 tokens), learned position embedding, 6 pre-LN blocks (6-head
  attention, MLP 4x with GELU), LayerNorm, mean pool, Dense 10."""
  del seq_len
  L = k.layers  # noqa: N806
  inp = k.Input(IMAGE)
  h = L.Conv2D(dim, patch, strides=patch)(inp)
  h = L.Reshape(((IMAGE[0] // patch) * (IMAGE[1] // patch), dim))(h)
  h = _position_embedding(k)(h)
  for _ in range(depth):
    h = _pre_ln_block(k, h, heads, dim, 4 * dim)
  h = L.LayerNormalization(epsilon=1e-6)(h)
  h = L.GlobalAveragePooling1D()(h)
  return k.Model(inp, L.Dense(CLASSES)(h))


def bert(k, seq_len=128, vocab=VOCAB_BERT, dim=256, depth=4, heads=4,
         ffn=1024):
  """BERT-style text encoder: token Embedding 30000 x 256 plus a learned
  position embedding, LayerNorm, 4 post-LN blocks (4-head attention, FFN
  1024 with GELU), mean pool, Dense 10; T = 128."""
  L = k.layers  # noqa: N806
  inp = k.Input((seq_len,), dtype="int32")
  h = L.Embedding(vocab, dim)(inp)
  h = L.LayerNormalization(epsilon=1e-12)(_position_embedding(k)(h))
  for _ in range(depth):
    a = L.MultiHeadAttention(num_heads=heads, key_dim=dim // heads)(h, h)
    h = L.LayerNormalization(epsilon=1e-12)(L.Add()([h, a]))
    f = L.Dense(ffn, activation="gelu")(h)
    f = L.Dense(dim)(f)
    h = L.LayerNormalization(epsilon=1e-12)(L.Add()([h, f]))
  h = L.GlobalAveragePooling1D()(h)
  return k.Model(inp, L.Dense(CLASSES)(h))


# The fine-tuning models (issue 28): KerasHub backbones (keras-hub 0.32,
# the [hub] extra), Keras 3 only.

VOCAB_GPT2 = 50_257
VOCAB_BERT_BASE = 30_522


def gpt2(k, seq_len=256, vocab=VOCAB_GPT2, dim=768, depth=12, heads=12,
         lora_rank=0):
  """GPT-2-small-like causal LM: `keras_hub.models.GPT2Backbone` (12
  layers, d = 768, 12 heads, FFN 3072, dropout 0.1, 1024 positions), its
  token embedding reversed as the LM head (tied, as `GPT2CausalLM`); one
  input, the token ids (the padding mask all ones). Logits `[B, T, vocab]`;
  the labels are the next tokens (`Spec.lm`). `lora_rank` > 0:
  `backbone.enable_lora(lora_rank)` (everything else frozen)."""
  import keras_hub  # noqa: PLC0415
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=vocab, num_layers=depth, num_heads=heads,
      hidden_dim=dim, intermediate_dim=4 * dim,
      max_sequence_length=max(1024, seq_len))
  ids = k.Input((seq_len,), dtype="int32", name="token_ids")
  h = backbone({"token_ids": ids, "padding_mask": k.ops.ones_like(ids)})
  model = k.Model(ids, backbone.token_embedding(h, reverse=True))
  if lora_rank:
    backbone.enable_lora(lora_rank)
  return model


def gpt2_lora(k, seq_len=256, lora_rank=4, **kwargs):
  """`gpt2` with LoRA of rank 4 (query and value projections)."""
  return gpt2(k, seq_len, lora_rank=lora_rank, **kwargs)


def bert_base(k, seq_len=128, vocab=VOCAB_BERT_BASE, dim=768, depth=12,
              heads=12, classes=2):
  """BERT-base-like classifier: `keras_hub.models.BertBackbone` (12
  layers, d = 768, 12 heads, FFN 3072, dropout 0.1, 512 positions), Dense
  `classes` on its pooled output (as `BertTextClassifier` without its
  dropout); one input, the token ids (one segment, no padding).

  The segment ids are `minimum(ids, 0)` (all 0), not `zeros_like(ids)`:
  TF folds the latter into a constant `[B, T]`, and tf_pxg then refuses
  the segment embedding's rows gathered by it (`AddV2 ... could not trace
  them to a copy of a shared parameter along the batch axis`)."""
  import keras_hub  # noqa: PLC0415
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=vocab, num_layers=depth, num_heads=heads,
      hidden_dim=dim, intermediate_dim=4 * dim,
      max_sequence_length=max(512, seq_len))
  ids = k.Input((seq_len,), dtype="int32", name="token_ids")
  out = backbone({"token_ids": ids, "segment_ids": k.ops.minimum(ids, 0),
                  "padding_mask": k.ops.ones_like(ids)})
  return k.Model(ids, k.layers.Dense(classes)(out["pooled_output"]))


@dataclasses.dataclass(frozen=True)
class Spec:
  """A benchmark model: builder, default batch, input kind and length.

  `tiny`: keyword arguments of the builder for the smoke test's tiny size
  (`seq_len` and `vocab` among them apply to the batch too); `small`: those
  of a smaller size that still measures something (`--size=small`).
  `lm`: a causal LM, whose labels are the next tokens `[B, T]` (the last
  position's label token 0) and whose classes are its vocabulary.
  """
  build: Callable
  batch: int
  input_shape: Callable[[int], Tuple[int, ...]]  # seq_len -> example shape
  vocab: int = 0  # > 0: integer token inputs below vocab
  seq_len: int = 0
  classes: int = CLASSES
  tiny: Dict[str, object] = dataclasses.field(default_factory=dict)
  small: Dict[str, object] = dataclasses.field(default_factory=dict)
  lm: bool = False


SPECS = {
    "mlp": Spec(mlp, 256, lambda t: (784,)),
    "cnn": Spec(cnn, 256, lambda t: (28, 28, 1)),
    "embed": Spec(embed, 256, lambda t: (t,), VOCAB_EMBED, 32),
    "transformer": Spec(transformer, 64, lambda t: (t,), VOCAB_TRANSFORMER,
                        128),
    "lstm": Spec(lstm, 64, lambda t: (t,), VOCAB_EMBED, 64, classes=2,
                 tiny=dict(seq_len=6, vocab=50, dim=8, units=8)),
    "convnext": Spec(convnext, 32, lambda t: IMAGE,
                     tiny=dict(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16))),
    # Tiny WRN: 16 channels into the stride-2 1x1 shortcuts. With 2, 4 or
    # 8, TF 2.21's oneDNN gradient of a 1x1 stride-2 VALID Conv2D on a
    # 32x32 or 16x16 input corrupts the heap (glibc abort or segfault) at
    # odd batch sizes (3, 5; also 1); at 16 channels and more it does not.
    "wrn_gn": Spec(wrn_gn, 32, lambda t: IMAGE,
                   tiny=dict(widths=(16, 16, 16), stem=4, blocks=1,
                             groups=2)),
    "vit": Spec(vit, 32, lambda t: IMAGE,
                tiny=dict(dim=16, depth=1, heads=2, patch=8)),
    "bert": Spec(bert, 32, lambda t: (t,), VOCAB_BERT, 128,
                 tiny=dict(seq_len=8, vocab=50, dim=16, depth=1, heads=2,
                           ffn=32)),
}
_TINY_HUB = dict(seq_len=8, vocab=50, dim=16, depth=1, heads=2)
# 4 layers at d = 768 with a 16384-token vocabulary: the tied LM head's
# share of the step's FLOPs (2 d V per token against 24 d^2 per layer) as
# in GPT-2 small's 12 layers and 50257 tokens (0.44 against 0.45).
_SMALL_GPT2 = dict(depth=4, vocab=16_384)
SPECS.update({
    "gpt2_ft": Spec(gpt2, 8, lambda t: (t,), VOCAB_GPT2, 256,
                    classes=VOCAB_GPT2, tiny=_TINY_HUB, small=_SMALL_GPT2,
                    lm=True),
    "gpt2_lora": Spec(gpt2_lora, 8, lambda t: (t,), VOCAB_GPT2, 256,
                      classes=VOCAB_GPT2, tiny=_TINY_HUB,
                      small=_SMALL_GPT2, lm=True),
    "bert_ft": Spec(bert_base, 8, lambda t: (t,), VOCAB_BERT_BASE, 128,
                    classes=2, tiny=_TINY_HUB, small=dict(depth=4)),
})
# The GPT-2-like model issue 51 measures under XLA: 6 layers, d = 256,
# 4 heads, T = 128, B = 16, GPT-2's vocabulary (tied LM head); full
# fine-tuning and LoRA of rank 4.
_GPT2_6L = dict(depth=6, dim=256, heads=4)
SPECS.update({
    "gpt2_6l": Spec(functools.partial(gpt2, **_GPT2_6L), 16,
                    lambda t: (t,), VOCAB_GPT2, 128, classes=VOCAB_GPT2,
                    tiny=_TINY_HUB, lm=True),
    "gpt2_6l_lora": Spec(functools.partial(gpt2_lora, **_GPT2_6L), 16,
                         lambda t: (t,), VOCAB_GPT2, 128,
                         classes=VOCAB_GPT2, tiny=_TINY_HUB, lm=True),
})
FINETUNE_MODELS = ("gpt2_ft", "gpt2_lora", "bert_ft")
# Every model built from KerasHub (`benchmarks.hlo_cost` compiles the
# gpt2_6l pair; the timing suite runs FINETUNE_MODELS).
HUB_MODELS = FINETUNE_MODELS + ("gpt2_6l", "gpt2_6l_lora")
SMALL_MODELS = ("mlp", "cnn", "embed", "transformer", "lstm")
REAL_MODELS = ("convnext", "wrn_gn", "vit", "bert", "lstm")
SIZES = ("full", "small", "tiny")


def _kwargs(name: str, seq_len: int, size: str) -> dict:
  spec = SPECS[name]
  if size not in SIZES:
    raise ValueError(f"size {size!r}: one of {SIZES}")
  kwargs = dict({"tiny": spec.tiny, "small": spec.small}.get(size, {}))
  if seq_len:
    kwargs["seq_len"] = seq_len
  elif spec.seq_len and "seq_len" not in kwargs:
    kwargs["seq_len"] = spec.seq_len
  return kwargs


def build(k, name: str, seq_len: int = 0, size: str = "full"):
  """Builds model `name` with Keras package `k` (seq_len 0: the default;
  size "tiny": the smoke test's size, `Spec.tiny`)."""
  return SPECS[name].build(k, **_kwargs(name, seq_len, size))


def batch(name: str, batch_size: int, seq_len: int = 0, seed: int = 0,
          size: str = "full"):
  """A fixed random batch `(x, y)` for model `name` (NumPy arrays)."""
  spec = SPECS[name]
  kwargs = _kwargs(name, seq_len, size)
  vocab = kwargs.get("vocab", spec.vocab)
  rng = np.random.default_rng(seed)
  shape = (batch_size, *spec.input_shape(kwargs.get("seq_len", 0)))
  if vocab:
    x = rng.integers(0, vocab, size=shape).astype("int32")
  else:
    x = rng.normal(size=shape).astype("float32")
  if spec.lm:
    y = np.concatenate([x[:, 1:], np.zeros_like(x[:, :1])], 1)
  else:
    y = rng.integers(0, spec.classes, size=(batch_size,)).astype("int32")
  return x, y
