"""DP fine-tuning of a KerasHub causal LM with LoRA, on text that ships with
Python (no download).

    python examples/dp_finetune_text.py                 # tiny GPT-2, ε = 8
    python examples/dp_finetune_text.py --nodp          # non-private baseline
    python examples/dp_finetune_text.py --lora_rank=0   # full fine-tuning
    python examples/dp_finetune_text.py --preset=gpt2_base_en  # your weights

The corpus is the help text of the Python standard library
(`pydoc_data.topics`, ~460 kB), cut into windows of `--sequence_length`
tokens; each window is one example (the privacy unit). The task is
next-token prediction; each example's loss is the mean over its tokens.
Without `--preset` the tokens are characters (printable ASCII, one id
each) and the model a small GPT-2 (`keras_hub.models.GPT2Backbone`) built
from its configuration with random weights, with a trainable next-token
head; `--lora_rank=r` (default 4) calls `backbone.enable_lora(r)`, which
freezes the backbone and trains rank-r adapters of its attention query and
value projections (with the head). With `--preset=name` the backbone and
its tokenizer come from a KerasHub preset you have (`from_preset`), and the
head is the preset's own (tied) token embedding.

Prints the test next-token accuracy, perplexity and ε after each epoch,
and a final line `final: test_accuracy=... perplexity=... epsilon=...`.
Training is DP-SGD through `model.fit` on Poisson batches
(`tf_pxg.keras.make_private`), with the noise for `--target_epsilon` after
`--epochs` epochs (`tf_pxg.accounting`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pydoc_data.topics  # noqa: E402

from tf_pxg import accounting  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402

_PRESET = flags.DEFINE_string(
    "preset", None, "A KerasHub causal-LM preset (e.g. gpt2_base_en) whose "
    "weights you have; default: a small GPT-2 with random weights.")
_LORA_RANK = flags.DEFINE_integer(
    "lora_rank", 4, "LoRA rank (backbone.enable_lora); 0 trains every "
    "weight (full fine-tuning).")
_SEQUENCE_LENGTH = flags.DEFINE_integer("sequence_length", 32,
                                        "Tokens per example.")
_NUM_TRAIN = flags.DEFINE_integer(
    "num_train", 12000, "Training windows (at most what the text gives).")
_NUM_TEST = flags.DEFINE_integer("num_test", 1000, "Test windows.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256,
                                   "Expected (Poisson) batch size.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-2,
                                    "Adam learning rate.")
_L2_NORM_CLIP = flags.DEFINE_float("l2_norm_clip", 1.0,
                                   "Per-example gradient L2 norm bound.")
_NOISE_MULTIPLIER = flags.DEFINE_float(
    "noise_multiplier", None, "Noise std / l2_norm_clip. Default: the "
    "smallest that keeps ε within --target_epsilon after --epochs epochs.")
_TARGET_EPSILON = flags.DEFINE_float("target_epsilon", 8.0,
                                     "Privacy budget.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "δ of (ε, δ)-DP.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for the split and weights "
                             "(the DP noise and sampling use OS entropy).")
_NODP = flags.DEFINE_bool("nodp", False, "Train without privacy (baseline).")

# Character vocabulary: 0 is padding, then newline and printable ASCII;
# anything else maps to the last id.
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
_VOCAB = len(_CHARS) + 2


def corpus() -> str:
  """The standard library's help topics, in a fixed order."""
  topics = pydoc_data.topics.topics
  return "\n\n".join(topics[k] for k in sorted(topics))


def char_ids(text: str) -> np.ndarray:
  index = {c: i + 1 for i, c in enumerate(_CHARS)}
  return np.array([index.get(c, _VOCAB - 1) for c in text], "int32")


