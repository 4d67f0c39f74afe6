"""Measurements for privacy units larger than one row (docs/privacy_units.md).

    python -m benchmarks.privacy_units speed  [--batch=64 --ks=1,4,16]
    python -m benchmarks.privacy_units augmult [--runs=5 --ks=1,4,16 --epochs=40
                                                --augment=1 --flip=1]
    python -m benchmarks.privacy_units users  [--runs=3 --epochs=40]

speed: time of one DP train step (tf_pxg, `fit`'s compiled train function)
  with augmult K on B examples (K·B rows, `dp_row_mask`) over the plain
  Keras step on the same K·B rows, for the cnn benchmark model.
augmult: digits test accuracy at ε = 8, δ = 1e-5 (examples/dp_digits.py
  --augmult=K, random shifts and flips), mean ± std over runs.
users: digits split into users of varied sizes; example-level DP-SGD
  (ε per example) and user-level DP-SGD (ε per user) side by side.
Prints one JSON line per result.
"""

import json
import math
import os
import re
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flag(name, default):
  for a in sys.argv[2:]:
    if a.startswith(f"--{name}="):
      return type(default)(a.split("=", 1)[1]) if not isinstance(
          default, list) else [int(v) for v in a.split("=", 1)[1].split(",")]
  return default


def speed():
  """Plain and DP steps built once each, then timed in alternating rounds;
  the min over calls (robust on a shared machine) and the median."""
  import keras  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  from tf_pxg import data as dpd  # noqa: PLC0415
  from benchmarks import models  # noqa: PLC0415
  b = _flag("batch", 64)
  reps, rounds = _flag("reps", 10), _flag("rounds", 5)
  jit = bool(_flag("jit", 0))
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step(model, element):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss,
                  jit_compile=jit)
    model.make_train_function()
    it = iter(tf.data.Dataset.from_tensors(element).repeat())

    def call():
      out = model.train_function(it)
      [v.numpy() for v in tf.nest.flatten(out) if hasattr(v, "numpy")]
    for _ in range(3):
      call()
    return call

  for k in _flag("ks", [1, 4, 16]):
    x, y = models.batch("cnn", b * k)
    info = dpd.dp_batch_info(np.ones(b), 1.0, float(b),
                             row_mask=np.ones(b * k) if k > 1 else None)
    dp = dpk.make_private(models.build(keras, "cnn"), l2_norm_clip=1.0,
                          noise_multiplier=1.0)
    fns = {"plain": step(models.build(keras, "cnn"), (x, y)),
           "dp": step(dp, (x, y, info))}
    times = {name: [] for name in fns}
    for _ in range(rounds):
      for name, fn in fns.items():
        for _ in range(reps):
          t0 = time.perf_counter()
          fn()
          times[name].append(time.perf_counter() - t0)
    lo = {n: min(t) * 1e3 for n, t in times.items()}
    med = {n: float(np.median(t)) * 1e3 for n, t in times.items()}
    print(json.dumps({"bench": "speed", "model": "cnn", "B": b, "K": k,
                      "rows": b * k, "jit": jit, "min_ms": lo,
                      "median_ms": med,
                      "ratio_min": lo["dp"] / lo["plain"],
                      "ratio_median": med["dp"] / med["plain"]}),
          flush=True)


def _run(args):
  proc = subprocess.run([sys.executable, *args], capture_output=True,
                        text=True, cwd=_ROOT,
                        env={**os.environ, "PYTHONPATH": _ROOT})
  out = proc.stdout + proc.stderr
  m = re.search(r"final: test_accuracy=(\S+) epsilon=(\S+)", out)
  if not m:
    raise RuntimeError(out[-3000:])
  return float(m.group(1)), float(m.group(2))


def augmult():
  import numpy as np  # noqa: PLC0415
  runs, epochs = _flag("runs", 5), _flag("epochs", 40)
  augment, flip = bool(_flag("augment", 1)), bool(_flag("flip", 1))
  for k in _flag("ks", [1, 4, 16]):
    accs, t0 = [], time.time()
    for seed in range(runs):
      acc, eps = _run([os.path.join(_ROOT, "examples", "dp_digits.py"),
                       f"--augmult={k}", f"--seed={seed}",
                       f"--epochs={epochs}",
                       "--augment" if augment else "--noaugment",
                       "--flip" if flip else "--noflip"])
      accs.append(acc)
    print(json.dumps({"bench": "augmult_digits", "K": k, "epochs": epochs,
                      "augment": augment, "flip": flip,
                      "epsilon": eps, "runs": runs, "acc": accs,
                      "mean": float(np.mean(accs)),
                      "std": float(np.std(accs, ddof=1)) if runs > 1 else 0,
                      "seconds": time.time() - t0}), flush=True)


def _users_run(level, seed, epochs, k_per_user, batch):
  import keras  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  from tf_pxg import accounting  # noqa: PLC0415
  sys.path.insert(0, os.path.join(_ROOT, "examples"))
  import dp_digits  # noqa: PLC0415
  keras.utils.set_random_seed(seed)
  x, x_test, y, y_test = dp_digits.load_data(seed)
  rng = np.random.RandomState(seed)
  # Users of varied sizes: 1 + geometric-ish (lognormal), 1 to 60.
  sizes = []
  while sum(sizes) < len(y):
    sizes.append(int(min(60, max(1, round(rng.lognormal(1.2, 1.0))))))
  sizes[-1] -= sum(sizes) - len(y)
  sizes = [s for s in sizes if s > 0]
  ids = np.repeat(np.arange(len(sizes)), sizes)
  # Users hold examples of few classes (non-iid): sort by label, then deal.
  order = np.argsort(y + rng.uniform(0, 0.5, len(y)), kind="stable")
  x, y = x[order], y[order]
  u, n = len(sizes), len(y)
  target, delta = 8.0, 1e-5
  pop = u if level == "user" else n
  noise = accounting.noise_multiplier_for_epsilon(target, pop, batch,
                                                  epochs=epochs, delta=delta)
  model = dpk.DPSequential(dp_digits.cnn_layers(), l2_norm_clip=1.0,
                           noise_multiplier=noise)
  model.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), metrics=["accuracy"])
  cb = (dpk.PrivacyCallback(num_users=u, batch_size=batch, delta=delta)
        if level == "user" else
        dpk.PrivacyCallback(num_examples=n, batch_size=batch, delta=delta))
  kw = ({"user_ids": ids, "examples_per_user": k_per_user}
        if level == "user" else {})
  model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0,
            callbacks=[cb], **kw)
  _, acc = model.evaluate(x_test, y_test, verbose=0)
  eps = cb.epsilon()
  m = max(sizes)
  return {"level": level, "seed": seed, "users": u, "examples": n,
          "max_user_size": m, "median_user_size": float(np.median(sizes)),
          "batch": batch, "noise_multiplier": noise, "acc": acc,
          "epsilon_example": eps if level == "example" else None,
          "epsilon_user": eps if level == "user" else
          f"group privacy only: {m}*eps={m * eps:.0f}, delta*{m}e^({m - 1}eps)"}


def users():
  runs, epochs = _flag("runs", 3), _flag("epochs", 40)
  k, bu, be = _flag("k", 8), _flag("user_batch", 32), _flag("batch", 64)
  for level, batch in (("example", be), ("user", bu)):
    for seed in range(runs):
      print(json.dumps({"bench": "users_digits", "epochs": epochs, "k": k,
                        **_users_run(level, seed, epochs, k, batch)}),
            flush=True)


if __name__ == "__main__":
  {"speed": speed, "augmult": augmult, "users": users}[sys.argv[1]]()
