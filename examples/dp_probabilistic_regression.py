"""DP probabilistic regression with TFP heads on scikit-learn's diabetes data.

    pip install "tf_pxg[probability,examples]"
    python examples/dp_probabilistic_regression.py                 # Normal, ε = 8
    python examples/dp_probabilistic_regression.py --head=NegativeBinomial
    python examples/dp_probabilistic_regression.py --target_epsilon=1
    python examples/dp_probabilistic_regression.py --nodp          # baseline
    python examples/dp_probabilistic_regression.py --all           # the table
    python examples/dp_probabilistic_regression.py --timing        # DP/plain

A small network outputs the parameters of a TFP distribution per patient
(`tf_pxg.probability` heads) and is trained by maximum likelihood with
`NegativeLogLikelihood(head)` on a `DPModel` (Poisson batches, per-example
clipping, noise for `--target_epsilon`). It prints ε, the test
log-likelihood (mean per example) and the coverage of the central
`--level` predictive interval on the test split, and the same for the
non-private model with `--nodp`; `--all` runs every head at ε = 1 and 8
and without DP and prints one table.

The data (442 patients, 10 features, a disease-progression score from 25 to
346) ship with scikit-learn: nothing is downloaded. Every transformation
uses public constants only, never statistics of the private data:

* features: scikit-learn ships them centred and scaled to unit L2 norm per
  column; times sqrt(442) gives unit variance;
* Normal, StudentT, MixtureDensity: the score as (y - 150) / 75;
* Poisson, NegativeBinomial: the count floor(y / 10);
* CensoredWeibull: time y / 100, right-censored at a follow-up time drawn
  uniformly on [0.5, 4] with a fixed seed (administrative censoring, made
  up here); the log-likelihood is the censored one, the coverage is
  measured against the true times.

Intervals are the `--level` quantiles of `--samples` draws from each
example's predictive distribution.
"""

import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn import datasets  # noqa: E402
from sklearn import model_selection  # noqa: E402

from tf_pxg import accounting  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402
import tf_pxg.probability as pxp  # noqa: E402

HEADS = ("Normal", "StudentT", "Poisson", "NegativeBinomial",
         "MixtureDensity", "CensoredWeibull")

_HEAD = flags.DEFINE_enum("head", "Normal", HEADS, "Distribution head.")
_EPOCHS = flags.DEFINE_integer("epochs", 40, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 128, "Expected batch size.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 0.05,
                                    "Adam learning rate.")
_L2_NORM_CLIP = flags.DEFINE_float("l2_norm_clip", 10.0,
                                   "Per-example gradient L2 norm bound.")
_TARGET_EPSILON = flags.DEFINE_float("target_epsilon", 8.0,
                                     "ε after --epochs epochs.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "δ of (ε, δ)-DP.")
_LEVEL = flags.DEFINE_float("level", 0.9, "Predictive interval level.")
_SAMPLES = flags.DEFINE_integer("samples", 2000,
                                "Predictive draws per test example.")
_HIDDEN = flags.DEFINE_integer("hidden", 0, "Hidden units (0: linear).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the split and weights.")
_NODP = flags.DEFINE_bool("nodp", False, "Train without privacy.")
_ALL = flags.DEFINE_bool("all", False,
                         "Every head at ε = 1 and 8 and without DP.")
_TIMING = flags.DEFINE_bool("timing", False,
                            "DP / non-private step time for --head.")


def make_head(name):
  return {"MixtureDensity": lambda: pxp.MixtureDensity(3)}.get(
      name, getattr(pxp, name))()


def load_data(head_name, seed):
  """(x_train, x_test, y_train, y_test, true test times or None)."""
  data = datasets.load_diabetes()
  x = (data.data * math.sqrt(442)).astype("float32")
  score = data.target.astype("float64")
  truth = None
  if head_name in ("Poisson", "NegativeBinomial"):
    y = np.floor(score / 10)[:, None]
  elif head_name == "CensoredWeibull":
    t = score / 100
    follow_up = np.random.default_rng(1234).uniform(0.5, 4.0, len(t))
    y = np.stack([np.minimum(t, follow_up), t <= follow_up], 1)
    truth = t
  else:
    y = ((score - 150) / 75)[:, None]
  parts = model_selection.train_test_split(
      x, y.astype("float32"), np.arange(len(x)), test_size=0.2,
      random_state=seed)
  x_train, x_test, y_train, y_test, _, test_rows = parts
  return (x_train, x_test, y_train, y_test,
          None if truth is None else truth[test_rows])


def layers(head, hidden):
  return [keras.Input((10,))] + (
      [keras.layers.Dense(hidden, activation="tanh")] if hidden else []) + [
          keras.layers.Dense(head.num_params)]


def evaluate(model, head, x, y, truth, level, samples, seed=0):
  """(mean test log-likelihood, interval coverage)."""
  params = model.predict(x, verbose=0)
  loglik = float(np.mean(head.log_likelihood(y, params)))
  draws = np.asarray(head.distribution(params).sample(samples, seed=seed))
  lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], axis=0)
  target = y[:, 0] if truth is None else truth
  coverage = float(np.mean((target >= lo) & (target <= hi)))
  return loglik, coverage


