r"""Where a step's peak memory goes: the tensors live at the peak, by op.

Runs one step of a mode (after warm-up) under the TF profiler in a process
whose CPU tensors all come from one BFC allocator
(`benchmarks.memory.ALLOCATOR_ENV`), which records each allocation and
free with its op and shape. Replaying them in time order gives the bytes
requested and live at every moment; this prints the peak and the tensors
live then, grouped by op name (with step numbers folded: `lstm_cell_7/mul`
and `lstm_cell_12/mul` are one row) and shape, largest first. Tensors
allocated before the profiled step (weights, optimizer slots) are not
among the rows; `--steps` > 1 replays several steps in one trace.

  python -m benchmarks.memory_profile --model=lstm --mode=pxg
  python -m benchmarks.memory_profile --model=lstm --mode=keras --top=10
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Dict, List, Tuple

from absl import app
from absl import flags

from benchmarks import memory
from benchmarks import profile
from benchmarks import venv

_ALLOC, _FREE = "MemoryAllocation", "MemoryDeallocation"


@dataclasses.dataclass(frozen=True)
class Event:
  """One allocation (`size` > 0) or free (`size` 0) at time `ps`."""
  ps: int
  address: int
  size: int
  op: str
  shape: str


def allocation_events(trace_dir: str) -> List[Event]:
  """The trace's allocator events, in time order."""
  events = []
  for plane in profile.host_planes(trace_dir):
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    for line in plane.lines:
      for e in line.events:
        kind = plane.event_metadata[e.metadata_id].name
        if kind not in (_ALLOC, _FREE):
          continue
        stats = {}
        for s in e.stats:
          value = s.str_value or s.int64_value or s.uint64_value
          if s.ref_value:
            value = plane.stat_metadata[s.ref_value].name
          stats[stat_names[s.metadata_id]] = value
        events.append(Event(
            line.timestamp_ns * 1000 + e.offset_ps, int(stats.get("addr", 0)),
            int(stats.get("requested_bytes", 0)) if kind == _ALLOC else 0,
            str(stats.get("tf_op", "?")), str(stats.get("shape", ""))))
  events.sort(key=lambda ev: ev.ps)
  return events


def live_at_peak(events: List[Event]) -> Tuple[int, Dict[tuple, int]]:
  """(peak bytes live, {(op with step numbers folded, shape): bytes}) at
  the moment the requested bytes live reach their peak."""
  live: Dict[int, Event] = {}
  current = peak = 0
  at_peak: Dict[int, Event] = {}
  for ev in events:
    if ev.size:
      live[ev.address] = ev
      current += ev.size
      if current > peak:
        peak, at_peak = current, dict(live)
    elif ev.address in live:
      current -= live.pop(ev.address).size
  groups = collections.Counter()
  for ev in at_peak.values():
    groups[(re.sub(r"_\d+", "_N", ev.op), ev.shape)] += ev.size
  return peak, dict(groups)


def _define_flags():
  """Flags, defined only when run as a program."""
  return dict(
      model=flags.DEFINE_string("model", "lstm", "Benchmark model."),
      mode=flags.DEFINE_string("mode", "pxg", "Benchmark mode."),
      steps=flags.DEFINE_integer("steps", 1, "Profiled steps."),
      top=flags.DEFINE_integer("top", 15, "Rows to print."))


_FLAGS = {}


def main(argv):
  del argv
  venv.setup_process_env()
  f = {k: v.value for k, v in _FLAGS.items()}
  with profile.trace(f["model"], f["mode"], f["steps"]) as trace_dir:
    events = allocation_events(trace_dir)
  if not events:
    print("The profiler recorded no allocations (is the BFC allocator on?).")
    return
  peak, groups = live_at_peak(events)
  print(f"{f['model']} / {f['mode']}: {peak / 2**20:.2f} MB live at the "
        "peak (allocated during the profiled steps)")
  for (op, shape), size in sorted(groups.items(),
                                  key=lambda kv: -kv[1])[:f["top"]]:
    print(f"{size / 2**20:8.2f} MB  {op} {shape}")


if __name__ == "__main__":
  os.environ.update(memory.ALLOCATOR_ENV)
  _FLAGS.update(_define_flags())
  app.run(main)
