r"""One model's timing group in a process of its own (used by the suite).

  python -m benchmarks.time_group --model=convnext \
      --modes=keras,pxg,tf_keras,tfp_dpmodel --batch_size=32

Builds every mode of `--modes` in this process and times them in
interleaved rounds (`benchmarks.timing`), exactly as the suite used to do in
its own process; prints one JSON line `{"modes": {...}}` as the last line
of stdout. Run with the benchmark venv's interpreter (TF Privacy modes).

Why a process per model: a real model's modes hold gigabytes (TF Privacy's
`vectorized_map` fallback on ConvNeXt), which are returned when the process
ends; and a mode can kill its process (TF Privacy's DPModel on the tiny
WRN-GN aborts in glibc's malloc), which would end the whole suite.
`run()` (in the suite's process) re-runs the group without a mode that
killed the process while it was being built or warmed up, and records it
as `crashed`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from absl import app
from absl import flags


def _define_flags():
  return dict(
      model=flags.DEFINE_string("model", "mlp", "benchmarks.models name."),
      modes=flags.DEFINE_list("modes", ["keras", "pxg"], "Modes to time."),
      batch_size=flags.DEFINE_integer("batch_size", 0, "0: the model's."),
      seq_len=flags.DEFINE_integer("seq_len", 0, "0: the model's."),
      size=flags.DEFINE_enum("size", "full", ["full", "small", "tiny"], "Model size."),
      rounds=flags.DEFINE_integer("rounds", 5, "Timing rounds."),
      round_seconds=flags.DEFINE_float("round_seconds", 0.6,
                                       "Wall time per mode and round."))


_FLAGS = {}


def _log(*args):
  print(*args, file=sys.stderr, flush=True)


def time_group(model: str, names, batch_size: int, seq_len: int,
               rounds: int, round_seconds: float, size: str = "full",
               log=_log) -> dict:
  """Builds `names` for `model` and times them; records with ratios."""
  from benchmarks import modes  # noqa: PLC0415
  from benchmarks import timing  # noqa: PLC0415
  built = timing.build_group(
      names, lambda m: modes.make(m, model, batch_size, seq_len, size=size),
      log=log)
  results = timing.run_rounds(built, rounds, round_seconds)
  timing.add_ratios(results)
  return results


def main(argv):
  del argv
  from benchmarks import models  # noqa: PLC0415
  from benchmarks import venv  # noqa: PLC0415
  venv.setup_process_env()
  f = {k: v.value for k, v in _FLAGS.items()}
  batch_size = f["batch_size"] or models.SPECS[f["model"]].batch
  out = {"modes": time_group(f["model"], list(f["modes"]), batch_size,
                             f["seq_len"], f["rounds"], f["round_seconds"],
                             f["size"])}
  sys.stdout.write(json.dumps(out) + "\n")
  sys.stdout.flush()
  os._exit(0)  # skip TF's slow teardown


def _building(stderr: str):
  """The mode being built when the process died: the last `building X`
  with no `built X` / `X: <status>` after it; None if all were built."""
  current = None
  for line in stderr.splitlines():
    m = re.match(r"\s+building (\S+)$", line)
    if m:
      current = m.group(1)
    elif current and re.match(rf"\s+(built {re.escape(current)} in|"
                              rf"{re.escape(current)}: )", line):
      current = None
  return current


def run(model: str, names, batch_size: int, seq_len: int, rounds: int,
        round_seconds: float, size: str = "full", timeout: float = 3600,
        log=print) -> dict:
  """Runs `time_group` in a subprocess (this interpreter); see module doc.

  Returns:
    `{mode: record}` for every name: the timing records, `crashed` for a
    mode that killed the process while being built (the others re-run
    without it), or an `error` record for all if the process died during
    the rounds or timed out.
  """
  from benchmarks import venv  # noqa: PLC0415
  names, out = list(names), {}
  while names:
    cmd = [sys.executable, "-m", "benchmarks.time_group", f"--model={model}",
           f"--modes={','.join(names)}", f"--batch_size={batch_size}",
           f"--seq_len={seq_len}", f"--size={size}", f"--rounds={rounds}",
           f"--round_seconds={round_seconds}"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                            cwd=str(venv.REPO), timeout=timeout)
    except subprocess.TimeoutExpired:
      out.update({n: {"status": "error", "error": f"timing process timed "
                      f"out after {timeout:.0f} s"} for n in names})
      break
    for line in proc.stderr.splitlines():
      if re.match(r"\s+(built |\S+: (error|unsupported))", line):
        log(line)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode == 0 and lines:
      out.update(json.loads(lines[-1])["modes"])
      break
    from benchmarks import timing  # noqa: PLC0415
    tail = [timing.process_failure_line(proc.stderr)]
    how = (f"signal {-proc.returncode}" if proc.returncode < 0
           else f"exit {proc.returncode}")
    culprit = _building(proc.stderr)
    if culprit is None:
      out.update({n: {"status": "error", "error": f"timing process died "
                      f"({how}) during the rounds: {tail[0][:300]}"}
                  for n in names})
      break
    out[culprit] = {"status": "crashed",
                    "error": f"the process died ({how}) while building or "
                             f"warming up this mode: {tail[0][:300]}"}
    log(f"    {culprit}: crashed ({how}): {tail[0][:200]}; re-running the "
        "others")
    names.remove(culprit)
  return out


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)