def train(head_name, epsilon, args):
  """Trains one model; epsilon None is the non-private baseline.
  Returns (ε spent or inf, test log-likelihood, coverage)."""
  keras.utils.set_random_seed(args["seed"])
  head = make_head(head_name)
  x_train, x_test, y_train, y_test, truth = load_data(head_name, args["seed"])
  n, batch = len(x_train), args["batch_size"]
  callbacks = []
  if epsilon is None:
    model = keras.Sequential(layers(head, args["hidden"]))
  else:
    noise = accounting.noise_multiplier_for_epsilon(
        epsilon, n, batch, epochs=args["epochs"], delta=args["delta"])
    model = dpk.DPSequential(layers(head, args["hidden"]), l2_norm_clip=args["l2_norm_clip"],
                             noise_multiplier=noise)
    callbacks.append(dpk.PrivacyCallback(num_examples=n, batch_size=batch,
                                         delta=args["delta"]))
  model.compile(optimizer=keras.optimizers.Adam(args["learning_rate"]),
                loss=pxp.NegativeLogLikelihood(head))
  model.fit(x_train, y_train, batch_size=batch, epochs=args["epochs"],
            callbacks=callbacks, verbose=0)
  spent = callbacks[0].epsilon() if callbacks else float("inf")
  loglik, coverage = evaluate(model, head, x_test, y_test, truth,
                              args["level"], args["samples"])
  return spent, loglik, coverage


def step_time_ratio(head_name, args, repeats=3):
  """DP step time / non-private step time, measured side by side in this
  process on the same model, batch size and data, compiled with XLA, after
  one warm-up epoch each. Two DP figures: with the Poisson batches a DP
  `fit` draws by default (padded to a fixed physical size above the
  expected batch size, which the time includes) and with the same fixed
  batches as the non-private model (`sampling="shuffled"`: the cost of
  clipping and noise alone)."""
  head = make_head(head_name)
  x, _, y, _, _ = load_data(head_name, args["seed"])
  x, y = np.tile(x, (8, 1)), np.tile(y, (8, 1))  # more steps per epoch
  batch = args["batch_size"]
  times = {}
  for kind in ("plain", "dp_poisson", "dp_fixed"):
    keras.utils.set_random_seed(0)
    model = (keras.Sequential(layers(head, args["hidden"])) if kind == "plain"
             else dpk.DPSequential(layers(head, args["hidden"]),
                                   l2_norm_clip=1.0, noise_multiplier=1.0))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=pxp.NegativeLogLikelihood(head), jit_compile=True)
    fit_kwargs = {"dp_fixed": {"sampling": "shuffled"}}.get(kind, {})
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, **fit_kwargs)
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      model.fit(x, y, batch_size=batch, epochs=1, verbose=0, **fit_kwargs)
      steps = int(math.ceil(len(x) / batch))
      best = min(best, (time.perf_counter() - start) / steps)
    times[kind] = best
  return times


def main(argv):
  del argv
  args = {"seed": _SEED.value, "batch_size": _BATCH_SIZE.value,
          "epochs": _EPOCHS.value, "delta": _DELTA.value,
          "l2_norm_clip": _L2_NORM_CLIP.value,
          "learning_rate": _LEARNING_RATE.value, "level": _LEVEL.value,
          "samples": _SAMPLES.value, "hidden": _HIDDEN.value}
  if _TIMING.value:
    times = step_time_ratio(_HEAD.value, args)
    print(f"head={_HEAD.value} batch_size={args['batch_size']} "
          f"hidden={args['hidden']} " + " ".join(
              f"{k}_step_ms={1e3 * v:.2f}" for k, v in times.items()) +
          f" ratio_poisson={times['dp_poisson'] / times['plain']:.2f}"
          f" ratio_fixed={times['dp_fixed'] / times['plain']:.2f}")
    return
  if not _ALL.value:
    epsilon = None if _NODP.value else _TARGET_EPSILON.value
    spent, loglik, coverage = train(_HEAD.value, epsilon, args)
    print(f"final: head={_HEAD.value} epsilon={spent:.3f} "
          f"delta={args['delta']:g} test_loglik={loglik:.4f} "
          f"coverage{int(100 * args['level'])}={coverage:.3f}")
    return
  print(f"| head | non-private loglik / coverage | ε=1 loglik / coverage "
        f"| ε=8 loglik / coverage |\n|---|---|---|---|")
  for name in HEADS:
    cells = []
    for epsilon in (None, 1.0, 8.0):
      spent, loglik, coverage = train(name, epsilon, args)
      cells.append(f"{loglik:.3f} / {coverage:.3f}" + (
          "" if epsilon is None else f" (ε={spent:.2f})"))
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  app.run(main)
