"""Costs of the Poisson data path: padding masks, accumulation, XLA.

    python benchmarks/sampling_benchmark.py                 # MLP and CNN, B=256
    python benchmarks/sampling_benchmark.py --models=mlp --rounds=9

Each variant is a compiled `train_step` called on a prepared batch (no input
pipeline), timed in interleaved rounds in one process by the suite's
`benchmarks.timing` (each ratio is the median of per-round ratios; the CPU
may be shared, so only ratios measured side by side mean anything). Ratios
reported, per model at physical batch P:

- `padded/unpadded`: a DP step on a Poisson physical batch (mask, P rows of
  which ~P/(1 + 4/sqrt(B)) real, noise once, divided by qN) over a DP step
  on a plain batch of the same P rows. Target <= 1.05.
- `k8/sigma0`: the mean time per physical batch of a logical step of k = 8
  physical batches with sigma > 0 (noise drawn once, at the 8th) over a
  sigma = 0 DP step on a plain batch of P rows. Target <= 1.05.
- `xla dp/xla plain`: the DP step (plain batch and Poisson batch) over a
  non-private Keras step, both with `jit_compile=True`.

Models (`benchmarks/models.py`): MLP 784-512-512-10 and the CNN
Conv2D 16 5x5 s2 -> Conv2D 32 4x4 s2 -> Dense 32 -> Dense 10 on 28x28x1.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import models  # noqa: E402
from benchmarks import modes  # noqa: E402
from benchmarks import timing  # noqa: E402
from tf_pxg import data as dp_data  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402

_BATCH = flags.DEFINE_integer("batch_size", 256, "Physical batch size P.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved rounds.")
_MODELS = flags.DEFINE_list("models", ["mlp", "cnn"], "Models.")


def _data(name, p):
  return tuple(tf.constant(a) for a in models.batch(name, p))


def _compiled_step(model, jit):
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss,
                jit_compile=jit)
  if isinstance(model, dpk.DPSequential):
    model.optimizer.build(model.trainable_variables)
    model.build_accumulator()
  return tf.function(model.train_step, jit_compile=jit)


def _poisson_infos(p, b, k):
  """Masks of k physical batches of one Poisson draw (expected size b*k)."""
  rng = np.random.default_rng(1)
  infos = []
  for i in range(k):
    mask = (rng.random(p) < b / p).astype("float32")
    infos.append(dp_data.dp_batch_info(mask, step_end=(i == k - 1),
                                       normalizer=float(b * k)))
  return infos


def measure(name, p, rounds):
  """Ratios of the variants (module doc) of model `name` at batch `p`."""
  x, y = _data(name, p)
  # Expected batch whose default physical size is about P.
  b = int((np.sqrt(4 + p) - 2) ** 2)
  variants = {}

  def dp_model(noise):
    keras.utils.set_random_seed(0)
    return dpk.make_private(models.build(keras, name), l2_norm_clip=1.0,
                            noise_multiplier=noise, seed=0)

  for jit in (False, True):
    tag = "xla" if jit else "graph"
    plain = _compiled_step(dp_model(1.0), jit)
    variants[f"{tag} dp unpadded"] = lambda f=plain: f((x, y))
    padded = _compiled_step(dp_model(1.0), jit)
    info1 = _poisson_infos(p, b, 1)[0]
    variants[f"{tag} dp padded"] = lambda f=padded, i=info1: f((x, y, i))
    keras.utils.set_random_seed(0)
    nonprivate = models.build(keras, name)
    nonprivate.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit)
    np_step = tf.function(nonprivate.train_step, jit_compile=jit)
    variants[f"{tag} non-private"] = lambda f=np_step: f((x, y))
  sigma0 = _compiled_step(dp_model(0.0), False)
  variants["graph dp sigma0"] = lambda f=sigma0: f((x, y))
  acc = _compiled_step(dp_model(1.0), False)
  infos8 = _poisson_infos(p, b // 8 or 1, 8)
  # One call runs a whole logical step of 8 physical batches; its time is
  # divided by 8 below.
  variants["graph dp k8 (logical)"] = lambda: [acc((x, y, i))
                                               for i in infos8][-1]

  built = timing.build_group(
      list(variants), lambda k: modes.Step(variants[k]), log=lambda _: None)
  results = timing.run_rounds(built, rounds, round_seconds=0.5)
  pairs = {"graph dp padded": "graph dp unpadded",
           "xla dp padded": "xla dp unpadded",
           "xla dp unpadded": "xla non-private",
           "graph dp unpadded": "graph non-private"}
  timing.add_ratios(results, pairs)
  ratios = {k: results[k]["ratio"] for k in pairs}
  per_round = (np.array(results["graph dp k8 (logical)"]["round_ms"]) / 8 /
               np.array(results["graph dp sigma0"]["round_ms"]))
  ratios["k8/sigma0"] = float(np.median(per_round))
  xla_padded = (np.array(results["xla dp padded"]["round_ms"]) /
                np.array(results["xla non-private"]["round_ms"]))
  ratios["xla dp padded / xla non-private"] = float(np.median(xla_padded))
  return {k: r["ms"] for k, r in results.items()}, ratios


def main(argv):
  del argv
  p = _BATCH.value
  for name in _MODELS.value:
    ms, r = measure(name, p, _ROUNDS.value)
    for k, v in ms.items():
      print(f"{name} P={p} {k}: {v:.2f} ms", flush=True)
    print(f"{name} P={p} ratios: padded/unpadded "
          f"graph={r['graph dp padded']:.3f} xla={r['xla dp padded']:.3f}; "
          f"k8/sigma0={r['k8/sigma0']:.3f}; xla dp/xla plain "
          f"unpadded={r['xla dp unpadded']:.3f} "
          f"padded={r['xla dp padded / xla non-private']:.3f}; "
          f"graph dp/plain={r['graph dp unpadded']:.3f}", flush=True)


if __name__ == "__main__":
  app.run(main)
