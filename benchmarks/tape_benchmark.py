r"""Tape benchmark: `clipped_gradient_sum` vs `tf.GradientTape.gradient`.

Both run inside `tf.function` on the same model and batch; the report is the
ratio DP / non-private of the median step time and of the TF CPU allocator
peak, measured in one run:

  python benchmarks/tape_benchmark.py --batch_size=256
"""

from absl import app
from absl import flags
import keras
import tensorflow as tf

from benchmarks import common
import tf_pxg

_BATCH = flags.DEFINE_integer("batch_size", 256, "Examples per step.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timing round.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Alternating timing rounds.")
_MODELS = flags.DEFINE_list("models", ["mlp", "cnn"], "Models to run.")
_JIT = flags.DEFINE_bool("jit_compile", False, "Compile both with XLA.")


def measure(name: str, batch_size: int, steps: int, rounds: int,
            jit_compile: bool = False) -> dict:
  keras.utils.set_random_seed(0)
  model = common.MODELS[name][0]()
  x, y = common.batch(name, batch_size)
  x, y = tf.constant(x), tf.constant(y)
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

  fns = {"plain": lambda: plain(x, y), "dp": lambda: dp(x, y)}
  t = common.interleaved_median(fns, steps, rounds)
  mem = {k: common.peak_memory(f) for k, f in fns.items()}
  return {"model": name, "time_plain_ms": 1e3 * t["plain"],
          "time_dp_ms": 1e3 * t["dp"], "time_ratio": t["dp"] / t["plain"],
          "mem_ratio": mem["dp"] / mem["plain"]}


def main(argv):
  del argv
  for name in _MODELS.value:
    r = measure(name, _BATCH.value, _STEPS.value, _ROUNDS.value, _JIT.value)
    print(f"tape {r['model']} B={_BATCH.value} jit={_JIT.value}: "
          f"clipped_gradient_sum / tf.GradientTape.gradient "
          f"time {r['time_ratio']:.2f}x "
          f"({r['time_dp_ms']:.2f} / {r['time_plain_ms']:.2f} ms), "
          f"peak memory {r['mem_ratio']:.2f}x")


if __name__ == "__main__":
  app.run(main)
