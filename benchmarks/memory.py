r"""Peak memory of one mode's training step, in a process of its own.

  python -m benchmarks.memory --mode=pxg --model=cnn --batch_size=256

Prints one JSON line (the last line of stdout) with:
* `rss_peak_mb`: the process's peak resident set (VmHWM) over its whole
  life, including TensorFlow itself (not getrusage's ru_maxrss, which
  Linux carries over from the parent that forked the process);
* `rss_base_mb`: its resident set after imports and model building, before
  the first step (so `rss_peak_mb - rss_base_mb` is what tracing and
  running the step added);
* `rss_steps_peak_mb`: the peak over the timed steps alone, after resetting
  VmHWM (Linux `clear_refs`), or null where that is not possible;
* `alloc_peak_mb`: the TF CPU allocator's peak during the timed steps, or
  null where the allocator keeps no statistics (some builds raise
  `Cannot reset memory stats for device 'CPU:0'`).

The process runs with `ALLOCATOR_ENV`: all CPU tensors come from one BFC
allocator, whose statistics count every allocation. TF's default CPU
allocator with oneDNN (`MklCPUAllocator`) hands allocations below a size
threshold to a separate small-size allocator that keeps no statistics by
default, so its peak leaves out every tensor under the threshold: 64 live
`[64, 128]` float32 tensors (32 KB each) and their 2 MB stack measure
2.0 MB there and 6.0 MB with the BFC allocator (4 MB or more is right).
That hid most of a recurrent Keras step's memory (its per-step tensors
are small) and none of a DP step's large row tensors: the LSTM's ratio
read 2.77x where every allocation counted gives 1.73x (before this
round's changes). `tests/test_benchmarks_smoke.py` checks that small
tensors count.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from absl import app
from absl import flags

from benchmarks import venv

# Set before TensorFlow is imported (see the module docstring).
ALLOCATOR_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def _define_flags():
  """The command line's flags (defined only when run as a program, so that
  importing this module next to other benchmarks' flags does not clash)."""
  return dict(
      mode=flags.DEFINE_string("mode", "keras", "A mode of benchmarks.modes."),
      model=flags.DEFINE_string("model", "mlp",
                                "A model of benchmarks.models."),
      batch_size=flags.DEFINE_integer("batch_size", 0,
                                      "0: the model's default."),
      seq_len=flags.DEFINE_integer("seq_len", 0, "0: the model's default."),
      size=flags.DEFINE_enum("size", "full", ["full", "small", "tiny"],
                             "Model size (tiny: the smoke test's)."),
      steps=flags.DEFINE_integer("steps", 3, "Steps measured after warm-up."))


def _status_kb(field: str) -> Optional[int]:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def _mb(kb: Optional[int]) -> Optional[float]:
  return None if kb is None else kb / 1024.0


def _reset_hwm() -> bool:
  """Resets the peak resident set (VmHWM) to the current one (Linux)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def reset_allocator_stats() -> bool:
  """Resets the TF CPU allocator's peak; False where it keeps no stats."""
  import tensorflow as tf  # noqa: PLC0415
  try:
    tf.config.experimental.reset_memory_stats("CPU:0")
    return True
  except (ValueError, RuntimeError, tf.errors.OpError):
    return False


def allocator_peak_bytes() -> Optional[int]:
  """The TF CPU allocator's peak bytes, or None where it keeps no stats."""
  import tensorflow as tf  # noqa: PLC0415
  try:
    return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
  except (ValueError, RuntimeError, KeyError, tf.errors.OpError):
    return None


def measure(mode: str, model: str, batch_size: int, seq_len: int,
            steps: int, size: str = "full") -> dict:
  """Builds `mode` for `model`, runs warm-up and `steps` steps; memory."""
  from benchmarks import models  # noqa: PLC0415
  from benchmarks import modes  # noqa: PLC0415
  result = {"mode": mode, "model": model}
  try:
    batch_size = batch_size or models.SPECS[model].batch
    result.update(batch_size=batch_size,
                  seq_len=seq_len or models.SPECS[model].seq_len or None)
    step = modes.make(mode, model, batch_size, seq_len, size=size)
    result["rss_base_mb"] = _mb(_status_kb("VmRSS"))
    modes.sync(step.fn())
    modes.sync(step.fn())
    has_alloc = reset_allocator_stats()
    warmup_peak = _status_kb("VmHWM")
    has_hwm = _reset_hwm()
    for _ in range(steps):
      modes.sync(step.fn())
  except Exception as exc:  # noqa: BLE001 (reported)
    from benchmarks import timing  # noqa: PLC0415
    result.update(status="unsupported" if isinstance(exc, NotImplementedError)
                  else "error", error=timing.error_message(exc))
    return result
  alloc = allocator_peak_bytes() if has_alloc else None
  steps_peak = _status_kb("VmHWM")
  result.update(
      status="ok",
      rss_peak_mb=_mb(max(warmup_peak or 0, steps_peak or 0) or None),
      rss_steps_peak_mb=_mb(steps_peak) if has_hwm else None,
      alloc_peak_mb=None if alloc is None else alloc / 2**20)
  return result


_FLAGS = {}


def main(argv):
  del argv
  venv.setup_process_env()
  result = measure(**{k: v.value for k, v in _FLAGS.items()})
  sys.stdout.write(json.dumps(result) + "\n")
  sys.stdout.flush()
  os._exit(0)  # skip TF's slow teardown


if __name__ == "__main__":
  os.environ.update(ALLOCATOR_ENV)
  _FLAGS.update(_define_flags())
  app.run(main)