def windows(ids: np.ndarray, length: int, seed: int):
  """Non-overlapping windows of `length + 1` tokens, shuffled: inputs are
  the first `length`, labels the last `length` (the next tokens)."""
  n = len(ids) // (length + 1)
  w = ids[:n * (length + 1)].reshape(n, length + 1)
  w = w[np.random.default_rng(seed).permutation(n)]
  x = {"token_ids": w[:, :-1],
       "padding_mask": np.ones((n, length), "int32")}
  return x, w[:, 1:]


def split(x, y, num_train, num_test):
  cut = lambda a, s: a[s]
  test = slice(0, num_test)
  train = slice(num_test, num_test + num_train)
  return ({k: cut(v, train) for k, v in x.items()}, cut(y, train),
          {k: cut(v, test) for k, v in x.items()}, cut(y, test))


def build_model(length: int):
  """(model, token ids of the corpus): the backbone with a next-token head."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  if _PRESET.value:
    backbone = keras_hub.models.Backbone.from_preset(_PRESET.value)
    tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(_PRESET.value)
    ids = np.asarray(tokenizer(corpus())).astype("int32").ravel()
  else:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=_VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=128, dropout=0.0, max_sequence_length=length)
    ids = char_ids(corpus())
  if _LORA_RANK.value:
    backbone.enable_lora(_LORA_RANK.value)
  h = backbone(backbone.input)
  if _PRESET.value:
    logits = backbone.token_embedding(h, reverse=True)
  else:
    logits = keras.layers.Dense(_VOCAB, name="next_token")(h)
  return keras.Model(backbone.input, logits), ids


class _Report(keras.callbacks.Callback):

  def on_epoch_end(self, epoch, logs=None):
    eps = logs.get("epsilon", float("inf"))
    print(f"epoch {epoch + 1}: test_accuracy={logs['val_accuracy']:.4f} "
          f"perplexity={np.exp(logs['val_loss']):.2f} epsilon={eps:.3f}",
          flush=True)


def main(argv):
  del argv
  keras.utils.set_random_seed(_SEED.value)
  length = _SEQUENCE_LENGTH.value
  model, ids = build_model(length)
  x, y = windows(ids, length, _SEED.value)
  x_train, y_train, x_test, y_test = split(x, y, _NUM_TRAIN.value,
                                           _NUM_TEST.value)
  n, batch = len(y_train), _BATCH_SIZE.value
  trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
  print(f"{n} train / {len(y_test)} test windows of {length} tokens; "
        f"{trainable} trainable weights (lora_rank={_LORA_RANK.value})")
  callbacks, noise = [], None
  if not _NODP.value:
    noise = _NOISE_MULTIPLIER.value
    if noise is None:
      noise = accounting.noise_multiplier_for_epsilon(
          _TARGET_EPSILON.value, n, batch, epochs=_EPOCHS.value,
          delta=_DELTA.value)
    model = dpk.make_private(model, l2_norm_clip=_L2_NORM_CLIP.value,
                             noise_multiplier=noise)
    callbacks.append(dpk.PrivacyCallback(
        num_examples=n, batch_size=batch, delta=_DELTA.value,
        target_epsilon=_TARGET_EPSILON.value))
    print(f"DP-SGD: l2_norm_clip={_L2_NORM_CLIP.value} "
          f"noise_multiplier={noise:.4f} batch_size={batch}")
  model.compile(optimizer=keras.optimizers.Adam(_LEARNING_RATE.value),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                metrics=["accuracy"])
  callbacks.append(_Report())
  model.fit(x_train, y_train, batch_size=batch, epochs=_EPOCHS.value,
            validation_data=(x_test, y_test), callbacks=callbacks,
            verbose=0)
  loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch,
                                  verbose=0)
  epsilon = float("inf") if noise is None else callbacks[0].epsilon()
  print(f"final: test_accuracy={accuracy:.4f} perplexity={np.exp(loss):.2f} "
        f"epsilon={epsilon:.3f} delta={_DELTA.value:g}")


if __name__ == "__main__":
  app.run(main)
