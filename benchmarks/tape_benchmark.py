r"""Tape benchmark: `clipped_gradient_sum` vs `tf.GradientTape.gradient`.

Both run inside `tf.function` on the same model and batch; the report is the
ratio DP / non-private of the median step time and of the TF CPU allocator
peak, measured in one run:

  python -m benchmarks.tape_benchmark --batch_size=256
"""

from absl import app
import keras
import tensorflow as tf

from benchmarks import common
import tf_pxg


def build(name: str, batch_size: int, jit_compile: bool) -> dict:
  """The non-private and DP gradient functions of one model and batch."""
  model = common.MODELS[name]()
  x, y = (tf.constant(a) for a in common.batch(name, batch_size))
  loss_fn = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=None)
  variables = model.trainable_variables

  @tf.function(jit_compile=jit_compile)
  def plain(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(y, model(x, training=True)))
    return tape.gradient(loss, variables)

  @tf.function(jit_compile=jit_compile)
  def dp(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = loss_fn(y, model(x, training=True))
    return tape.clipped_gradient_sum(losses, variables, 1.0)

  return {"plain": lambda: plain(x, y), "dp": lambda: dp(x, y)}


def main(argv):
  del argv
  common.report("tape", "clipped_gradient_sum / tf.GradientTape.gradient",
                build)


if __name__ == "__main__":
  app.run(main)
