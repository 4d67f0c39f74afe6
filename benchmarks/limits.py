r"""What the noise costs on this CPU: the floors under every DP step.

DP-SGD adds one Gaussian per weight per step, and no clipping engine can
skip that: the update becomes dense. This measures, in CPU time per
element over 4M elements (so per-op overhead is negligible):

* `threefry_ns_per_gaussian`: what a DP step pays per weight,
  `tf_pxg.dp.threefry.add_normal_noise` (generate, scale and add, fused)
  in a graph: the native op of `tf_pxg.native` where it builds;
* `threefry_xla_ns_per_gaussian`: the same draw as an XLA loop, what
  XLA-compiled steps (`jit_compile=True`) pay;
* `philox_ns_per_word`: TF's Philox generator, raw 32-bit words
  (`Generator.uniform_full_int`), for reference;
* `box_muller_ns_per_gaussian`: `tf_pxg.dp.box_muller_normal`, TF's kernels
  (the fallback for float64 and dynamic shapes);
* `tf_normal_ns_per_gaussian`: TF's own `Generator.normal`;
* `copy_ns_per_float`: `x + 1` with TF's kernel (a read and a write);
* `dense_update_ns_per_float`: one XLA-fused read-modify-write pass over a
  variable (`v.assign(v * a + b)`), the least a dense update can cost per
  weight even with a free generator: the memory-bandwidth floor;
* from `benchmarks/threefry_rounds.cc` (the native op's sampling code,
  compiled as the op is and timed on one core outside TF, where a C++
  compiler exists): `threefry_rounds_ns_per_gaussian`, the Threefry-2x32-20
  rounds alone, the least any DP step drawing this generator's noise pays
  per weight; `normal_pairs_ns_per_gaussian` with the Box-Muller transform;
  `add_noise_ns_per_gaussian` also adding into a gradient.

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


def native_sampling() -> dict:
  """The single-core timings of `benchmarks/threefry_rounds.cc`, or {} if
  no C++ compiler is found or the build fails."""
  import pathlib  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import tempfile  # noqa: PLC0415
  from tf_pxg import native  # noqa: PLC0415
  source = pathlib.Path(__file__).with_name("threefry_rounds.cc")
  try:
    with tempfile.TemporaryDirectory() as tmp:
      program = pathlib.Path(tmp) / "threefry_rounds"
      subprocess.run([native.compiler(), str(source), "-o", str(program),
                      *native.optimization_flags()],
                     check=True, capture_output=True, timeout=300)
      out = subprocess.run([str(program)], check=True, capture_output=True,
                           text=True, timeout=300).stdout
  except (OSError, subprocess.SubprocessError):
    return {}
  return json.loads(out)


def noise_kernels() -> dict:
  """CPU ns per element of the noise's building blocks (see module doc)."""
  import tensorflow as tf  # noqa: PLC0415
  from tf_pxg import dp  # noqa: PLC0415
  from tf_pxg.dp import threefry  # noqa: PLC0415
  gen = tf.random.Generator.from_seed(0)
  x = tf.Variable(tf.zeros([N]))
  key = tf.Variable(tf.constant([1, 2, 3], tf.uint32))

  @tf.function(jit_compile=True)
  def dense_update():
    x.assign(x * 0.5 + 1.0)
    return x.read_value()[:1]

  fns = {
      "threefry_ns_per_gaussian": tf.function(
          lambda: threefry.add_normal_noise([x.read_value()], key, 1.0)),
      "threefry_xla_ns_per_gaussian": tf.function(
          lambda: threefry.add_normal_noise([x.read_value()], key, 1.0),
          jit_compile=True),
      "dense_update_ns_per_float": dense_update,
      "philox_ns_per_word": tf.function(
          lambda: gen.uniform_full_int([N], tf.uint32)),
      "box_muller_ns_per_gaussian": tf.function(
          lambda: dp.box_muller_normal(gen, [N])),
      "tf_normal_ns_per_gaussian": tf.function(lambda: gen.normal([N])),
      "copy_ns_per_float": tf.function(lambda: x.read_value() + 1.0),
  }
  out = {k: round(_cpu_ns_per_element(f, N), 3) for k, f in fns.items()}
  out.update(native_sampling())
  out["elements"] = N
  return out


if __name__ == "__main__":
  from benchmarks import venv
  venv.setup_process_env()
  print(json.dumps(noise_kernels(), indent=1))
