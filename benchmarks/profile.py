r"""Where a benchmark step's time goes: TF profiler op times, by op.

Runs `--steps` steps of one mode (see `benchmarks.modes`) under
`tf.profiler.experimental`, reads the trace (an XSpace protobuf) and prints
the ops' summed durations on the host, largest first, with each op's
share of the summed op time and its count per step. Ops run on two cores,
so the shares are of busy time, not of wall time.

  python -m benchmarks.profile --model=embed --mode=pxg
  python -m benchmarks.profile --model=cnn --mode=keras --top=15
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

from absl import app
from absl import flags

from benchmarks import modes
from benchmarks import venv

# Host threads whose events are TF ops; names are "<op name>:<op type>".
_OP_LINES = ("tf_Compute", "tf_inter_op", "tf_XLA")


def op_times(trace_dir: str):
  """{"name:type": (total microseconds, count)} from a profiler run."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415
  totals = collections.defaultdict(lambda: [0.0, 0])
  for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                        recursive=True):
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
    for plane in space.planes:
      if not plane.name.startswith("/host:CPU"):
        continue
      for line in plane.lines:
        if not line.name.startswith(_OP_LINES):
          continue
        for event in line.events:
          name = plane.event_metadata[event.metadata_id].name
          if name.startswith("CpuExecutable::Execute"):
            name = "(XLA cluster):XlaLaunch"
          elif name.startswith("ExecutorState") or ":" not in name:
            continue  # the executor's own spans enclose the ops' spans
          totals[name][0] += event.duration_ps / 1e6
          totals[name][1] += 1
  return dict(totals)


def profile(model: str, mode: str, steps: int, batch: int = 0):
  """Profiles `steps` steps of `mode` on `model`; returns `op_times`."""
  import tensorflow as tf  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  step = modes.make(mode, model, batch or models.SPECS[model].batch)
  for _ in range(3):
    modes.sync(step.fn())
  with tempfile.TemporaryDirectory() as trace_dir:
    tf.profiler.experimental.start(trace_dir)
    for _ in range(steps):
      modes.sync(step.fn())
    tf.profiler.experimental.stop()
    return op_times(trace_dir)


_MODEL = flags.DEFINE_string("model", "mlp", "Benchmark model.")
_MODE = flags.DEFINE_string("mode", "pxg", "Benchmark mode.")
_STEPS = flags.DEFINE_integer("steps", 20, "Profiled steps.")
_TOP = flags.DEFINE_integer("top", 25, "Ops to print.")
_BY_TYPE = flags.DEFINE_bool("by_type", False, "Group ops by type.")


def main(argv):
  del argv
  venv.setup_process_env()
  times = profile(_MODEL.value, _MODE.value, _STEPS.value)
  if _BY_TYPE.value:
    grouped = collections.defaultdict(lambda: [0.0, 0])
    for name, (us, n) in times.items():
      grouped[name.rsplit(":", 1)[1]][0] += us
      grouped[name.rsplit(":", 1)[1]][1] += n
    times = grouped
  total = sum(us for us, _ in times.values())
  print(f"{_MODEL.value} / {_MODE.value}: {total / _STEPS.value / 1e3:.2f} "
        f"ms of op time per step")
  for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[
      :_TOP.value]:
    print(f"{us / _STEPS.value / 1e3:8.3f} ms {100 * us / total:5.1f}% "
          f"x{n / _STEPS.value:5.1f}  {name}")


if __name__ == "__main__":
  app.run(main)
