r"""Where a benchmark step's time goes: TF profiler op times, by op.

Runs `--steps` steps of one mode (see `benchmarks.modes`) under
`tf.profiler.experimental`, reads the trace (an XSpace protobuf) and prints
the ops' summed durations on the host, largest first, with each op's
share of the summed op time and its count per step. Ops run on two cores,
so the shares are of busy time, not of wall time.

  python -m benchmarks.profile --model=embed --mode=pxg
  python -m benchmarks.profile --model=cnn --mode=keras --top=15

`--families` groups the op time of the step by what the op is for
(`families`), from the step's graph:

  python -m benchmarks.profile --model=convnext --mode=pxg --families

* `forward`: the model's forward pass and the loss (ancestors of the ops in
  Keras' `compile_loss` scope);
* `backward`: the backward pass that leads to the update without going
  through the clip factors: output gradients propagated through the model
  (in a DP step, also anything the norms and the weighted sums share, e.g.
  materialised per-example gradients); in Keras' step, all of it;
* `clip norms`: ops that lead to the update only through the clip factors
  (per-example norms, e.g. Gram matrices of activations, their sum, the
  factors themselves);
* `weighted sums`: ops downstream of the clip factors up to the noise
  (scaling rows by the factors, the clipped sums, zeroing non-finite
  examples' rows);
* `noise`: drawing and adding the Gaussian noise (tf_pxg's native noise
  ops and the generator's key);
* `optimizer`: the update after the noise (Keras' optimizer scope);
* `other`: metrics, shapes, constants, and op events not found in the
  graph (e.g. ops Grappler created).

The families need the step's graph, so this mode profiles `model.train_step`
in a `tf.function` of its own (what `fit` runs per step, without the
iterator) rather than `model.train_function`. XLA clusters inside the step
(tf_pxg compiles some norms with XLA) are attributed to the op that
launched them.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import re
import tempfile

from absl import app
from absl import flags

from benchmarks import modes
from benchmarks import venv

# Host threads whose events are TF ops; names are "<op name>:<op type>".
_OP_LINES = ("tf_Compute", "tf_inter_op", "tf_XLA")


def _stat(plane, event, key: str):
  for s in event.stats:
    if plane.stat_metadata[s.metadata_id].name == key:
      return s.str_value or (plane.stat_metadata[s.ref_value].name
                             if s.ref_value else None)
  return None


def op_times(trace_dir: str, name_xla: bool = False):
  """{"name:type": (total microseconds, count)} from a profiler run.

  XLA executions are `(XLA cluster):XlaLaunch`, or with `name_xla`
  `<launching op>:XlaLaunch` where the trace names the op (the executor's
  asynchronous span that encloses the execution).
  """
  totals = collections.defaultdict(lambda: [0.0, 0])
  for plane in host_planes(trace_dir):
    for line in plane.lines:
      if not line.name.startswith(_OP_LINES):
        continue
      launches = []  # (start, end, op name) of asynchronous op spans
      if name_xla:
        for event in line.events:
          if (plane.event_metadata[event.metadata_id].name
              == "ExecutorState::ProcessAsync::Start"):
            launches.append((event.offset_ps,
                             event.offset_ps + event.duration_ps,
                             _stat(plane, event, "name")))
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        if name.startswith("CpuExecutable::Execute"):
          launcher = [n for start, end, n in launches
                      if start <= event.offset_ps and n and
                      event.offset_ps + event.duration_ps <= end]
          name = f"{launcher[-1] if launcher else '(XLA cluster)'}:XlaLaunch"
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


FAMILIES = ("forward", "backward", "clip norms", "weighted sums", "noise",
            "optimizer", "other")
_RNG_TYPES = re.compile(r"^(Rng|StatelessRandom|StatefulUniform|"
                        r"StatefulStandardNormal|RandomUniform)")


def _closure(seeds, edges):
  """`seeds` and everything reachable from them along `edges`."""
  seen, stack = set(seeds), list(seeds)
  while stack:
    for nxt in edges.get(stack.pop(), ()):
      if nxt not in seen:
        seen.add(nxt)
        stack.append(nxt)
  return seen


def graph_families(graph, optimizer_name: str = "") -> dict:
  """{op name: family} for the top-level ops of a train step's graph.

  See the module doc for the families. The clip factors are the rank-1
  `SelectV2`/`Select` ops fed by `IsFinite` (`tf_pxg.dp.clipping`); a graph
  without them (a non-private step) has no `clip norms` or `weighted sums`.
  """
  ops = graph.get_operations()
  parents = {o.name: [t.op.name for t in o.inputs] for o in ops}
  children = collections.defaultdict(list)
  for o, ins in parents.items():
    for i in ins:
      children[i].append(o)
  by_name = {o.name: o for o in ops}
  family = {}
  loss = {n for n in by_name if n.startswith("compile_loss/")}
  # Random ops the loss depends on (dropout masks) are the forward pass's.
  before_loss = _closure(loss, parents)
  noise = {o.name for o in ops
           if (re.match(r"^TfPxg\w*Noise", o.type) or _RNG_TYPES.match(o.type)
               or o.name.split("/")[0].startswith("stateful_uniform"))
           and o.name not in before_loss}
  opt_scope = re.compile(
      rf"^{re.escape(optimizer_name.lower())}(_\d+)?/", re.I) if (
          optimizer_name) else None
  optimizer = (_closure(noise, children) - noise) | {
      n for n in by_name if opt_scope and opt_scope.match(n)}
  forward = before_loss - noise - optimizer
  factors = {o.name for o in ops if o.type in ("SelectV2", "Select")
             and o.outputs and o.outputs[0].shape.rank == 1
             and any(t.op.type == "IsFinite" for t in o.inputs)}
  sums = (_closure(factors, children) - factors - noise - optimizer
          - forward)
  # What leads to the update without passing through a clip factor.
  no_factor = {k: [p for p in v if p not in factors]
               for k, v in parents.items()}
  shared = _closure(sums | noise | optimizer, no_factor)
  norms = _closure(factors, parents) - forward - shared
  backward = shared - forward - sums - noise - optimizer
  for names, fam in ((forward, "forward"), (noise, "noise"),
                     (optimizer, "optimizer"), (norms, "clip norms"),
                     (sums, "weighted sums"), (backward, "backward")):
    for n in names:
      family.setdefault(n, fam)
  for n in by_name:
    family.setdefault(n, "other")
  return family


def _scope_families(family: dict) -> dict:
  """{scope: most common family of the ops under it}."""
  counts = collections.defaultdict(collections.Counter)
  for name, fam in family.items():
    parts = name.split("/")
    for i in range(1, len(parts)):
      counts["/".join(parts[:i])][fam] += 1
  return {k: c.most_common(1)[0][0] for k, c in counts.items()}


def attribute(event_name: str, family: dict, scopes: dict) -> str:
  """The family of a profiled op (`name` of `name:type`): the graph op
  with the longest run of matching name components (runtime names carry
  call prefixes such as `StatefulPartitionedCall/`; ops inside a cond,
  loop or XLA cluster take their launching op's family), else the family
  most common under its longest known scope, else `other`."""
  parts = event_name.split("/")
  best, best_len = None, 0
  for i in range(len(parts)):
    for j in range(len(parts), i, -1):
      if j - i <= best_len:
        break
      candidate = "/".join(parts[i:j])
      if candidate in family:
        best, best_len = family[candidate], j - i
        break
  if best:
    return best
  for i in range(len(parts)):
    for j in range(len(parts) - 1, i, -1):
      candidate = "/".join(parts[i:j])
      if candidate in scopes:
        return scopes[candidate]
  return "other"


def profile_families(model: str, mode: str, steps: int, batch: int = 0,
                     size: str = "full") -> dict:
  """Op time per family of `steps` steps of `mode` on `model`.

  Returns:
    {"model", "mode", "batch_size", "steps", "op_ms_per_step" (all ops),
    "wall_ms_per_step" (the profiled steps' wall time, profiler on),
    "families": {family: ms per step}, "ops": number of graph ops,
    "top": [(ms per step, family, op)] the 15 largest ops}.
  """
  import time  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  batch = batch or models.SPECS[model].batch
  step = modes.make(mode, model, batch, size=size)
  x, y = (tf.constant(a) for a in models.batch(model, batch, size=size))
  keras_model = step.model
  # The batch is an argument: tf_pxg needs the examples as a graph input
  # (a captured eager tensor would become a constant).
  fn = tf.function(lambda x, y: keras_model.train_step((x, y)))
  graph = fn.get_concrete_function(x, y).graph
  optimizer = getattr(keras_model, "optimizer", None)
  family = graph_families(graph, getattr(optimizer, "name", "") or "")
  scopes = _scope_families(family)
  for _ in range(3):
    modes.sync(fn(x, y))
  with tempfile.TemporaryDirectory() as trace_dir:
    tf.profiler.experimental.start(trace_dir)
    start = time.perf_counter()
    for _ in range(steps):
      modes.sync(fn(x, y))
    wall = (time.perf_counter() - start) / steps
    tf.profiler.experimental.stop()
    times = op_times(trace_dir, name_xla=True)
  totals = collections.Counter()
  top = []
  for key, (us, _) in times.items():
    name = key.rsplit(":", 1)[0]
    fam = attribute(name, family, scopes)
    totals[fam] += us / steps / 1e3
    top.append((round(us / steps / 1e3, 3), fam, key))
  return {"model": model, "mode": mode, "batch_size": batch, "steps": steps,
          "op_ms_per_step": sum(totals.values()),
          "wall_ms_per_step": 1e3 * wall,
          "families": {f: totals.get(f, 0.0) for f in FAMILIES},
          "ops": len(family),
          "top": sorted(top, reverse=True)[:15]}


def _define_flags():
  """Flags, defined only when run as a program (importing this module next
  to other benchmarks' flags must not clash)."""
  return dict(
      model=flags.DEFINE_string("model", "mlp", "Benchmark model."),
      mode=flags.DEFINE_string("mode", "pxg", "Benchmark mode."),
      steps=flags.DEFINE_integer("steps", 20, "Profiled steps."),
      top=flags.DEFINE_integer("top", 25, "Ops to print."),
      by_type=flags.DEFINE_bool("by_type", False, "Group ops by type."),
      families=flags.DEFINE_bool("families", False,
                                 "Op time per family (see module doc)."),
      size=flags.DEFINE_enum("size", "full", ["full", "small", "tiny"],
                             "Model size (--families)."),
      batch_size=flags.DEFINE_integer("batch_size", 0, "0: the model's."),
      json=flags.DEFINE_bool("json", False, "--families: print one JSON "
                             "line."))


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
  if f["families"]:
    out = profile_families(f["model"], f["mode"], f["steps"],
                           f["batch_size"], f["size"])
    if f["json"]:
      print(json.dumps(out), flush=True)
      os._exit(0)  # skip TF's slow teardown
    print(f"{f['model']} / {f['mode']}: {out['op_ms_per_step']:.2f} ms of "
          f"op time per step ({out['wall_ms_per_step']:.1f} ms wall, "
          "profiler on)")
    for fam, ms in out["families"].items():
      print(f"{ms:9.3f} ms {100 * ms / (out['op_ms_per_step'] or 1):5.1f}%"
            f"  {fam}")
    print("largest ops:")
    for ms, fam, name in out["top"][:f["top"]]:
      print(f"{ms:9.3f} ms  {fam:13s} {name}")
    return
  times = profile(f["model"], f["mode"], f["steps"])
  total = sum(us for us, _ in times.values())
  print(f"{f['model']} / {f['mode']}: {total / f['steps'] / 1e3:.2f} ms of "
        "op time per step")
  print("\n".join(report(times, f["steps"], f["top"], f["by_type"])))


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)
