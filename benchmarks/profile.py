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
import contextlib
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
  totals = collections.defaultdict(lambda: [0.0, 0])
  for plane in host_planes(trace_dir):
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


@contextlib.contextmanager
def trace(model: str, mode: str, steps: int, batch: int = 0):
  """Runs 3 warm-up steps of `mode` on `model`, then `steps` steps under the
  TF profiler; yields the trace directory (deleted afterwards)."""
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
    yield trace_dir


def host_planes(trace_dir: str):
  """The `/host:CPU` planes (XPlane protobufs) of a profiler trace."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415
  for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                        recursive=True):
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
      space.ParseFromString(f.read())
    for plane in space.planes:
      if plane.name.startswith("/host:CPU"):
        yield plane


def profile(model: str, mode: str, steps: int, batch: int = 0):
  """Profiles `steps` steps of `mode` on `model`; returns `op_times`."""
  with trace(model, mode, steps, batch) as trace_dir:
    return op_times(trace_dir)


def _define_flags():
  """Flags, defined only when run as a program (importing this module next
  to other benchmarks' flags must not clash)."""
  return dict(
      model=flags.DEFINE_string("model", "mlp", "Benchmark model."),
      mode=flags.DEFINE_string("mode", "pxg", "Benchmark mode."),
      steps=flags.DEFINE_integer("steps", 20, "Profiled steps."),
      top=flags.DEFINE_integer("top", 25, "Ops to print."),
      by_type=flags.DEFINE_bool("by_type", False, "Group ops by type."))


_FLAGS = {}


def report(times, steps: int, top: int, by_type: bool = False) -> list:
  """Lines `ms/step share% xcalls name`, largest first."""
  if by_type:
    grouped = collections.defaultdict(lambda: [0.0, 0])
    for name, (us, n) in times.items():
      kind = name.rsplit(":", 1)[1]
      grouped[kind][0] += us
      grouped[kind][1] += n
    times = grouped
  total = sum(us for us, _ in times.values()) or 1.0
  return [f"{us / steps / 1e3:8.3f} ms {100 * us / total:5.1f}% "
          f"x{n / steps:5.1f}  {name}"
          for name, (us, n) in sorted(times.items(),
                                      key=lambda kv: -kv[1][0])[:top]]


def main(argv):
  del argv
  venv.setup_process_env()
  f = {k: v.value for k, v in _FLAGS.items()}
  times = profile(f["model"], f["mode"], f["steps"])
  total = sum(us for us, _ in times.values())
  print(f"{f['model']} / {f['mode']}: {total / f['steps'] / 1e3:.2f} ms of "
        "op time per step")
  print("\n".join(report(times, f["steps"], f["top"], f["by_type"])))


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)
