"""Interleaved timing of several training steps in one process.

All steps of a group are built first, then timed in rounds: each round runs
every step `n` times back to back (its own `n`, calibrated so a round of each
takes about the same wall time). Machine noise — other processes on the two
cores, frequency changes — drifts slowly, so it hits a DP step and its
baseline in the same round alike; a DP/baseline ratio is taken per round and
the median over rounds is reported.

Both wall time and the process's CPU time (all threads) are recorded. On a
machine shared with other work, wall time includes waiting for a core,
while CPU time counts only this process's work (it also counts threads that
spin while waiting for work, so it is not a pure FLOP count); the two ratios
bracket the truth, and they agree on an idle machine.
"""

from __future__ import annotations

import re
import time
import traceback
from typing import Callable, Dict, Optional

import numpy as np

from benchmarks import modes as modes_lib


def error_message(exc: BaseException) -> str:
  """One line: the exception type, its first line and (TF's "in user code"
  traces) its last line, which holds the actual message."""
  lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
  text = type(exc).__name__ + ": " + (lines[0] if lines else "")
  if len(lines) > 1:
    text += " ... " + lines[-1]
  return text[:500]


_CRASH = re.compile(r"free\(\)|malloc|corruption|Segmentation|"
                    r"RESOURCE_EXHAUSTED|Out of memory|Killed")
_ERROR = re.compile(r"Fatal|Aborted|[A-Za-z]*Error\b")


def process_failure_line(text: str) -> str:
  """The most telling line of a dead process's output: the last line that
  names a crash (glibc's abort message, out of memory), else the last that
  names an error (`...Error: ...`), skipping Python's list of extension
  modules; else the last line."""
  lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()
           and not ln.startswith("Extension modules")]
  crash = [ln for ln in lines if _CRASH.search(ln)]
  error = [ln for ln in lines if _ERROR.search(ln)]
  return ((crash or error or lines or ["(no output)"])[-1])[:400]


def _error(exc: BaseException) -> dict:
  return {"status": "unsupported" if isinstance(exc, NotImplementedError)
                    else "error",
          "error": error_message(exc),
          "traceback_tail": traceback.format_exc().strip().splitlines()[-3:]}


def _time_calls(fn: Callable[[], object], n: int, sync=None):
  """(wall seconds, CPU seconds) per call, over `n` calls; `sync` waits for
  a step's outputs (default `modes.sync`, TensorFlow's)."""
  start, cpu = time.perf_counter(), time.process_time()
  out = None
  for _ in range(n):
    out = fn()
  (sync or modes_lib.sync)(out)
  return ((time.perf_counter() - start) / n,
          (time.process_time() - cpu) / n)


def build_group(names, make: Callable[[str], modes_lib.Step],
                log=print, sync=None) -> Dict[str, object]:
  """Builds and warms up each mode; a failure becomes a status record.

  Logs `    building <mode>` before each mode, so that a parent process can
  tell which mode was being built when this process died.
  """
  sync = sync or modes_lib.sync
  built = {}
  for name in names:
    start = time.perf_counter()
    log(f"    building {name}")
    try:
      step = make(name)
      sync(step.fn())  # traces/compiles
      sync(step.fn())
      built[name] = step
      log(f"    built {name} in {time.perf_counter() - start:.1f} s")
    except Exception as exc:  # noqa: BLE001 (reported, not hidden)
      built[name] = _error(exc)
      log(f"    {name}: {built[name]['status']}: {built[name]['error']}")
  return built


def run_rounds(built: Dict[str, object], rounds: int,
               round_seconds: float, max_calls: int = 200,
               sync=None) -> Dict[str, dict]:
  """Times the built steps in `rounds` interleaved rounds.

  Returns:
    For each mode: `{"status": "ok", "ms": median ms per step, "round_ms":
    [per round], "calls_per_round": n}`, or the build's failure record.
  """
  steps = {k: v for k, v in built.items()
           if isinstance(v, modes_lib.Step)}
  calls = {}
  for k, step in steps.items():
    once, _ = _time_calls(step.fn, 1, sync)
    calls[k] = int(max(1, min(max_calls, round(round_seconds / once))))
  times = {k: [] for k in steps}
  cpu = {k: [] for k in steps}
  order = list(steps)
  for r in range(rounds):
    # Rotate the order so no mode always runs right after the same one.
    shift = r % max(1, len(order))
    for k in order[shift:] + order[:shift]:
      wall_s, cpu_s = _time_calls(steps[k].fn, calls[k], sync)
      times[k].append(wall_s)
      cpu[k].append(cpu_s)
  out = {}
  for k, v in built.items():
    if k in steps:
      out[k] = {"status": "ok", "ms": 1e3 * float(np.median(times[k])),
                "round_ms": [1e3 * t for t in times[k]],
                "cpu_ms": 1e3 * float(np.median(cpu[k])),
                "round_cpu_ms": [1e3 * t for t in cpu[k]],
                "calls_per_round": calls[k], **steps[k].info}
    else:
      out[k] = v
  return out


def _round_ratios(r: dict, base: dict) -> dict:
  per_round = np.array(r["round_ms"]) / np.array(base["round_ms"])
  cpu_round = np.array(r["round_cpu_ms"]) / np.array(base["round_cpu_ms"])
  return {"ratio": float(np.median(per_round)),
          "ratio_min_max": [float(per_round.min()), float(per_round.max())],
          "cpu_ratio": float(np.median(cpu_round))}


def add_ratios(results: Dict[str, dict],
               baseline: Optional[Dict[str, str]] = None,
               alt_baseline: Optional[Dict[str, tuple]] = None) -> None:
  """Adds each mode's `ratio` to its baseline: median of per-round ratios;
  and `ratio_to[alt]` for each further baseline of `alt_baseline` (default
  `modes.ALT_BASELINE`) that ran."""
  baseline = baseline or modes_lib.BASELINE
  alt_baseline = (modes_lib.ALT_BASELINE if alt_baseline is None
                  else alt_baseline)
  for k, r in results.items():
    for alt in alt_baseline.get(k, ()):
      base = results.get(alt)
      if (r.get("status") == "ok" and base and
          base.get("status") == "ok"):
        r.setdefault("ratio_to", {})[alt] = _round_ratios(r, base)
  for k, r in results.items():
    base = results.get(baseline.get(k, ""))
    if r.get("status") != "ok" or not base or base.get("status") != "ok":
      continue
    per_round = np.array(r["round_ms"]) / np.array(base["round_ms"])
    r["baseline"] = baseline[k]
    r["ratio"] = float(np.median(per_round))
    r["ratio_min_max"] = [float(per_round.min()), float(per_round.max())]
    cpu_round = np.array(r["round_cpu_ms"]) / np.array(base["round_cpu_ms"])
    r["cpu_ratio"] = float(np.median(cpu_round))
