r"""jax-privacy 2.0's Keras API (Keras 3 on JAX) as a second anchor.

jax-privacy's `jax_privacy.keras_api.make_private(model, DPKerasConfig)`
replaces a Keras 3 model's `train_step` (JAX backend only) by one that
computes clipped per-example gradients with `jax_privacy.clipped_grad`
(`jax.vmap` over the batch, `microbatch_size=None`: all examples at once)
and adds Gaussian noise. Keras cannot run the JAX and TensorFlow backends
in one process, so this runs in a venv of its own
(`benchmarks/.venv-jaxp`, `benchmarks.venv.ensure_jax`) as a subprocess
per model, with `KERAS_BACKEND=jax`:

  benchmarks/.venv-jaxp/bin/python -m benchmarks.jax_anchor \
      --part=time --model=wrn_gn
  benchmarks/.venv-jaxp/bin/python -m benchmarks.jax_anchor \
      --part=memory --model=wrn_gn --mode=jaxp_dpmodel

Modes, each one step of `model.train_function(state, iterator)` as Keras'
JAX `fit` runs it (jit-compiled, state carried from step to step):

* `keras_jax`: the plain Keras 3 step on JAX (the baseline);
* `jaxp_dpmodel`: the same model after `keras_api.make_private` with
  C = 1, sigma = 1.1 (`noise_multiplier` given, so no calibration),
  `rescale_to_unit_norm=False` (the clipped sum / B plus noise, as tf_pxg
  and TF Privacy), batch size as the suite's.

`--part=time` builds both and times them in interleaved rounds
(`benchmarks.timing`); `--part=memory` measures one mode's peak RSS (VmHWM,
over the steps after warm-up and over the process's life) and, where JAX's
CPU client keeps statistics, its peak bytes in use. Prints one JSON line.

From the suite (tf_pxg's venv), `run_time` and `run_memory` start these
subprocesses; they return status records instead of raising when the venv
cannot be made (no package index), the process dies or times out, or the
step fails (e.g. out of memory). The subprocess's data segment is limited
(`--memory_limit_gb`, RLIMIT_DATA) so that a model whose per-example
gradients do not fit fails with an allocation error instead of pushing the
shared machine into swap or the OOM killer.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags

JAX_MODES = ("keras_jax", "jaxp_dpmodel")
# When the whole batch in one `jax.vmap` does not fit (ConvNeXtTiny: XLA
# asks for 239 GB), jax-privacy's own remedy: `microbatch_size=1`, one
# example at a time in a `lax.scan` (microbatch_size=8 still asked for
# 10.5 GB in one allocation).
FALLBACK_MODE = "jaxp_dpmodel_mb1"
BASELINE = {"jaxp_dpmodel": "keras_jax", FALLBACK_MODE: "keras_jax"}
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.1
LEARNING_RATE = 0.01
DEFAULT_MEMORY_LIMIT_GB = 16.0
_OOM = re.compile(r"RESOURCE_EXHAUSTED|Out of memory|out of memory|"
                  r"MemoryError|std::bad_alloc|Cannot allocate memory")


# In the jax-privacy venv.


def _sync(out):
  import jax  # noqa: PLC0415
  jax.block_until_ready(out)


def make(mode: str, name: str, batch_size: int, size: str = "full",
         seed: int = 0):
  """Builds `mode` for model `name` on Keras' JAX backend; not yet run."""
  import jax.numpy as jnp  # noqa: PLC0415
  import keras  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  if keras.config.backend() != "jax":
    raise RuntimeError("run with KERAS_BACKEND=jax")
  if mode not in JAX_MODES + (FALLBACK_MODE,):
    raise KeyError(mode)
  keras.utils.set_random_seed(seed)
  x, y = models.batch(name, batch_size, 0, seed, size)
  model = models.build(keras, name, 0, size)
  info = {}
  if mode.startswith("jaxp_dpmodel"):
    microbatch = 1 if mode == FALLBACK_MODE else None
    import importlib.metadata as md  # noqa: PLC0415
    from jax_privacy import keras_api  # noqa: PLC0415
    config = keras_api.DPKerasConfig(
        epsilon=1e6, delta=1e-5, clipping_norm=L2_NORM_CLIP,
        batch_size=batch_size, gradient_accumulation_steps=1,
        train_steps=100, train_size=max(50_000, batch_size),
        noise_multiplier=NOISE_MULTIPLIER, rescale_to_unit_norm=False,
        microbatch_size=microbatch, seed=seed)
    model = keras_api.make_private(model, config)
    info["path"] = (f"jax_privacy {md.version('jax-privacy')} "
                    "keras_api.make_private " + (
                        "(jax.vmap over the batch)" if microbatch is None
                        else f"(microbatch_size={microbatch}: lax.scan over "
                             "the examples)"))
  model.compile(
      optimizer=keras.optimizers.SGD(LEARNING_RATE),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      jit_compile=True)
  data = (jnp.asarray(x), jnp.asarray(y), None)
  model._symbolic_build(data_batch=data)  # pylint: disable=protected-access
  model.make_train_function()
  state = [model._get_jax_state(  # pylint: disable=protected-access
      trainable_variables=True, non_trainable_variables=True,
      optimizer_variables=True, metrics_variables=True,
      purge_model_variables=False)]
  iterator = itertools.repeat(data)

  def step():
    logs, state[0] = model.train_function(state[0], iterator)
    return logs, state[0]

  from benchmarks import modes  # noqa: PLC0415 (NumPy only, no TF)
  return modes.Step(step, info, model)


