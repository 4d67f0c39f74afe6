r"""Tape benchmark: `clipped_gradient_sum` vs `tf.GradientTape.gradient`.

Both run inside `tf.function` on the same model and batch, timed in
interleaved rounds in one process (`benchmarks.timing`, the suite's
timing); reports DP / non-private wall and CPU time, and the TF CPU
allocator peak where the allocator keeps statistics:

  python -m benchmarks.tape_benchmark --models=mlp,cnn --batch_size=256
"""

from __future__ import annotations

from absl import app
from absl import flags
import keras
import tensorflow as tf

from benchmarks import memory
from benchmarks import models
from benchmarks import modes
from benchmarks import timing
import tf_pxg


def _define_flags():
  """Flags, defined only when run as a program (see benchmarks.memory)."""
  return dict(
      models=flags.DEFINE_list("models", ["mlp", "cnn"], "Models to run."),
      batch_size=flags.DEFINE_integer("batch_size", 256,
                                      "Examples per step."),
      rounds=flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds."),
      jit_compile=flags.DEFINE_bool("jit_compile", False,
                                    "Compile both with XLA."))


_FLAGS = {}


def steps(name: str, batch_size: int, jit_compile: bool = False):
  """`{"plain": Step, "dp": Step}`: the two gradient functions of a model."""
  keras.utils.set_random_seed(0)
  model = models.build(keras, name)
  x, y = (tf.constant(a) for a in models.batch(name, batch_size))
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

  return {"plain": modes.Step(lambda: plain(x, y)),
          "dp": modes.Step(lambda: dp(x, y))}


def _peak(step: modes.Step):
  if not memory.reset_allocator_stats():
    return None
  modes.sync(step.fn())
  return memory.allocator_peak_bytes()


def compare(name: str, batch_size: int, rounds: int,
            jit_compile: bool = False) -> str:
  """Times both gradient functions of `name`; one report line."""
  built = timing.build_group(["plain", "dp"], steps(
      name, batch_size, jit_compile).__getitem__, log=lambda _: None)
  results = timing.run_rounds(built, rounds, round_seconds=0.5)
  timing.add_ratios(results, {"dp": "plain"})
  peaks = {k: _peak(built[k]) for k in built}
  mem = (f"{peaks['dp'] / peaks['plain']:.2f}x" if all(peaks.values())
         else "n/a (no allocator statistics)")
  dp = results["dp"]
  return (f"tape {name} B={batch_size} jit={jit_compile}: "
          "clipped_gradient_sum / tf.GradientTape.gradient "
          f"wall {dp['ratio']:.2f}x (CPU {dp['cpu_ratio']:.2f}x; "
          f"{dp['ms']:.2f} / {results['plain']['ms']:.2f} ms), "
          f"peak memory {mem}")


def main(argv):
  del argv
  f = {k: v.value for k, v in _FLAGS.items()}
  for name in f["models"]:
    print(compare(name, f["batch_size"], f["rounds"], f["jit_compile"]),
          flush=True)


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)
