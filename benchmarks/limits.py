r"""What the noise costs on this CPU: the floor under every DP step.

DP-SGD adds one Gaussian per weight per step, and no clipping engine can
skip that. This measures, in CPU time per element over 4M elements (so
per-op overhead is negligible):

* `philox_ns_per_word`: TF's Philox generator, raw 32-bit words
  (`Generator.uniform_full_int`); Box-Muller needs one word per Gaussian;
* `box_muller_ns_per_gaussian`: `tf_pxg.dp.box_muller_normal`, what a DP
  step draws;
* `tf_normal_ns_per_gaussian`: TF's own `Generator.normal`, for reference;
* `copy_ns_per_float`: writing one float32 (`x + 1`, a read and a write),
  the memory-bandwidth bound an ideal generator would approach.

  python -m benchmarks.limits
"""

from __future__ import annotations

import json
import time

import numpy as np

N = 1 << 22


def _cpu_ns_per_element(fn, n: int, reps: int = 5, rounds: int = 5) -> float:
  from benchmarks import modes  # noqa: PLC0415
  modes.sync(fn())
  times = []
  for _ in range(rounds):
    start = time.process_time()
    for _ in range(reps):
      out = fn()
    modes.sync(out)
    times.append((time.process_time() - start) / reps)
  return float(np.median(times)) / n * 1e9


def noise_kernels() -> dict:
  """CPU ns per element of the noise's building blocks (see module doc)."""
  import tensorflow as tf  # noqa: PLC0415
  from tf_pxg import dp  # noqa: PLC0415
  gen = tf.random.Generator.from_seed(0)
  x = tf.Variable(tf.zeros([N]))
  fns = {
      "philox_ns_per_word": tf.function(
          lambda: gen.uniform_full_int([N], tf.uint32)),
      "box_muller_ns_per_gaussian": tf.function(
          lambda: dp.box_muller_normal(gen, [N])),
      "tf_normal_ns_per_gaussian": tf.function(lambda: gen.normal([N])),
      "copy_ns_per_float": tf.function(lambda: x.read_value() + 1.0),
  }
  out = {k: round(_cpu_ns_per_element(f, N), 3) for k, f in fns.items()}
  out["elements"] = N
  return out


if __name__ == "__main__":
  from benchmarks import venv
  venv.setup_process_env()
  print(json.dumps(noise_kernels(), indent=1))