def _versions() -> dict:
  import importlib.metadata as md  # noqa: PLC0415
  out = {}
  for pkg in ("jax", "jaxlib", "jax-privacy", "keras", "numpy"):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = None
  return out


def time_modes(name: str, batch_size: int, rounds: int, round_seconds: float,
               size: str = "full", modes=JAX_MODES, log=None,
               fallback: bool = True) -> dict:
  """Builds `modes` and times them in interleaved rounds; ratios added.

  With `fallback`, a `jaxp_dpmodel` out of memory is followed by
  `FALLBACK_MODE` timed against a new `keras_jax` in rounds of their own.
  """
  from benchmarks import timing  # noqa: PLC0415
  log = log or (lambda *a: print(*a, file=sys.stderr, flush=True))
  built = timing.build_group(
      list(modes), lambda m: make(m, name, batch_size, size), log=log,
      sync=_sync)
  results = timing.run_rounds(built, rounds, round_seconds, sync=_sync)
  timing.add_ratios(results, BASELINE, {})
  for r in results.values():
    if r.get("status") == "error" and _OOM.search(r.get("error", "")):
      r["status"] = "out of memory"
  if (fallback and results.get("jaxp_dpmodel", {}).get("status")
      == "out of memory"):
    log(f"    jaxp_dpmodel out of memory; timing {FALLBACK_MODE} against a "
        "new keras_jax")
    again = time_modes(name, batch_size, rounds, round_seconds, size,
                       ("keras_jax", FALLBACK_MODE), log, fallback=False)
    results[FALLBACK_MODE] = again[FALLBACK_MODE]
  return results


def _jax_peak_bytes():
  import jax  # noqa: PLC0415
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001 (no statistics on this client)
    return None
  if not stats:
    return None
  return stats.get("peak_bytes_in_use")


def measure_memory(mode: str, name: str, batch_size: int, size: str = "full",
                   steps: int = 3) -> dict:
  """Peak RSS of one mode's steps in this process (see module doc)."""
  from benchmarks import memory  # noqa: PLC0415
  from benchmarks import timing  # noqa: PLC0415
  result = {"mode": mode, "model": name, "batch_size": batch_size}
  try:
    step = make(mode, name, batch_size, size)
    result["rss_base_mb"] = memory._mb(  # pylint: disable=protected-access
        memory._status_kb("VmRSS"))  # pylint: disable=protected-access
    _sync(step.fn())
    _sync(step.fn())
    warmup_peak = memory._status_kb("VmHWM")  # pylint: disable=protected-access
    has_hwm = memory._reset_hwm()  # pylint: disable=protected-access
    for _ in range(steps):
      _sync(step.fn())
  except Exception as exc:  # noqa: BLE001 (reported)
    error = timing.error_message(exc)
    result.update(status="out of memory" if _OOM.search(error) else "error",
                  error=error)
    return result
  steps_peak = memory._status_kb("VmHWM")  # pylint: disable=protected-access
  peak = _jax_peak_bytes()
  result.update(
      status="ok",
      rss_peak_mb=memory._mb(  # pylint: disable=protected-access
          max(warmup_peak or 0, steps_peak or 0) or None),
      rss_steps_peak_mb=(memory._mb(steps_peak)  # pylint: disable=W0212
                         if has_hwm else None),
      alloc_peak_mb=None if peak is None else peak / 2**20, **step.info)
  return result


def _define_flags():
  return dict(
      part=flags.DEFINE_enum("part", "time", ["time", "memory"],
                             "Time both modes, or one mode's memory."),
      model=flags.DEFINE_string("model", "wrn_gn", "benchmarks.models name."),
      mode=flags.DEFINE_string("mode", "jaxp_dpmodel", "For --part=memory."),
      batch_size=flags.DEFINE_integer("batch_size", 0, "0: the model's."),
      size=flags.DEFINE_enum("size", "full", ["full", "tiny"], "Model size."),
      rounds=flags.DEFINE_integer("rounds", 5, "Timing rounds."),
      round_seconds=flags.DEFINE_float("round_seconds", 0.6,
                                       "Wall time per mode and round."),
      memory_limit_gb=flags.DEFINE_float(
          "memory_limit_gb", DEFAULT_MEMORY_LIMIT_GB,
          "RLIMIT_DATA of this process (0: none)."))


