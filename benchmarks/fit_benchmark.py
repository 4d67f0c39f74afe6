r"""Keras benchmark: one `fit` step of a DP model vs the plain Keras model.

The same architecture and weights are compiled twice (plain `keras.Model`
with SGD; `tf_pxg.keras.make_private` with the same SGD), and their
`train_function` is timed step by step on the same batch, alternating, in
one run. Reports DP / non-private median step time and allocator peak:

  python -m benchmarks.fit_benchmark --batch_size=256
"""

from absl import app
from absl import flags
import keras
import tensorflow as tf

from benchmarks import common
from tf_pxg import dp
import tf_pxg.keras as pxk


def _train_fn(model, x, y, jit_compile):
  model.compile(optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                jit_compile=jit_compile)
  model.make_train_function()
  iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
  return lambda: model.train_function(iterator)


def _noise_fn(model, jit_compile):
  """Draws the noise one DP step adds (one Gaussian per trainable weight)."""
  generator = dp.make_generator(seed=0)
  variables = model.trainable_variables

  @tf.function(jit_compile=jit_compile)
  def draw():
    return dp.add_gaussian_noise([tf.zeros_like(v) for v in variables], 1.0,
                                 generator=generator)
  return draw


_NOISE = flags.DEFINE_float(
    "noise_multiplier", 1.0,
    "Noise multiplier of the DP model; 0 times the clipping engine alone.")


def build(name: str, batch_size: int, jit_compile: bool) -> dict:
  """Train functions of a plain and a DP model with the same weights.

  "noise" only draws the DP step's noise: its time over "plain" is the
  share of the DP overhead that no clipping engine can remove.
  """
  plain = common.MODELS[name]()
  private = pxk.make_private(common.MODELS[name](), l2_norm_clip=1.0,
                             noise_multiplier=_NOISE.value)
  private.set_weights(plain.get_weights())
  x, y = common.batch(name, batch_size)
  return {"plain": _train_fn(plain, x, y, jit_compile),
          "dp": _train_fn(private, x, y, jit_compile),
          "noise": _noise_fn(private, jit_compile)}


def main(argv):
  del argv
  common.report("fit", "DP train step / keras.Model train step", build)


if __name__ == "__main__":
  app.run(main)
