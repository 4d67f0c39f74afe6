"""Per-layer (`tf_pxg.clipping.PerLayer`) against flat clipping: the DP
Keras step time of one benchmark model, interleaved rounds, median ratio.

  python -m benchmarks.per_layer_clipping --model=cnn --batch=128 \
      --rounds=5 --steps=10 [--xla]

Prints a Markdown table (the ratio per-layer / flat per round and the
median); `--out` writes it to a file.
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
import numpy as np

import tf_pxg
import tf_pxg.keras as dpk
from benchmarks import models


def _model(name, policy, xla, batch):
  keras.utils.set_random_seed(0)
  base = models.build(keras, name)
  model = dpk.make_private(base, l2_norm_clip=1.0, noise_multiplier=1.0,
                           seed=0, clipping=policy)
  model.compile(optimizer=keras.optimizers.SGD(0.01),
                loss="sparse_categorical_crossentropy", jit_compile=xla)
  x, y = models.batch(name, batch)
  model.train_on_batch(x, y)  # trace
  model.train_on_batch(x, y)
  return lambda: model.train_on_batch(x, y)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--model", default="cnn")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--xla", action="store_true")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  policies = {"flat": None,
              "per_layer": tf_pxg.clipping.PerLayer(),
              "per_layer_per_group_noise": tf_pxg.clipping.PerLayer(
                  noise_allocation="per_group")}
  steps = {k: _model(a.model, v, a.xla, a.batch) for k, v in
           policies.items()}
  times = {k: [] for k in steps}
  for _ in range(a.rounds):
    for k, fn in steps.items():
      start = time.perf_counter()
      for _ in range(a.steps):
        fn()
      times[k].append((time.perf_counter() - start) / a.steps)
  lines = [f"Model {a.model}, batch {a.batch}, "
           f"{'XLA' if a.xla else 'graph'}; {a.rounds} interleaved rounds "
           f"of {a.steps} DP steps (train_on_batch), seconds per step.", "",
           "| policy | median s/step | ratio to flat (median of rounds) |",
           "|---|---|---|"]
  for k, ts in times.items():
    ratios = [t / f for t, f in zip(ts, times["flat"])]
    lines.append(f"| {k} | {statistics.median(ts):.4f} | "
                 f"{statistics.median(ratios):.3f} |")
  text = "\n".join(lines)
  print(text)
  if a.out:
    with open(a.out, "a") as f:
      f.write(text + "\n\n")
  return np.array([statistics.median(times[k]) for k in times])


if __name__ == "__main__":
  main()
