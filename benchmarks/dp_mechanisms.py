r"""Privacy–utility and cost of the DP mechanisms (issue 21's measurements).

Two parts, from the repository root with the project's venv:

  .venv/bin/python -m benchmarks.dp_mechanisms --part=cost
  .venv/bin/python -m benchmarks.dp_mechanisms --part=accuracy --runs=5

`cost`: the DP step with BandMF (b = 16), with BLT (d = `--blt_buffers`
buffers, `tf_pxg.dp.blt.BLT`) and with DP-SGD, each over the non-private
Keras step of the same model (`benchmarks.models`: mlp, cnn; batch 32),
timed in interleaved rounds in one process (the ratio is the median of the
per-round ratios; BLT also over DP-SGD's step), and the noise buffers'
bytes against the parameters' bytes.

`synthetic`: where BandMF should win, many steps at a fixed ε: DP linear
regression (d = 100 with feature scales 1 to 0.03, N = 10000, B = 50,
SGD 0.02, ε = 2; label noise 0.01)
for 5 and 50 epochs, test
MSE for DP-SGD and BandMF (b chosen by `choose_num_bands`, and b = 16), 3
runs each, with the predicted prefix-sum errors of the candidates.

`accuracy`: `examples/dp_digits.py` at ε ∈ {1, 2, 8}, `--runs` runs each
(different weight seeds; sampling and noise from OS entropy), for DP-SGD
(flat C = 1, the tuned default), BandMF with the b that
`tf_pxg.mf.choose_num_bands` picks (and fixed b if given), quantile
clipping from C = 0.1 and from C = 10, and automatic clipping. Prints mean
± standard deviation and writes `benchmarks/results/dp_mechanisms.json`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

_PART = flags.DEFINE_enum(
    "part", "cost", ["cost", "accuracy", "synthetic", "prefix_error"],
    "What to run.")
_RUNS = flags.DEFINE_integer("runs", 5, "Runs per accuracy configuration.")
_EPSILONS = flags.DEFINE_list("epsilons", ["1", "2", "8"], "Target ε's.")
_CONFIGS = flags.DEFINE_list(
    "configs", ["dpsgd", "bandmf", "quantile_0.1", "quantile_10",
                "automatic"], "Accuracy configurations.")
_PARALLEL = flags.DEFINE_integer("parallel", 2, "Example runs at a time.")
_ROUNDS = flags.DEFINE_integer("rounds", 15, "Timing rounds.")
_STEPS = flags.DEFINE_integer("steps_per_round", 10, "Steps per round.")
_BANDS = flags.DEFINE_integer("bands", 16, "b for the cost part.")
_BLT_BUFFERS = flags.DEFINE_list("blt_buffers", ["3", "4", "5"],
                                 "BLT buffer counts d for the cost part.")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_RESULTS = _ROOT / "benchmarks" / "results"

_ARGS = {
    "dpsgd": [],
    "bandmf": ["--num_bands=0"],
    "quantile_0.1": ["--clipping=quantile", "--l2_norm_clip=0.1"],
    "quantile_10": ["--clipping=quantile", "--l2_norm_clip=10"],
    "automatic": ["--clipping=automatic"],
}


def _cost():
  import keras  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from benchmarks import models  # noqa: PLC0415
  from tf_pxg import mf  # noqa: PLC0415
  from tf_pxg.dp import blt  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415

  blts = [f"blt{int(d)}" for d in _BLT_BUFFERS.value]
  out = {}
  for name in ("mlp", "cnn"):
    x, y = models.batch(name, 32)

    def make(kind):
      keras.utils.set_random_seed(0)
      net = models.build(keras, name)
      if kind == "keras":
        model = net
      else:
        mech = mf.BandedToeplitz(_BANDS.value) if kind == "bandmf" else None
        if kind.startswith("blt"):  # min_separation as BandMF's b
          mech = blt.BLT(num_steps=10_000, min_separation=_BANDS.value,
                         num_buffers=int(kind[3:]))
        model = dpk.make_private(net, l2_norm_clip=1.0, noise_multiplier=1.0,
                                 noise_mechanism=mech)
      model.compile(optimizer=keras.optimizers.SGD(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
      model.train_on_batch(x, y)  # trace and build
      model.train_on_batch(x, y)
      return model

    steps = {k: make(k) for k in ["keras", "dpsgd", "bandmf"] + blts}
    times = {k: [] for k in steps}
    for _ in range(_ROUNDS.value):
      for k, model in steps.items():
        start = time.perf_counter()
        for _ in range(_STEPS.value):
          model.train_on_batch(x, y)
        times[k].append((time.perf_counter() - start) / _STEPS.value)
    ratio = {k: statistics.median(t / b for t, b in zip(times[k],
                                                        times["keras"]))
             for k in ["dpsgd", "bandmf"] + blts}
    over_dpsgd = {k: statistics.median(t / b for t, b in zip(
        times[k], times["dpsgd"])) for k in ["bandmf"] + blts}
    params = sum(int(np.prod(v.shape)) * 4
                 for v in steps["keras"].trainable_variables)
    buffers = steps["bandmf"].optimizer.dp_state.noise.nbytes
    out[name] = {"step_ms": {k: 1e3 * statistics.median(t)
                             for k, t in times.items()},
                 "ratio_over_keras": ratio, "ratio_over_dpsgd": over_dpsgd,
                 "blt_buffer_bytes": {
                     k: sum(int(v.numpy().nbytes) for v in
                            steps[k].optimizer.dp_state.noise)
                     for k in blts},
                 "param_bytes": params,
                 "buffer_bytes": buffers, "num_bands": _BANDS.value,
                 "load": os.getloadavg()[0]}
    print(f"{name}: keras {out[name]['step_ms']['keras']:.2f} ms, DP-SGD "
          f"{ratio['dpsgd']:.2f}x, BandMF b={_BANDS.value} "
          f"{ratio['bandmf']:.2f}x; buffers {buffers / 2**20:.1f} MiB = "
          f"{buffers / params:.0f}x the parameters; " + ", ".join(
              f"BLT d={k[3:]} {ratio[k]:.2f}x ({over_dpsgd[k]:.2f}x "
              "DP-SGD)" for k in blts), flush=True)
  return out


def _run_example(config, epsilon, seed):
  cmd = [sys.executable, str(_ROOT / "examples" / "dp_digits.py"),
         f"--target_epsilon={epsilon}", f"--seed={seed}"] + _ARGS[config]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                        cwd=_ROOT)
  final = re.search(r"final: test_accuracy=([0-9.]+) epsilon=([0-9.]+)",
                    proc.stdout)
  bands = re.search(r"num_bands=(\d+)", proc.stdout)
  if final is None:
    return {"error": (proc.stderr or proc.stdout)[-400:]}
  return {"accuracy": float(final.group(1)), "epsilon": float(final.group(2)),
          "num_bands": int(bands.group(1)) if bands else 1}


def _accuracy():
  import concurrent.futures  # noqa: PLC0415
  jobs = [(c, e, s) for e in _EPSILONS.value for c in _CONFIGS.value
          for s in range(_RUNS.value)]
  with concurrent.futures.ThreadPoolExecutor(_PARALLEL.value) as pool:
    results = list(pool.map(lambda j: (j, _run_example(*j)), jobs))
  table = {}
  for (config, eps, _), r in results:
    table.setdefault(f"{config}@{eps}", []).append(r)
  summary = {}
  for key, runs in table.items():
    acc = [r["accuracy"] for r in runs if "accuracy" in r]
    summary[key] = {
        "mean": statistics.mean(acc) if acc else None,
        "std": statistics.stdev(acc) if len(acc) > 1 else None,
        "runs": runs}
    bands = sorted({r.get("num_bands") for r in runs if "num_bands" in r})
    print(f"{key:22s} " + (f"{summary[key]['mean']:.4f} ± "
                           f"{summary[key]['std'] or 0:.4f}" if acc else
                           "failed") + f"  (n={len(acc)}, b={bands})",
          flush=True)
  return summary


def _synthetic():
  import keras  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from tf_pxg import accounting  # noqa: PLC0415
  from tf_pxg import mf  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415

  n, d, batch, eps, delta = 10_000, 100, 50, 2.0, 1e-5
  rng = np.random.default_rng(0)
  w_true = rng.standard_normal((d, 1)) / np.sqrt(d)
  # Feature scales from 1 to 0.03: curvatures 1 to 1e-3, so with SGD 0.02
  # the iterate averages the noise over up to 5e4 steps (the prefix-sum
  # workload BandMF is built for), not just the last few.
  scales = np.logspace(0, -1.5, d)
  x = (rng.standard_normal((n + 5000, d)) * scales).astype("float32")
  y = (x @ w_true + 0.1 * rng.standard_normal((n + 5000, 1))).astype(
      "float32")
  out = {}
  for epochs in (5, 50):
    choice = mf.choose_num_bands(n, batch, epochs, eps, delta)
    rows = {}
    for bands in sorted({1, choice.num_bands, 16}):
      sigma = accounting.noise_multiplier_for_epsilon(
          eps, n, batch, epochs=epochs, delta=delta, min_separation=bands)
      mses = []
      for seed in range(3):
        keras.utils.set_random_seed(seed)
        model = dpk.DPSequential(
            [keras.Input((d,)), keras.layers.Dense(1)], l2_norm_clip=1.0,
            noise_multiplier=sigma,
            noise_mechanism=(choice.strategy if bands == choice.num_bands
                             else mf.BandedToeplitz(bands))
            if bands > 1 else None)
        model.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse",
                      steps_per_execution=50)
        model.fit(x[:n], y[:n], batch_size=batch, epochs=epochs, verbose=0)
        mses.append(float(model.evaluate(x[n:], y[n:], verbose=0)))
      rows[bands] = {"sigma": sigma, "test_mse": mses,
                     "mean": statistics.mean(mses)}
      print(f"epochs={epochs} b={bands:2d} sigma={sigma:.3f} test MSE "
            f"{statistics.mean(mses):.4f} ± {statistics.stdev(mses):.4f}",
            flush=True)
    out[f"epochs_{epochs}"] = {
        "chosen_b": choice.num_bands, "runs": rows,
        "predicted_error": {str(c["num_bands"]): c["expected_error"]
                            for c in choice.candidates}}
  return out


def _prefix_error():
  """The workload error through the real train step: a zero-gradient model
  (every update is noise only) trained T steps at the same ε with DP-SGD
  and with BandMF; the mean over steps of the squared prefix sums of the
  per-step noise, per coordinate, in units of (C / B)^2, against
  `choose_num_bands`' prediction sigma^2 * mean_error."""
  import keras  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from tf_pxg import accounting  # noqa: PLC0415
  from tf_pxg import mf  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415

  n, batch, eps, delta, d = 10_000, 50, 2.0, 1e-5, 2000
  out = {}
  for epochs in (5, 50):
    steps = epochs * n // batch
    choice = mf.choose_num_bands(n, batch, epochs, eps, delta)
    predicted = {c["num_bands"]: c["expected_error"]
                 for c in choice.candidates}
    for bands in sorted({1, choice.num_bands}):
      sigma = accounting.noise_multiplier_for_epsilon(
          eps, n, batch, epochs=epochs, delta=delta, min_separation=bands)
      inp = keras.Input((1,))
      model = dpk.DPModel(
          inp, keras.layers.Dense(d, use_bias=False,
                                  kernel_initializer="zeros")(inp),
          l2_norm_clip=1.0, noise_multiplier=sigma,
          noise_mechanism=(choice.strategy if bands == choice.num_bands
                           else mf.BandedToeplitz(bands))
          if bands > 1 else None)
      model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                    steps_per_execution=50)
      xs = np.zeros((steps * batch, 1), "float32")
      ys = np.zeros((steps * batch, d), "float32")
      errors = []
      # Plain batches: each update is exactly -x_t / B (all gradients 0).
      w = model.trainable_variables[0]
      for _ in range(steps):
        model.train_on_batch(xs[:batch], ys[:batch])
        errors.append(float(np.mean(np.square(w.numpy()))) * batch ** 2)
      measured = float(np.mean(errors))
      out[f"epochs_{epochs}_b{bands}"] = {
          "steps": steps, "sigma": sigma, "measured": measured,
          "predicted": predicted[bands]}
      print(f"epochs={epochs} T={steps} b={bands:2d} sigma={sigma:.3f} "
            f"prefix-sum error {measured:.1f} (predicted "
            f"{predicted[bands]:.1f})", flush=True)
  return out


def main(argv):
  del argv
  _RESULTS.mkdir(parents=True, exist_ok=True)
  path = _RESULTS / "dp_mechanisms.json"
  part = {"cost": _cost, "synthetic": _synthetic,
          "prefix_error": _prefix_error,
          "accuracy": _accuracy}[_PART.value]()
  # Read when writing: parts may run at the same time.
  results = json.loads(path.read_text()) if path.exists() else {}
  if _PART.value == "accuracy":  # configurations run separately accumulate
    part = {**results.get("accuracy", {}), **part}
  results[_PART.value] = part
  results[_PART.value + "_finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
  path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
  app.run(main)
