r"""Keras benchmark: one `fit` step of a DP model vs the plain Keras model.

The same architecture and weights are compiled twice (plain `keras.Model`
with SGD; `tf_pxg.keras.make_private` with the same SGD), and their
`train_function` is timed step by step on the same batch, alternating, in
one run. Reports DP / non-private median step time and allocator peak:

  python benchmarks/fit_benchmark.py --batch_size=256
"""

from absl import app
from absl import flags
import keras
import tensorflow as tf

from benchmarks import common
import tf_pxg.keras as pxk

_BATCH = flags.DEFINE_integer("batch_size", 256, "Examples per step.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timing round.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Alternating timing rounds.")
_MODELS = flags.DEFINE_list("models", ["mlp", "cnn"], "Models to run.")
_JIT = flags.DEFINE_bool("jit_compile", False, "Compile both with XLA.")


def _train_fn(model, x, y, jit_compile):
  model.compile(optimizer=keras.optimizers.SGD(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True),
                jit_compile=jit_compile)
  model.make_train_function()
  data = tf.data.Dataset.from_tensors((x, y)).repeat()
  iterator = iter(data)
  return lambda: model.train_function(iterator)


def measure(name: str, batch_size: int, steps: int, rounds: int,
            jit_compile: bool = False) -> dict:
  keras.utils.set_random_seed(0)
  plain = common.MODELS[name][0]()
  private = pxk.make_private(common.MODELS[name][0](), l2_norm_clip=1.0,
                             noise_multiplier=1.0)
  private.set_weights(plain.get_weights())
  x, y = common.batch(name, batch_size)
  fns = {"plain": _train_fn(plain, x, y, jit_compile),
         "dp": _train_fn(private, x, y, jit_compile)}
  t = common.interleaved_median(fns, steps, rounds)
  mem = {k: common.peak_memory(f) for k, f in fns.items()}
  return {"model": name, "time_plain_ms": 1e3 * t["plain"],
          "time_dp_ms": 1e3 * t["dp"], "time_ratio": t["dp"] / t["plain"],
          "mem_ratio": mem["dp"] / mem["plain"]}


def main(argv):
  del argv
  for name in _MODELS.value:
    r = measure(name, _BATCH.value, _STEPS.value, _ROUNDS.value, _JIT.value)
    print(f"fit {r['model']} B={_BATCH.value} jit={_JIT.value}: "
          f"DP train step / keras.Model train step "
          f"time {r['time_ratio']:.2f}x "
          f"({r['time_dp_ms']:.2f} / {r['time_plain_ms']:.2f} ms), "
          f"peak memory {r['mem_ratio']:.2f}x")


if __name__ == "__main__":
  app.run(main)
