r"""The benchmark suite: tf_pxg against Keras 3 and TensorFlow Privacy 0.9.0.

One command, from the repository root, with tf_pxg's venv:

  .venv/bin/python -m benchmarks            # full run, ~20-30 min on 2 cores
  .venv/bin/python -m benchmarks --quick    # < 5 min

It creates `benchmarks/.venv-tfp` on first use (see `benchmarks.venv`),
re-runs itself there, and then:

1. **Time**, per model (`benchmarks.models`): builds every mode
   (`benchmarks.modes`) in this one process and times them in interleaved
   rounds (`benchmarks.timing`); each DP mode's ratio to its own framework's
   non-private `fit` step is the median of per-round ratios.
2. **Cost growth**: the same DP / non-private ratios at batch 32, 128, 512
   (mlp, cnn) and sequence length 32, 128, 512 (transformer).
3. **Memory**: each mode in a subprocess of its own (`benchmarks.memory`):
   peak RSS and, where the allocator keeps statistics, the TF allocator's
   peak over a step.

Writes `benchmarks/results/{full,quick}.json`, a PNG chart and a Markdown
table (`benchmarks.report`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import gc
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from absl import app
from absl import flags

from benchmarks import memory
from benchmarks import venv

_QUICK = flags.DEFINE_bool("quick", False, "Fewer rounds, modes and points.")
_MODELS = flags.DEFINE_list(
    "models", [], "Models (default: all; --quick: all but lstm).")
_MODES = flags.DEFINE_list("modes", [], "Modes (default: all, or the quick "
                           "set with --quick).")
_ROUNDS = flags.DEFINE_integer("rounds", 0, "Timing rounds (0: 5, quick 3).")
_ROUND_SECONDS = flags.DEFINE_float(
    "round_seconds", 0, "Wall time of one mode per round (0: 0.6, quick 0.3).")
_SKIP = flags.DEFINE_list("skip", [],
                          "Parts to skip: time, growth, limits, memory.")
_OUT = flags.DEFINE_string("output_dir", "", "Default benchmarks/results.")
_MEMORY_JOBS = flags.DEFINE_integer(
    "memory_jobs", 2, "Memory subprocesses run at once.")
_NO_VENV = flags.DEFINE_bool(
    "no_venv", False, "Run in this interpreter (TF Privacy modes fail "
    "unless it has tensorflow-privacy).")

ALL_MODELS = ("mlp", "cnn", "embed", "transformer", "lstm")
QUICK_MODELS = ("mlp", "cnn", "embed", "transformer")
QUICK_MODES = ("keras", "pxg", "noise", "tf_keras", "tfp_dpmodel")
QUICK_MEMORY_MODES = ("keras", "pxg")
QUICK_GROWTH_SIZES = (32, 512)
GROWTH = {"mlp": ("batch", (32, 128, 512)), "cnn": ("batch", (32, 128, 512)),
          "transformer": ("seq_len", (32, 128, 512))}
GROWTH_MODES = ("keras", "pxg", "tf_keras", "tfp_dpmodel")
QUICK_GROWTH_MODES = ("keras", "pxg")


def _log(*args):
  print(*args, flush=True)


def machine() -> dict:
  """CPU model, cores, memory and load: where the numbers come from."""
  info = {"platform": platform.platform(), "python": platform.python_version(),
          "cores": os.cpu_count()}
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
      key, _, value = line.partition(":")
      if key.strip() in ("Model name", "Vendor ID", "L3 cache", "Flags"):
        value = value.strip()
        if key.strip() == "Flags":
          value = " ".join(f for f in value.split()
                           if f.startswith(("avx", "fma", "amx")))
        info[key.strip().lower().replace(" ", "_")] = value
  except OSError:
    pass
  try:
    with open("/proc/meminfo") as f:
      info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
  except OSError:
    pass
  return info


def _load() -> list:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return []


def _versions() -> dict:
  import importlib.metadata as md  # noqa: PLC0415
  out = {}
  for pkg in ("tensorflow", "keras", "tf-keras", "tensorflow-privacy",
              "tf_pxg", "numpy"):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = None
  return out


def _clear():
  import keras  # noqa: PLC0415
  keras.backend.clear_session()
  try:
    import tf_keras  # noqa: PLC0415
    tf_keras.backend.clear_session()
  except ImportError:
    pass
  gc.collect()


def _settings():
  quick = _QUICK.value
  from benchmarks import modes  # noqa: PLC0415
  return dict(
      quick=quick,
      models=list(_MODELS.value or (QUICK_MODELS if quick else ALL_MODELS)),
      growth_sizes=list(QUICK_GROWTH_SIZES) if quick else None,
      modes=list(_MODES.value or (QUICK_MODES if quick else modes.ALL_MODES)),
      rounds=_ROUNDS.value or (3 if quick else 5),
      round_seconds=_ROUND_SECONDS.value or (0.3 if quick else 0.6),
      growth_modes=list(QUICK_GROWTH_MODES if quick else GROWTH_MODES),
      memory_modes=list(QUICK_MEMORY_MODES if quick else
                        (_MODES.value or modes.ALL_MODES)))


def _time_group(model, batch_size, seq_len, names, settings):
  from benchmarks import modes  # noqa: PLC0415
  from benchmarks import timing  # noqa: PLC0415
  built = timing.build_group(
      names, lambda m: modes.make(m, model, batch_size, seq_len), log=_log)
  results = timing.run_rounds(built, settings["rounds"],
                              settings["round_seconds"])
  timing.add_ratios(results)
  del built
  _clear()
  return results


def run_time(settings) -> dict:
  from benchmarks import models  # noqa: PLC0415
  out = {}
  for model in settings["models"]:
    spec = models.SPECS[model]
    _log(f"[time] {model} (batch {spec.batch}"
         f"{', seq_len %d' % spec.seq_len if spec.seq_len else ''})")
    res = _time_group(model, spec.batch, 0, settings["modes"], settings)
    out[model] = {"batch_size": spec.batch, "seq_len": spec.seq_len or None,
                  "modes": res}
    for k, r in res.items():
      ratio = f" ratio {r['ratio']:.2f}x" if "ratio" in r else ""
      _log(f"  {k:16s} {r.get('status'):11s} "
           f"{r.get('ms', float('nan')):9.2f} ms{ratio} "
           f"{r.get('path', '')}{r.get('error', '')}")
  return out


def run_growth(settings) -> list:
  from benchmarks import models  # noqa: PLC0415
  out = []
  for model, (axis, sizes) in GROWTH.items():
    if model not in settings["models"]:
      continue
    for size in settings["growth_sizes"] or sizes:
      batch_size = size if axis == "batch" else models.SPECS[model].batch
      seq_len = size if axis == "seq_len" else 0
      _log(f"[growth] {model} {axis}={size}")
      res = _time_group(model, batch_size, seq_len, settings["growth_modes"],
                        settings)
      row = {"model": model, "axis": axis, "size": size,
             "batch_size": batch_size, "modes": res}
      out.append(row)
      _log("  " + ", ".join(f"{k} {r['ratio']:.2f}x" for k, r in res.items()
                            if "ratio" in r))
  return out


def _memory_one(mode, model, batch_size=0, seq_len=0) -> dict:
  cmd = [sys.executable, "-m", "benchmarks.memory", f"--mode={mode}",
         f"--model={model}", f"--batch_size={batch_size}",
         f"--seq_len={seq_len}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **memory.ALLOCATOR_ENV)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=str(venv.REPO), timeout=900)
  except subprocess.TimeoutExpired:
    return {"mode": mode, "model": model, "status": "error",
            "error": "timed out after 900 s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
    return {"mode": mode, "model": model, "status": "error",
            "error": f"exit {proc.returncode}: {' '.join(tail)[:400]}"}
  return json.loads(lines[-1])


def _memory_ratios(mem: dict) -> None:
  from benchmarks import modes  # noqa: PLC0415
  for k, r in mem.items():
    base = mem.get(modes.BASELINE.get(k, ""))
    if not base or r.get("status") != "ok" or base.get("status") != "ok":
      continue
    r["baseline"] = modes.BASELINE[k]
    if r.get("alloc_peak_mb") and base.get("alloc_peak_mb"):
      r["alloc_ratio"] = r["alloc_peak_mb"] / base["alloc_peak_mb"]
    r["rss_ratio"] = r["rss_peak_mb"] / base["rss_peak_mb"]
    grow, base_grow = (r["rss_peak_mb"] - r["rss_base_mb"],
                       base["rss_peak_mb"] - base["rss_base_mb"])
    if base_grow > 0:
      r["rss_growth_ratio"] = grow / base_grow


def run_memory(settings) -> dict:
  """Each (model, mode) in a subprocess of its own, `--memory_jobs` at a
  time (peaks do not depend on what else runs; time is not measured)."""
  jobs = [(model, mode) for model in settings["models"]
          for mode in settings["memory_modes"] if mode != "noise"]

  def one(job):
    start = time.perf_counter()
    r = _memory_one(job[1], job[0])
    _log(f"[memory] {job[0]} {job[1]}: {r.get('status')} "
         f"alloc {r.get('alloc_peak_mb')} MB, rss {r.get('rss_peak_mb')} MB"
         f" ({time.perf_counter() - start:.0f} s) {r.get('error', '')}")
    return r

  with concurrent.futures.ThreadPoolExecutor(_MEMORY_JOBS.value) as pool:
    results = list(pool.map(one, jobs))
  out = {model: {} for model in settings["models"]}
  for (model, mode), r in zip(jobs, results):
    out[model][mode] = r
  for model in out:
    _memory_ratios(out[model])
  return out


def main(argv):
  del argv
  if not venv.in_venv() and not _NO_VENV.value:
    python = venv.ensure(log=_log)
    os.execv(str(python), [str(python), "-m", "benchmarks"] + sys.argv[1:])
  venv.setup_process_env()
  from benchmarks import report  # noqa: PLC0415
  settings = _settings()
  started = time.time()
  result = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "machine": machine(), "load_average_start": _load(),
      "versions": _versions(), "settings": settings,
      "dp": {"l2_norm_clip": 1.0, "noise_multiplier": 1.1, "optimizer":
             "SGD(0.01)"}}
  _log(f"benchmark suite: {result['machine'].get('model_name')}, "
       f"{result['machine']['cores']} cores, "
       f"load {result['load_average_start']}")
  if "time" not in _SKIP.value:
    result["time"] = run_time(settings)
  if "growth" not in _SKIP.value:
    result["growth"] = run_growth(settings)
  if "limits" not in _SKIP.value:
    from benchmarks import limits  # noqa: PLC0415
    result["noise_kernels"] = limits.noise_kernels()
    _log(f"[limits] {result['noise_kernels']}")
  result["load_average_after_timing"] = _load()
  if "memory" not in _SKIP.value:
    result["memory"] = run_memory(settings)
  result["load_average_end"] = _load()
  result["seconds"] = round(time.time() - started, 1)
  out_dir = pathlib.Path(_OUT.value or venv.REPO / "benchmarks" / "results")
  paths = report.write(result, out_dir, "quick" if settings["quick"] else
                       "full")
  _log(f"done in {result['seconds']:.0f} s: " + ", ".join(map(str, paths)))
