"""Costs of the Poisson data path: padding masks, accumulation, XLA.

    python benchmarks/sampling_benchmark.py                 # MLP and CNN, B=256
    python benchmarks/sampling_benchmark.py --models=mlp --rounds=9
    python benchmarks/sampling_benchmark.py --mode=indices  # sampler cost
    python benchmarks/sampling_benchmark.py --mode=fit      # Poisson/shuffled

`--mode=indices`: time per logical step of drawing one Poisson sample at
B = 1024 for N = 1e5, 1e7, 1e9 (indices only): the numpy
`PoissonSampler.sample_indices` and the `tf.data` index stream
(`sampling_ops.index_stream`, sampling + layout, k = 1), each the median of
`--rounds` rounds of 200 steps; and the old N-uniform draw
(`random(N) < q`) for N <= 1e7.

`--mode=fit`: wall time of one-epoch `fit` calls of a data-bound tiny model
(784 -> Dense(10), DP, sigma = 1) on 200k x 784 float32 examples, B = 1024,
with Poisson sampling (default) and `sampling="shuffled"`, alternated in
`--rounds` rounds in one process after one warm-up fit each; reports the
median of the per-round ratios.

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
_MODE = flags.DEFINE_enum("mode", "steps", ["steps", "indices", "fit"],
                          "What to measure (module docstring).")


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


def measure_indices(rounds, b=1024, steps=200):
  """ms per logical step: numpy sampler, tf.data stream, old O(N) draw."""
  import time  # noqa: PLC0415
  from tf_pxg.data import sampling_ops  # noqa: PLC0415
  rows = []
  for n in (10 ** 5, 10 ** 7, 10 ** 9):
    sampler = dp_data.PoissonSampler(n, b, accumulation_steps=1, seed=0)
    it = iter(sampling_ops.index_stream(sampler, start_step=0))
    next(it)
    rng = np.random.default_rng(0)
    numpy_ms, tf_ms, old_ms = [], [], []
    for _ in range(rounds):
      t0 = time.perf_counter()
      for _ in range(steps):
        sampler.sample_indices()
      t1 = time.perf_counter()
      done = 0
      while done < steps:
        done += bool(next(it)[2])
      t2 = time.perf_counter()
      numpy_ms.append((t1 - t0) / steps * 1e3)
      tf_ms.append((t2 - t1) / steps * 1e3)
      if n <= 10 ** 7:
        k = max(1, steps // (n // 10 ** 5))
        t3 = time.perf_counter()
        for _ in range(k):
          np.flatnonzero(rng.random(n) < b / n)
        old_ms.append((time.perf_counter() - t3) / k * 1e3)
    rows.append((n, float(np.median(numpy_ms)), float(np.median(tf_ms)),
                 float(np.median(old_ms)) if old_ms else None))
  return rows


def measure_fit(rounds, n=200_000, b=1024):
  """Per-round Poisson/shuffled ratios of one-epoch fit wall times."""
  import time  # noqa: PLC0415
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, 784), dtype=np.float32)
  y = rng.integers(0, 10, n)

  def tiny():
    keras.utils.set_random_seed(0)
    inp = keras.Input((784,))
    model = dpk.make_private(keras.Model(inp, keras.layers.Dense(10)(inp)),
                             l2_norm_clip=1.0, noise_multiplier=1.0)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model

  models_ = {"poisson": tiny(), "shuffled": tiny()}

  def run(kind):
    t = time.perf_counter()
    models_[kind].fit(x, y, batch_size=b, epochs=1, verbose=0,
                      sampling=kind)
    return time.perf_counter() - t

  for kind in models_:
    run(kind)  # warm-up: tracing
  times = {k: [] for k in models_}
  for r in range(rounds):
    for kind in (("poisson", "shuffled") if r % 2 == 0 else
                 ("shuffled", "poisson")):
      times[kind].append(run(kind))
  ratios = np.array(times["poisson"]) / np.array(times["shuffled"])
  return times, ratios


def main(argv):
  del argv
  if _MODE.value == "indices":
    print("N | numpy ms/step | tf.data ms/step | old random(N)<q ms/step")
    for n, a, t, old in measure_indices(_ROUNDS.value):
      print(f"{n:.0e} | {a:.3f} | {t:.3f} | "
            f"{'-' if old is None else f'{old:.2f}'}", flush=True)
    return
  if _MODE.value == "fit":
    times, ratios = measure_fit(_ROUNDS.value)
    for k, v in times.items():
      print(f"{k}: epoch seconds " + ", ".join(f"{t:.2f}" for t in v))
    print("poisson/shuffled per round: " +
          ", ".join(f"{r:.3f}" for r in ratios) +
          f"; median {np.median(ratios):.3f}", flush=True)
    return
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
