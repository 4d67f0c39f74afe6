r"""The benchmark suite: tf_pxg against Keras 3, TensorFlow Privacy 0.9.0
and jax-privacy 2.0.

From the repository root, with tf_pxg's venv:

  .venv/bin/python -m benchmarks            # everything, ~1.5-2 h on 2 cores
  .venv/bin/python -m benchmarks --quick    # a subset
  .venv/bin/python -m benchmarks --models=convnext,wrn_gn,vit,bert,lstm
                                            # the real architectures only
  .venv/bin/python -m benchmarks --no_venv --models=gpt2_ft,gpt2_lora,bert_ft \
      --skip=time,memory,limits,profile --seq_lens=128,256,512,1024 --size=small
                                            # fine-tuning (issue 28)

It creates `benchmarks/.venv-tfp` on first use (see `benchmarks.venv`),
re-runs itself there, and then:

1. **Time**, per model (`benchmarks.models`): builds every mode
   (`benchmarks.modes`) in one process per model (`benchmarks.time_group`)
   and times them in interleaved rounds (`benchmarks.timing`); each DP
   mode's ratio to its own framework's non-private `fit` step is the median
   of per-round ratios. For the real architectures (`models.REAL_MODELS`)
   also jax-privacy's Keras API against Keras 3 on JAX, in the same way in
   a process of `benchmarks/.venv-jaxp` (`benchmarks.jax_anchor`).
2. **Cost growth**: the same DP / non-private ratios at batch 32, 128, 512
   (mlp, cnn) and sequence length 32, 128, 512 (transformer); for the
   fine-tuning models (`models.FINETUNE_MODELS`: KerasHub GPT-2 full and
   LoRA, BERT; Keras 3 and tf_pxg only, not in the default model list) at
   T = 128 to 1024 (`--seq_lens`), each point in a timing process of its
   own, with both modes' peak memory at that T.
3. **Memory**: each mode in a subprocess of its own (`benchmarks.memory`,
   `benchmarks.jax_anchor`): peak RSS and, where the allocator keeps
   statistics, the TF allocator's peak over a step.
4. **Where the time goes** (real architectures): tf_pxg's DP step and
   Keras' step under the TF profiler, op time per family
   (`benchmarks.profile.families`: forward, backward, clip norms, weighted
   sums, noise, optimizer).

The machine's load average is recorded at the start and end of each part
and around each model's timing.

Writes `benchmarks/results/<name>.json`, a PNG chart and a Markdown table
(`benchmarks.report`); `<name>` is `--output_name`, else `quick` for
`--quick`, `real` when every model is a real architecture, else `full`.
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
_SKIP = flags.DEFINE_list(
    "skip", [], "Parts to skip: time, growth, limits, memory, profile, "
    "growth_memory (the fine-tuning models' memory at each growth point).")
_OUT = flags.DEFINE_string("output_dir", "", "Default benchmarks/results.")
_MEMORY_JOBS = flags.DEFINE_integer(
    "memory_jobs", 2, "Memory subprocesses run at once.")
_NO_VENV = flags.DEFINE_bool(
    "no_venv", False, "Run in this interpreter (TF Privacy modes fail "
    "unless it has tensorflow-privacy).")
_OUTPUT_NAME = flags.DEFINE_string(
    "output_name", "", "Stem of the result files (default: quick, real or "
    "full; see the module doc).")
_JAX = flags.DEFINE_bool(
    "jax", True, "Run jax-privacy's Keras API on the real architectures "
    "(creates benchmarks/.venv-jaxp on first use).")
_SIZE = flags.DEFINE_enum(
    "size", "full", ["full", "small", "tiny"], "Model size: tiny runs every "
    "model at the smoke test's size (checks the suite, measures nothing "
    "real); small: `Spec.small` where a model has one (the fine-tuning "
    "models: 4 of 12 layers at d = 768), else full.")
_SEQ_LENS = flags.DEFINE_list(
    "seq_lens", [], "Sequence lengths of the cost growth of sequence models "
    "(default: each model's, `GROWTH`).")
_PROFILE_STEPS = flags.DEFINE_integer(
    "profile_steps", 0, "Steps profiled per model and mode (0: 5, quick 3).")
_JAX_MEMORY_LIMIT = flags.DEFINE_float(
    "jax_memory_limit_gb", 16.0, "Data-segment limit of each jax-privacy "
    "process (an allocation past it fails as out of memory).")

ALL_MODELS = ("mlp", "cnn", "embed", "transformer", "lstm", "convnext",
              "wrn_gn", "vit", "bert")
QUICK_MODELS = ("mlp", "cnn", "embed", "transformer", "wrn_gn")
QUICK_MODES = ("keras", "pxg", "noise", "tf_keras", "tfp_dpmodel")
QUICK_MEMORY_MODES = ("keras", "pxg")
# The real architectures: no XLA modes (minutes of compilation each) and no
# materialised per-example gradients (pxg_naive, TF Privacy's optimizer:
# B x 28M floats for ConvNeXt).
REAL_MODES = ("keras", "pxg", "noise", "tf_keras", "tfp_dpmodel")
REAL_MEMORY_MODES = ("keras", "pxg", "tf_keras", "tfp_dpmodel")
# The fine-tuning models (KerasHub, Keras 3 only): Keras' step and tf_pxg's.
FINETUNE_MODES = ("keras", "pxg")
# Models with grouped convolutions: also Keras' step with TF's grouped conv
# kernels (`modes.tf_grouped_conv`), the like-for-like baseline of tf_pxg.
EXTRA_MODES = {"convnext": ("keras_tfconv",)}
QUICK_GROWTH_SIZES = (32, 512)
GROWTH = {"mlp": ("batch", (32, 128, 512)), "cnn": ("batch", (32, 128, 512)),
          "transformer": ("seq_len", (32, 128, 512)),
          "gpt2_ft": ("seq_len", (128, 256, 512, 1024)),
          "gpt2_lora": ("seq_len", (128, 256, 512, 1024)),
          "bert_ft": ("seq_len", (128, 256, 512))}
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


def _git_state() -> dict:
  """The commit and the uncommitted changes to tf_pxg/ that the run
  measures (other engineers may work in the same tree)."""
  def git(*args):
    try:
      return subprocess.run(["git", *args], capture_output=True, text=True,
                            cwd=str(venv.REPO), timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
      return ""
  import hashlib  # noqa: PLC0415
  diff = git("diff", "HEAD", "--", "tf_pxg")
  return {"commit": git("rev-parse", "--short", "HEAD").strip() or None,
          "tf_pxg_uncommitted": git("diff", "HEAD", "--name-only", "--",
                                    "tf_pxg").split(),
          "tf_pxg_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()
                              if diff else None}


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


def _real(model: str) -> bool:
  from benchmarks import models  # noqa: PLC0415
  return ((model in models.REAL_MODELS and model not in models.SMALL_MODELS)
          or model in models.FINETUNE_MODELS)


def output_name(settings) -> str:
  from benchmarks import models  # noqa: PLC0415
  if _OUTPUT_NAME.value:
    return _OUTPUT_NAME.value
  if settings["quick"]:
    return "quick"
  if all(m in models.FINETUNE_MODELS for m in settings["models"]):
    return "finetune"
  if all(m in models.REAL_MODELS for m in settings["models"]):
    return "real"
  return "full"


def _settings():
  quick = _QUICK.value
  from benchmarks import jax_anchor  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  from benchmarks import modes  # noqa: PLC0415
  chosen = [m for m in _MODES.value if m not in jax_anchor.JAX_MODES]
  model_list = list(_MODELS.value or (QUICK_MODELS if quick else ALL_MODELS))
  unknown = [m for m in model_list if m not in models.SPECS]
  if unknown:
    raise app.UsageError(f"unknown models {unknown}; "
                         f"known: {sorted(models.SPECS)}")

  # The LSTM is both a small model and a real one: with only real models
  # it gets the real models' modes, else all modes as before.
  real_only = all(m in models.REAL_MODELS for m in model_list)

  def real(model):
    return _real(model) or (real_only and model in models.REAL_MODELS)

  def model_modes(model):
    if chosen:
      return chosen
    if model in models.FINETUNE_MODELS:
      return list(FINETUNE_MODES)
    if quick:
      return list(QUICK_MODES)
    return list(REAL_MODES if real(model) else modes.ALL_MODES) + list(
        EXTRA_MODES.get(model, ()))

  def model_memory_modes(model):
    if model in models.FINETUNE_MODELS and not chosen:
      return list(FINETUNE_MODES)
    if quick:
      return list(QUICK_MEMORY_MODES)
    if chosen:
      return chosen
    return list(REAL_MEMORY_MODES if real(model) else modes.ALL_MODES) + list(
        EXTRA_MODES.get(model, ()))

  memory_wanted = "growth_memory" not in _SKIP.value
  jax_wanted = _JAX.value and (not _MODES.value or any(
      m in jax_anchor.JAX_MODES for m in _MODES.value))
  return dict(
      quick=quick,
      models=model_list,
      growth_sizes=list(QUICK_GROWTH_SIZES) if quick else None,
      seq_lens=[int(t) for t in _SEQ_LENS.value] or None,
      modes={m: model_modes(m) for m in model_list},
      jax_models=[m for m in model_list
                  if jax_wanted and m in models.REAL_MODELS],
      rounds=_ROUNDS.value or (3 if quick else 5),
      round_seconds=_ROUND_SECONDS.value or (0.3 if quick else 0.6),
      growth_modes=list(QUICK_GROWTH_MODES if quick else GROWTH_MODES),
      growth_memory=memory_wanted,
      memory_modes={m: model_memory_modes(m) for m in model_list},
      size=_SIZE.value,
      profile_models=[m for m in model_list if m in models.REAL_MODELS],
      profile_steps=_PROFILE_STEPS.value or (3 if quick else 5))


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
  from benchmarks import jax_anchor  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  from benchmarks import time_group  # noqa: PLC0415
  out = {}
  for model in settings["models"]:
    spec = models.SPECS[model]
    seq_len = (spec.tiny.get("seq_len", spec.seq_len)
               if settings["size"] == "tiny" else spec.seq_len)
    _log(f"[time] {model} (batch {spec.batch}"
         f"{', seq_len %d' % seq_len if seq_len else ''}"
         f"{', tiny size' if settings['size'] == 'tiny' else ''}), "
         f"load {_load()}")
    load_before, start = _load(), time.perf_counter()
    res = time_group.run(model, settings["modes"][model], spec.batch, 0,
                         settings["rounds"], settings["round_seconds"],
                         size=settings["size"], log=_log)
    record = {"batch_size": spec.batch, "seq_len": seq_len or None,
              "model_size": settings["size"],
              "modes": res, "load_before": load_before, "load_after": None,
              "seconds": None}
    _log_modes(res)
    if model in settings["jax_models"]:
      _log(f"  [jax-privacy] {model}, load {_load()}")
      jax_start = time.perf_counter()
      jax_res = jax_anchor.run_time(
          model, spec.batch, settings["rounds"], settings["round_seconds"],
          size=settings["size"], memory_limit_gb=_JAX_MEMORY_LIMIT.value,
          log=_log)
      res.update(jax_res)
      _log_modes(jax_res)
      record["jax_seconds"] = round(time.perf_counter() - jax_start, 1)
      if res.get(jax_anchor.FALLBACK_MODE, {}).get("status") == "ok":
        settings.setdefault("jax_fallback_models", []).append(model)
    record["load_after"] = _load()
    record["seconds"] = round(time.perf_counter() - start, 1)
    out[model] = record
    _log(f"  ({record['seconds']:.0f} s, load {record['load_after']})")
  return out


def _log_modes(res: dict) -> None:
  for k, r in res.items():
    ratio = (f" ratio {r['ratio']:.2f}x (CPU {r['cpu_ratio']:.2f}x)"
             if "ratio" in r else "")
    _log(f"  {k:16s} {r.get('status'):13s} "
         f"{r.get('ms', float('nan')):9.2f} ms{ratio} "
         f"{r.get('path', '')}{r.get('error', '')}")


def run_growth(settings) -> list:
  """DP / non-private step time along a batch or sequence axis. The
  fine-tuning models: each point's modes in a timing process of their own
  (`benchmarks.time_group`), and their peak memory at that point (unless
  `--skip=growth_memory`)."""
  from benchmarks import models  # noqa: PLC0415
  from benchmarks import time_group  # noqa: PLC0415
  out = []
  for model, (axis, sizes) in GROWTH.items():
    if model not in settings["models"]:
      continue
    finetune = model in models.FINETUNE_MODELS
    if axis == "seq_len" and settings.get("seq_lens"):
      sizes = settings["seq_lens"]
    elif settings["growth_sizes"]:
      sizes = settings["growth_sizes"]
    for size in sizes:
      batch_size = size if axis == "batch" else models.SPECS[model].batch
      seq_len = size if axis == "seq_len" else 0
      _log(f"[growth] {model} {axis}={size}, load {_load()}")
      load_before = _load()
      if finetune:
        res = time_group.run(model, list(FINETUNE_MODES), batch_size,
                             seq_len, settings["rounds"],
                             settings["round_seconds"],
                             size=settings["size"], log=_log)
      else:
        res = _time_group(model, batch_size, seq_len,
                          settings["growth_modes"], settings)
      row = {"model": model, "axis": axis, "size": size,
             "batch_size": batch_size, "modes": res,
             "model_size": settings["size"],
             "load_before": load_before, "load_after": _load()}
      _log_modes(res)
      if finetune and settings.get("growth_memory", True):
        # One step after the two of warm-up: the step's peak (they take
        # seconds each).
        mem = {mode: _memory_one(mode, model, batch_size, seq_len,
                                 settings["size"], steps=1)
               for mode in FINETUNE_MODES}
        _memory_ratios(mem)
        row["memory"] = mem
        _log("  memory: " + ", ".join(
            f"{k} alloc {r.get('alloc_peak_mb') or 0:.0f} MB "
            f"{r.get('status')} {r.get('error', '')}"
            for k, r in mem.items()) + (
                f", ratio {mem['pxg']['alloc_ratio']:.2f}x"
                if mem["pxg"].get("alloc_ratio") else ""))
      out.append(row)
  return out


def _memory_one(mode, model, batch_size=0, seq_len=0, size="full",
                steps=3) -> dict:
  from benchmarks import jax_anchor  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  timeout = 1800 if model in models.REAL_MODELS else 900
  if mode in jax_anchor.JAX_MODES + (jax_anchor.FALLBACK_MODE,):
    return jax_anchor.run_memory(
        mode, model, batch_size or models.SPECS[model].batch, size=size,
        timeout=timeout, memory_limit_gb=_JAX_MEMORY_LIMIT.value, log=_log)
  cmd = [sys.executable, "-m", "benchmarks.memory", f"--mode={mode}",
         f"--model={model}", f"--batch_size={batch_size}",
         f"--seq_len={seq_len}", f"--size={size}", f"--steps={steps}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **memory.ALLOCATOR_ENV)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=str(venv.REPO), timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"mode": mode, "model": model, "status": "error",
            "error": f"timed out after {timeout} s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    from benchmarks import timing  # noqa: PLC0415
    tail = timing.process_failure_line(proc.stderr or proc.stdout)
    return {"mode": mode, "model": model,
            "status": "crashed" if proc.returncode < 0 else "error",
            "error": f"exit {proc.returncode}: {tail}"}
  return json.loads(lines[-1])


def _memory_ratios(mem: dict) -> None:
  from benchmarks import jax_anchor  # noqa: PLC0415
  from benchmarks import modes  # noqa: PLC0415
  baseline = dict(modes.BASELINE, **jax_anchor.BASELINE)
  for k, r in mem.items():
    for alt in modes.ALT_BASELINE.get(k, ()):
      base = mem.get(alt, {})
      if (r.get("status") == "ok" and base.get("status") == "ok" and
          r.get("alloc_peak_mb") and base.get("alloc_peak_mb")):
        r.setdefault("alloc_ratio_to", {})[alt] = (
            r["alloc_peak_mb"] / base["alloc_peak_mb"])
    base = mem.get(baseline.get(k, ""))
    if not base or r.get("status") != "ok" or base.get("status") != "ok":
      continue
    r["baseline"] = baseline[k]
    if r.get("alloc_peak_mb") and base.get("alloc_peak_mb"):
      r["alloc_ratio"] = r["alloc_peak_mb"] / base["alloc_peak_mb"]
    r["rss_ratio"] = r["rss_peak_mb"] / base["rss_peak_mb"]
    grow, base_grow = (r["rss_peak_mb"] - r["rss_base_mb"],
                       base["rss_peak_mb"] - base["rss_base_mb"])
    if base_grow > 0:
      r["rss_growth_ratio"] = grow / base_grow


def run_memory(settings) -> dict:
  """Each (model, mode) in a subprocess of its own, `--memory_jobs` at a
  time for the small models (peaks do not depend on what else runs; time
  is not measured) and one at a time for the real architectures, whose
  processes take gigabytes each."""
  from benchmarks import jax_anchor  # noqa: PLC0415
  jobs = []
  for model in settings["models"]:
    names = [m for m in settings["memory_modes"][model] if m != "noise"]
    if model in settings["jax_models"]:
      names += list(jax_anchor.JAX_MODES)
      if model in settings.get("jax_fallback_models", ()):
        names.append(jax_anchor.FALLBACK_MODE)
    jobs += [(model, mode) for mode in names]

  def one(job):
    start = time.perf_counter()
    r = _memory_one(job[1], job[0], size=settings["size"])
    _log(f"[memory] {job[0]} {job[1]}: {r.get('status')} "
         f"alloc {r.get('alloc_peak_mb')} MB, rss {r.get('rss_peak_mb')} MB"
         f" ({time.perf_counter() - start:.0f} s) {r.get('error', '')}")
    return r

  small = [j for j in jobs if not _real(j[0])]
  real = [j for j in jobs if _real(j[0])]
  with concurrent.futures.ThreadPoolExecutor(_MEMORY_JOBS.value) as pool:
    results = dict(zip(small, pool.map(one, small)))
  results.update((j, one(j)) for j in real)
  out = {model: {} for model in settings["models"]}
  for (model, mode) in jobs:
    out[model][mode] = results[(model, mode)]
  for model in out:
    _memory_ratios(out[model])
  return out


def _profile_one(model, mode, steps, size) -> dict:
  cmd = [sys.executable, "-m", "benchmarks.profile", f"--model={model}",
         f"--mode={mode}", "--families", "--json", f"--steps={steps}",
         f"--size={size}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=str(venv.REPO), timeout=1800)
  except subprocess.TimeoutExpired:
    return {"status": "error", "error": "timed out after 1800 s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    from benchmarks import timing  # noqa: PLC0415
    tail = timing.process_failure_line(proc.stderr or proc.stdout)
    return {"status": "crashed" if proc.returncode < 0 else "error",
            "error": f"exit {proc.returncode}: {tail}"}
  return dict(json.loads(lines[-1]), status="ok")


def run_profile(settings) -> dict:
  """Op time per family (`benchmarks.profile.families`) of tf_pxg's DP
  step and Keras' step, each in a process of its own, per real model."""
  out = {}
  for model in settings["profile_models"]:
    out[model] = {}
    for mode in ("keras", "pxg"):
      start = time.perf_counter()
      r = _profile_one(model, mode, settings["profile_steps"],
                       settings["size"])
      r["load_after"] = _load()
      out[model][mode] = r
      fams = ", ".join(f"{k} {v:.1f}" for k, v in
                       r.get("families", {}).items() if v >= 0.05)
      _log(f"[profile] {model} {mode}: {r['status']} "
           f"{r.get('op_ms_per_step', 0):.1f} ms op time/step ({fams}) "
           f"({time.perf_counter() - start:.0f} s) {r.get('error', '')}")
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
      "git": _git_state(),
      "versions": _versions(), "settings": settings,
      "dp": {"l2_norm_clip": 1.0, "noise_multiplier": 1.1, "optimizer":
             "SGD(0.01)"}}
  _log(f"benchmark suite: {result['machine'].get('model_name')}, "
       f"{result['machine']['cores']} cores, "
       f"load {result['load_average_start']}")
  if "time" not in _SKIP.value:
    result["time"] = run_time(settings)
    for res in result["time"].values():
      for r in res["modes"].values():
        if r.get("versions"):
          result["versions_jax"] = r.pop("versions")
  if "growth" not in _SKIP.value:
    result["growth"] = run_growth(settings)
  if "limits" not in _SKIP.value:
    from benchmarks import limits  # noqa: PLC0415
    result["noise_kernels"] = limits.noise_kernels()
    _log(f"[limits] {result['noise_kernels']}")
  result["load_average_after_timing"] = _load()
  if "memory" not in _SKIP.value:
    result["memory"] = run_memory(settings)
  result["load_average_after_memory"] = _load()
  if "profile" not in _SKIP.value:
    result["profile"] = run_profile(settings)
  result["load_average_end"] = _load()
  result["seconds"] = round(time.time() - started, 1)
  out_dir = pathlib.Path(_OUT.value or venv.REPO / "benchmarks" / "results")
  paths = report.write(result, out_dir, output_name(settings))
  _log(f"done in {result['seconds']:.0f} s: " + ", ".join(map(str, paths)))