_FLAGS = {}


def _limit_memory(gb: float) -> None:
  if gb > 0:
    limit = int(gb * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main(argv):
  del argv
  f = {k: v.value for k, v in _FLAGS.items()}
  _limit_memory(f["memory_limit_gb"])
  from benchmarks import models  # noqa: PLC0415
  batch_size = f["batch_size"] or models.SPECS[f["model"]].batch
  if f["part"] == "time":
    out = {"modes": time_modes(f["model"], batch_size, f["rounds"],
                               f["round_seconds"], f["size"]),
           "versions": _versions()}
  else:
    out = measure_memory(f["mode"], f["model"], batch_size, f["size"])
  sys.stdout.write(json.dumps(out) + "\n")
  sys.stdout.flush()
  os._exit(0)  # skip teardown


# In the suite's process (tf_pxg's venv).


def _env() -> dict:
  env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="2")
  for k in ("TF_USE_LEGACY_KERAS", "PYTHONPATH"):
    env.pop(k, None)
  return env


def interpreter(log=print):
  """(python, None), or (None, status record) when the jax-privacy venv
  cannot be created (e.g. no access to the package index)."""
  from benchmarks import venv  # noqa: PLC0415
  try:
    return venv.ensure_jax(log=log), None
  except subprocess.CalledProcessError as exc:
    tail = " ".join((exc.stderr or exc.stdout or "").strip()
                    .splitlines()[-2:])[:400]
    return None, {"status": "unavailable",
                  "error": f"could not install jax-privacy (pip exit "
                           f"{exc.returncode}; no package index?): {tail}"}
  except (OSError, RuntimeError) as exc:
    return None, {"status": "unavailable",
                  "error": f"{type(exc).__name__}: {exc}"[:400]}


def _failure(proc_or_exc, what: str) -> dict:
  """A status record for a subprocess that printed no result."""
  if isinstance(proc_or_exc, subprocess.TimeoutExpired):
    return {"status": "error", "error": f"{what} timed out after "
                                        f"{proc_or_exc.timeout:.0f} s"}
  from benchmarks import timing  # noqa: PLC0415
  proc = proc_or_exc
  text = (proc.stderr or "") + "\n" + (proc.stdout or "")
  oom = [ln.strip() for ln in text.splitlines() if _OOM.search(ln)]
  tail = (oom[-1] if oom else timing.process_failure_line(text))[:400]
  status = "out of memory" if oom else (
      "crashed" if proc.returncode < 0 else "error")
  if proc.returncode < 0:
    tail = f"killed by signal {-proc.returncode}; {tail}"
  return {"status": status, "error": f"{what} exit {proc.returncode}: {tail}"}


def _run(args, timeout: float, log=print):
  python, status = interpreter(log)
  if python is None:
    return status
  from benchmarks import venv  # noqa: PLC0415
  cmd = [str(python), "-m", "benchmarks.jax_anchor", *args]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(),
                          cwd=str(venv.REPO), timeout=timeout)
  except subprocess.TimeoutExpired as exc:
    return _failure(exc, "jax-privacy subprocess")
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode or not lines:
    return _failure(proc, "jax-privacy subprocess")
  return json.loads(lines[-1])


def run_time(name: str, batch_size: int, rounds: int, round_seconds: float,
             size: str = "full", timeout: float = 1800,
             memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB,
             log=print) -> dict:
  """`{mode: record}` for `JAX_MODES` on model `name`, timed in their own
  process; a failure of the whole process becomes every mode's record."""
  out = _run(["--part=time", f"--model={name}",
              f"--batch_size={batch_size}", f"--size={size}",
              f"--rounds={rounds}", f"--round_seconds={round_seconds}",
              f"--memory_limit_gb={memory_limit_gb}"], timeout, log)
  if "modes" not in out:
    return {m: dict(out) for m in JAX_MODES}
  for r in out["modes"].values():
    r.setdefault("versions", out.get("versions"))
  return out["modes"]


def run_memory(mode: str, name: str, batch_size: int, size: str = "full",
               timeout: float = 1800,
               memory_limit_gb: float = DEFAULT_MEMORY_LIMIT_GB,
               log=print) -> dict:
  """One mode's memory record, measured in a process of its own."""
  out = _run(["--part=memory", f"--model={name}", f"--mode={mode}",
              f"--batch_size={batch_size}", f"--size={size}",
              f"--memory_limit_gb={memory_limit_gb}"], timeout, log)
  out.setdefault("mode", mode)
  out.setdefault("model", name)
  return out


if __name__ == "__main__":
  _FLAGS.update(_define_flags())
  app.run(main)
