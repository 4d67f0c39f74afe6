"""Shared pieces of the benchmarks: the models, interleaved timing, memory.

Every benchmark measures a DP variant and its non-private counterpart in the
same process, alternating between them so machine noise hits both alike,
and reports the ratio of medians (and of TF allocator peaks), never an
absolute time alone.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Dict, Optional

from absl import flags
import keras
import numpy as np
import tensorflow as tf

from benchmarks import models


BATCH = flags.DEFINE_integer("batch_size", 256, "Examples per step.")
STEPS = flags.DEFINE_integer("steps", 10, "Steps per timing round.")
ROUNDS = flags.DEFINE_integer("rounds", 7, "Alternating timing rounds.")
MODELS_FLAG = flags.DEFINE_list("models", ["mlp", "cnn"], "Models to run.")
JIT = flags.DEFINE_bool("jit_compile", False, "Compile both with XLA.")


# The architectures are `benchmarks.models`' (one definition for every
# benchmark), built here with Keras 3.
MODELS = {name: functools.partial(models.build, keras, name)
          for name in ("mlp", "cnn")}


def batch(name: str, batch_size: int, seed: int = 0):
  """A fixed random batch `(x, y)` of NumPy arrays for model `name`."""
  return models.batch(name, batch_size, seed=seed)


def _sync(result):
  for t in tf.nest.flatten(result):
    if hasattr(t, "numpy"):
      t.numpy()


def interleaved_median(fns: Dict[str, Callable[[], object]], steps: int,
                       rounds: int, warmup: int = 3) -> Dict[str, float]:
  """Median seconds per call of each fn, timed in alternating rounds."""
  for fn in fns.values():
    for _ in range(warmup):
      _sync(fn())
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, fn in fns.items():
      start = time.perf_counter()
      for _ in range(steps):
        out = fn()
      _sync(out)
      times[k].append((time.perf_counter() - start) / steps)
  return {k: float(np.median(v)) for k, v in times.items()}


def peak_memory(fn: Callable[[], object]) -> Optional[int]:
  """TF CPU allocator peak bytes during one call of `fn` (already traced).

  None where the CPU allocator keeps no statistics (some builds raise
  `Cannot reset memory stats for device 'CPU:0'`); the suite
  (`python -m benchmarks`) then reports the peak RSS of a subprocess.
  """
  from benchmarks import memory  # noqa: PLC0415
  has_stats = memory.reset_allocator_stats()
  _sync(fn())
  return memory.allocator_peak_bytes() if has_stats else None


def measure(build: Callable[[str, int, bool], Dict[str, Callable]],
            name: str, batch_size: int, steps: int, rounds: int,
            jit_compile: bool = False) -> dict:
  """Times the step functions `build` returns ("plain", "dp", optionally
  "noise") and measures the memory of "plain" and "dp"."""
  keras.utils.set_random_seed(0)
  fns = build(name, batch_size, jit_compile)
  t = interleaved_median(fns, steps, rounds)
  mem = {k: peak_memory(fns[k]) for k in ("plain", "dp")}
  result = {"model": name, "time_plain_ms": 1e3 * t["plain"],
            "time_dp_ms": 1e3 * t["dp"], "time_ratio": t["dp"] / t["plain"],
            "mem_ratio": (mem["dp"] / mem["plain"]
                          if mem["dp"] and mem["plain"] else float("nan"))}
  if "noise" in t:
    result["noise_ratio"] = t["noise"] / t["plain"]
  return result


def report(label: str, what: str, build) -> None:
  """Runs `measure` for each --models entry and prints one line each."""
  for name in MODELS_FLAG.value:
    r = measure(build, name, BATCH.value, STEPS.value, ROUNDS.value,
                JIT.value)
    print(f"{label} {r['model']} B={BATCH.value} jit={JIT.value}: {what} "
          f"time {r['time_ratio']:.2f}x "
          f"({r['time_dp_ms']:.2f} / {r['time_plain_ms']:.2f} ms), "
          f"peak memory {r['mem_ratio']:.2f}x" +
          (f"; drawing the noise alone {r['noise_ratio']:.2f}x"
           if "noise_ratio" in r else ""), flush=True)
