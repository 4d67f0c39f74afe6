r"""Sparse embedding tables under DP (issue 32): DP-AdaFEST and DP-FEST.

A two-tower recommendation model on a generated power-law (Zipf)
interaction data set: each example is a user's history of `seq_len` item
ids and one candidate item, drawn with `P(rank r) ~ r^-alpha` over the V
items (inverse CDF of a truncated Pareto: no table of V probabilities), and
a click label from a hidden model (the candidate's hidden 8-d vector
against the history's mean, plus noise). The model has ONE item table of
V x 64 rows, read once for the history and the candidate together (one
`ResourceGather` of `[B, L + 1]` ids, `_resource_embedding`: a table read by two gathers costs the engine a
`[B, V, d]` per-example gradient for its norm today), a Dense user tower,
and a dot product.

Steps compared, all plain SGD on the same variables in one process:

* `keras`: the non-private step (`tf.GradientTape`, sparse gradient);
* `dense`: DP-SGD, the clipped sum (tf_pxg) + dense Gaussian noise on all
  V x 64 entries (`tf_pxg.dp.add_gaussian_noise`);
* `fest`: DP-FEST, noise on a fixed public row set (the `fest_rows` most
  popular ranks: the popularity order is public by construction here);
* `adafest`: DP-AdaFEST (`tf_pxg.dp.sparse_selection.DPAdaFEST`).

Time: every step is built first, then timed in interleaved rounds; the
ratio to `keras` is the median of per-round ratios (`benchmarks.timing`
conventions: load from other processes hits both alike). Memory: each
mode's peak RSS in a subprocess of its own (`--memory_of=mode`). Utility:
AUC on a held-out set after training with sigma from the target epsilon
(`tf_pxg.accounting.noise_multiplier_for_epsilon`), per mode.

  .venv/bin/python -m benchmarks.recsys --rows=100000,1000000,10000000
  .venv/bin/python -m benchmarks.recsys --skip=time,memory --rows=100000 \
      --epsilons=1,8

Writes `benchmarks/results/<output_name>.json` and `.md`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

_ROWS = flags.DEFINE_list("rows", ["100000", "1000000", "10000000"],
                          "Table sizes V.")
_DIM = flags.DEFINE_integer("dim", 64, "Embedding width.")
_BATCH = flags.DEFINE_integer("batch", 256, "Batch size.")
_SEQ = flags.DEFINE_integer("seq_len", 20, "History length.")
_ALPHA = flags.DEFINE_float("alpha", 1.05, "Zipf exponent.")
_MODES = flags.DEFINE_list("modes", ["keras", "dense", "fest", "adafest"],
                           "Steps to compare.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Timing rounds.")
_ROUND_SECONDS = flags.DEFINE_float("round_seconds", 1.0,
                                    "Wall time of one mode per round.")
_SKIP = flags.DEFINE_list("skip", [], "Parts to skip: time, memory, utility.")
_EPSILONS = flags.DEFINE_list("epsilons", ["1", "8"], "Utility targets.")
_UTILITY_ROWS = flags.DEFINE_integer("utility_rows", 100000,
                                     "V of the utility runs.")
_TRAIN = flags.DEFINE_integer("train_examples", 65536, "Training set size.")
_EPOCHS = flags.DEFINE_float("epochs", 3.0, "Utility training epochs.")
_LR = flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate.")
_CLIP = flags.DEFINE_float("l2_norm_clip", 1.0, "C.")
_FALSE_POSITIVES = flags.DEFINE_float(
    "false_positives", 64.0, "DP-AdaFEST: the expected number of untouched "
    "rows selected per step, V p; tau = sigma_sel Q^-1(false_positives / "
    "V) (`threshold_for`), so the selection's cost is the same at every V "
    "and every sigma (a fixed tau would select p V rows, growing with V).")
_SEL_SIGMA = flags.DEFINE_float(
    "selection_noise_multiplier_ratio", 3.0,
    "DP-AdaFEST sigma_sel as a multiple of the accounted sigma.")
_FEST_ROWS = flags.DEFINE_integer("fest_rows", 2048,
                                  "DP-FEST's fixed rows (top ranks).")
_MEMORY_OF = flags.DEFINE_string("memory_of", "", "Internal: one mode's "
                                 "peak RSS at --rows (first value).")
_OUT = flags.DEFINE_string("output_dir", "", "Default benchmarks/results.")
_OUTPUT_NAME = flags.DEFINE_string("output_name", "recsys", "File stem.")
_SEED = flags.DEFINE_integer("seed", 0, "Data and model seed.")

HIDDEN = 8


# ---------------------------------------------------------------------------
# Data.
# ---------------------------------------------------------------------------


def zipf_ranks(rng, size, num_rows, alpha):
  """Ranks in [0, V) with P(r) ~ (r + 1)^-alpha (continuous approximation:
  the inverse CDF of a Pareto truncated to [1, V + 1], floored)."""
  u = rng.random(size)
  a = 1.0 - alpha
  top = (num_rows + 1.0)**a
  x = (1.0 + u * (top - 1.0))**(1.0 / a)
  return np.minimum(np.floor(x).astype(np.int64) - 1, num_rows - 1)


def hidden_vectors(ids, seed):
  """The hidden model's 8-d item vectors, a hash of the id (no V x 8
  table): the same id always gets the same vector."""
  ids = np.asarray(ids, np.uint64)
  out = np.empty(ids.shape + (HIDDEN,), np.float64)
  for k in range(HIDDEN):
    h = (ids * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed * 7919 + k)) \
        & np.uint64(0xFFFFFFFF)
    h = (h ^ (h >> np.uint64(16))) * np.uint64(0x45D9F3B) \
        & np.uint64(0xFFFFFFFF)
    u = ((h ^ (h >> np.uint64(16))) & np.uint64(0xFFFFFF)).astype(
        np.float64) / float(1 << 24)
    out[..., k] = math.sqrt(3.0) * (2.0 * u - 1.0)  # mean 0, variance 1
  return out


def make_data(num_examples, num_rows, seq_len, alpha, seed):
  """`(history [N, L] int32, candidate [N] int32, label [N] float32)`."""
  rng = np.random.default_rng(seed)
  hist = zipf_ranks(rng, (num_examples, seq_len), num_rows, alpha)
  cand = zipf_ranks(rng, (num_examples,), num_rows, alpha)
  user = hidden_vectors(hist, seed).mean(axis=1) * math.sqrt(seq_len)
  score = np.sum(user * hidden_vectors(cand, seed), axis=1) / math.sqrt(
      HIDDEN)
  label = (score + 0.5 * rng.normal(size=num_examples) > 0).astype(np.float32)
  return hist.astype(np.int32), cand.astype(np.int32), label


# ---------------------------------------------------------------------------
# Model and steps.
# ---------------------------------------------------------------------------


def _resource_embedding(keras):
  """`keras.layers.Embedding` that gathers from the variable itself.

  Keras' Embedding reads the whole table (`ReadVariableOp`) and gathers
  from the copy (`GatherV2`); the optimizer's in-place sparse update that
  follows must then copy the table (the read still references its
  buffer): O(V) per step for every mode, 2.6 s against 0.04 s at 10^6 x 64
  on this machine. `tf.gather` on the variable is a `ResourceGather`: no
  copy, so the non-private step costs O(B L d) as it should.
  """
  import tensorflow as tf  # noqa: PLC0415

  class ResourceEmbedding(keras.layers.Embedding):

    def call(self, inputs):
      return tf.gather(self.embeddings.value, tf.cast(inputs, tf.int32))

  return ResourceEmbedding


def build_model(num_rows, dim, seq_len, seed):
  """Two towers over one shared item table, read by one gather."""
  import keras  # noqa: PLC0415
  keras.utils.set_random_seed(seed)
  hist = keras.Input((seq_len,), dtype="int32", name="history")
  cand = keras.Input((), dtype="int32", name="candidate")
  table = _resource_embedding(keras)(
      num_rows, dim, name="items",
      embeddings_initializer=keras.initializers.RandomNormal(stddev=0.05))
  # One lookup of history and candidate together: the engine's norm of a
  # table read by two gathers materialises [B, V, d] (merged uses), one
  # gather takes the ghost norm.
  ids = keras.layers.Concatenate(axis=1)(
      [hist, keras.layers.Reshape((1,))(cand)])
  rows = table(ids)
  user = keras.layers.GlobalAveragePooling1D()(rows[:, :seq_len])
  user = keras.layers.Dense(dim, name="user_tower")(user)
  item = rows[:, seq_len]
  logit = keras.layers.Dot(axes=1)([user, item])
  logit = keras.layers.Dense(1, name="bias")(logit)
  return keras.Model([hist, cand], keras.layers.Flatten()(logit))


def make_steps(model, modes, noise_multiplier, batch, fest_rows, threshold,
               selection_ratio, clip, lr, seed):
  """`{mode: tf.function(x, y) -> None}`, one SGD step each."""
  import keras  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415
  import tf_pxg  # noqa: PLC0415
  from tf_pxg.dp import sparse_selection as ss  # noqa: PLC0415
  variables = model.trainable_variables
  table_index = [i for i, v in enumerate(variables) if v.path.startswith(
      "items")][0]
  generator = tf.random.Generator.from_seed(seed + 1)
  opt = keras.optimizers.SGD(lr)
  opt.build(variables)
  sigma = noise_multiplier
  sigma_sel = selection_ratio * sigma if sigma else 0.0
  adafest = ss.DPAdaFEST(threshold=threshold,
                         selection_noise_multiplier=sigma_sel)
  sigma_g_ada = (adafest.gradient_noise_multiplier(sigma, sigma_sel)
                 if sigma else 0.0)
  table_key = variables[table_index].path
  fest = ss.DPFEST({table_key: np.arange(fest_rows)})
  bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)

  def losses_of(x, y):
    return bce(y[:, None], model(x, training=True)[:, None])

  def keras_step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(losses_of(x, y))
    opt.apply(tape.gradient(loss, variables), variables)

  def dp_step(x, y, sparse, sigma_g):
    with tf_pxg.GradientTape() as tape:
      losses = losses_of(x, y)
    if sparse is None:
      sums, _ = tape.clipped_gradient_sum(losses, variables, clip)
      noisy = tf_pxg.dp.add_gaussian_noise(sums, sigma_g * clip,
                                           generator=generator,
                                           scale=1.0 / batch)
      opt.apply([tf_pxg.dp.densify(g) for g in noisy], variables)
      return
    # The sparse stage reads the gathers' ids before the gradient, then
    # noises the selected rows (and the dense variables densely).
    sparse.prepare(tape, variables, batch_size=tf.shape(losses)[0])
    sums, _ = tape.clipped_gradient_sum(losses, variables, clip)
    noisy, _ = sparse.add(sums, None, None, noise_multiplier=sigma_g,
                          l2_norm_clip=clip, num_replicas=1,
                          source=generator, normalizer=float(batch))
    opt.apply(noisy, variables)

  steps = {
      "keras": keras_step,
      "dense": lambda x, y: dp_step(x, y, None, sigma),
      "fest": lambda x, y: dp_step(x, y, fest, sigma),
      "adafest": lambda x, y: dp_step(x, y, adafest, sigma_g_ada),
  }
  return {m: tf.function(steps[m]) for m in modes}, {
      "sigma": sigma, "sigma_sel": sigma_sel, "sigma_g_adafest": sigma_g_ada,
      "threshold": threshold,
      "false_positive_rate": adafest.false_positive_rate}


def threshold_for(num_rows, selection_noise_multiplier, false_positives,
                  selection_l2_norm_clip=1.0):
  """DP-AdaFEST's tau for `false_positives` expected untouched rows
  selected per step: `p = false_positives / V = Q(tau / (sigma_sel
  C_sel))`. Data-independent (V and the noise only): choosing it leaks
  nothing."""
  from scipy import stats  # noqa: PLC0415
  if not selection_noise_multiplier:
    return 0.0
  rate = min(1.0, false_positives / num_rows)
  return float(selection_noise_multiplier * selection_l2_norm_clip *
               stats.norm.isf(rate))


def _batches(data, batch, seed):
  hist, cand, label = data
  rng = np.random.default_rng(seed)
  n = label.shape[0]
  while True:
    idx = rng.integers(0, n, batch)
    yield (hist[idx], cand[idx]), label[idx]


# ---------------------------------------------------------------------------
# Parts.
# ---------------------------------------------------------------------------


def time_rows(num_rows, modes, rounds, round_seconds):
  """Per mode: median step time and per-round ratio to keras."""
  import tensorflow as tf  # noqa: PLC0415
  data = make_data(8 * _BATCH.value, num_rows, _SEQ.value, _ALPHA.value,
                   _SEED.value)
  model = build_model(num_rows, _DIM.value, _SEQ.value, _SEED.value)
  steps, info = make_steps(model, modes, 1.0, _BATCH.value, _FEST_ROWS.value,
                           threshold_for(num_rows, _SEL_SIGMA.value,
                                         _FALSE_POSITIVES.value),
                           _SEL_SIGMA.value, _CLIP.value, 1e-3, _SEED.value)
  feed = _batches(data, _BATCH.value, 1)
  fixed = [next(feed) for _ in range(4)]
  fixed = [((tf.constant(h), tf.constant(c)), tf.constant(y))
           for (h, c), y in fixed]
  for fn in steps.values():  # trace and warm up
    for x, y in fixed[:2]:
      fn(x, y)
  per = {m: 1 for m in modes}
  for m, fn in steps.items():  # calibrate
    t0 = time.perf_counter()
    fn(*fixed[0])
    dt = time.perf_counter() - t0
    per[m] = max(1, int(round_seconds / max(dt, 1e-4)))
  times = {m: [] for m in modes}
  for _ in range(rounds):
    for m, fn in steps.items():
      t0 = time.perf_counter()
      for i in range(per[m]):
        fn(*fixed[i % len(fixed)])
      times[m].append((time.perf_counter() - t0) / per[m])
  out = {"rows": num_rows, "step_ms": {}, "ratio": {}}
  for m in modes:
    out["step_ms"][m] = 1e3 * float(np.median(times[m]))
    if "keras" in times:
      out["ratio"][m] = float(np.median(
          np.array(times[m]) / np.array(times["keras"])))
  out["rows_updated_per_step"] = rows_updated(model, steps, fixed, modes)
  out["load"] = os.getloadavg()
  out.update(info)
  return out


def rows_updated(model, steps, fixed, modes):
  """Rows of the table changed by one step, per mode (gradient density)."""
  table = [v for v in model.trainable_variables
           if v.path.startswith("items")][0]
  out = {}
  for m, fn in steps.items():
    before = table.numpy()
    fn(*fixed[0])
    out[m] = int(np.sum(np.any(table.numpy() != before, axis=1)))
  return out


def _status_mb(field):
  """A `/proc/self/status` field (VmRSS, VmHWM) in MB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  return float("nan")


def memory_of(mode, num_rows):
  """The peak RSS (MB) over three steps of `mode`, after building the
  model, the data and the step: the high-water mark is reset (Linux
  `/proc/self/clear_refs`) after a first step, so the table's initialiser
  temporaries do not count; also the RSS before the steps."""
  import tensorflow as tf  # noqa: PLC0415
  data = make_data(4 * _BATCH.value, num_rows, _SEQ.value, _ALPHA.value,
                   _SEED.value)
  model = build_model(num_rows, _DIM.value, _SEQ.value, _SEED.value)
  steps, _ = make_steps(model, [mode], 1.0, _BATCH.value, _FEST_ROWS.value,
                        threshold_for(num_rows, _SEL_SIGMA.value,
                                      _FALSE_POSITIVES.value),
                        _SEL_SIGMA.value, _CLIP.value, 1e-3, _SEED.value)
  feed = _batches(data, _BATCH.value, 1)
  batches = [next(feed) for _ in range(4)]
  batches = [((tf.constant(h), tf.constant(c)), tf.constant(y))
             for (h, c), y in batches]
  steps[mode](*batches[0])  # trace
  before = _status_mb("VmRSS")
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
  for x, y in batches[1:]:
    steps[mode](x, y)
  return {"mode": mode, "rows": num_rows, "peak_rss_mb": _status_mb("VmHWM"),
          "rss_before_mb": before}


def measure_memory(num_rows, modes):
  out = {}
  for m in modes:
    cmd = [sys.executable, "-m", "benchmarks.recsys", f"--memory_of={m}",
           f"--rows={num_rows}", f"--batch={_BATCH.value}",
           f"--seq_len={_SEQ.value}", f"--dim={_DIM.value}",
           f"--false_positives={_FALSE_POSITIVES.value}",
           f"--fest_rows={_FEST_ROWS.value}",
           f"--selection_noise_multiplier_ratio={_SEL_SIGMA.value}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out[m] = json.loads(lines[-1]) if lines else {
        "error": proc.stderr.strip().splitlines()[-1:]}
  return out


def auc(labels, scores):
  """ROC AUC by the rank-sum (Mann-Whitney) formula, ties averaged."""
  from scipy import stats  # noqa: PLC0415
  ranks = stats.rankdata(scores)
  pos = labels > 0.5
  n_pos, n_neg = int(pos.sum()), int((~pos).sum())
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def utility(num_rows, epsilons, modes):
  """Held-out AUC per mode and target epsilon (and non-private)."""
  import tensorflow as tf  # noqa: PLC0415
  from tf_pxg import accounting  # noqa: PLC0415
  n = _TRAIN.value
  train = make_data(n, num_rows, _SEQ.value, _ALPHA.value, _SEED.value)
  test = make_data(16384, num_rows, _SEQ.value, _ALPHA.value,
                   _SEED.value + 1)
  # The hidden vectors hash the id with the data seed: the test set must
  # share them, so regenerate its ids with another stream, same hash.
  test = _relabel(test, _SEED.value)
  steps_total = int(math.ceil(_EPOCHS.value * n / _BATCH.value))
  results = []
  for eps in [None] + [float(e) for e in epsilons]:
    sigma = 0.0 if eps is None else accounting.noise_multiplier_for_epsilon(
        eps, n, _BATCH.value, delta=1.0 / n, steps=steps_total)
    for m in (["keras"] if eps is None else [m for m in modes
                                            if m != "keras"]):
      model = build_model(num_rows, _DIM.value, _SEQ.value, _SEED.value)
      # tau scales with sigma_sel = ratio * sigma: the same
      # false-positive count V Q(tau / sigma_sel) at every epsilon.
      steps, info = make_steps(model, [m], sigma, _BATCH.value,
                               _FEST_ROWS.value, threshold_for(
                                   num_rows, _SEL_SIGMA.value * sigma,
                                   _FALSE_POSITIVES.value),
                               _SEL_SIGMA.value, _CLIP.value, _LR.value,
                               _SEED.value)
      feed = _batches(train, _BATCH.value, 2)
      t0 = time.time()
      for _ in range(steps_total):
        (h, c), y = next(feed)
        steps[m]((tf.constant(h), tf.constant(c)), tf.constant(y))
      scores = model.predict([test[0], test[1]], batch_size=4096,
                             verbose=0).reshape(-1)
      row = {"mode": m, "epsilon": eps, "rows": num_rows,
             "steps": steps_total, "auc": auc(test[2], scores),
             "seconds": time.time() - t0}
      row.update(info)
      print(json.dumps(row), flush=True)
      results.append(row)
  return results


def _relabel(data, seed):
  hist, cand, _ = data
  rng = np.random.default_rng(seed + 12345)
  user = hidden_vectors(hist, seed).mean(axis=1) * math.sqrt(hist.shape[1])
  score = np.sum(user * hidden_vectors(cand, seed), axis=1) / math.sqrt(
      HIDDEN)
  label = (score + 0.5 * rng.normal(size=score.shape[0]) > 0).astype(
      np.float32)
  return hist, cand, label


def markdown(result) -> str:
  lines = ["# Sparse embedding tables under DP (issue 32)", "",
           f"Two towers, one item table V x {_DIM.value} read by one "
           f"ResourceGather, B={_BATCH.value}, history L={_SEQ.value}, "
           f"Zipf alpha={_ALPHA.value}; plain SGD.", ""]
  if result.get("time"):
    lines += ["| V | mode | step ms | ratio to keras | rows updated/step "
              "| peak RSS MB |", "|---|---|---|---|---|---|"]
    for t in result["time"]:
      mem = result.get("memory", {}).get(str(t["rows"]), {})
      for m, ms in t["step_ms"].items():
        peak = mem.get(m, {}).get("peak_rss_mb")
        lines.append(
            f"| {t['rows']:.0e} | {m} | {ms:.1f} | "
            f"{t['ratio'].get(m, float('nan')):.2f} | "
            f"{t['rows_updated_per_step'][m]} | "
            f"{'' if peak is None else f'{peak:.0f}'} |")
    lines.append("")
  if result.get("utility"):
    lines += ["| V | epsilon | mode | sigma | AUC |", "|---|---|---|---|---|"]
    for u in result["utility"]:
      lines.append(f"| {u['rows']:.0e} | {u['epsilon']} | {u['mode']} | "
                   f"{u['sigma']:.3g} | {u['auc']:.4f} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  rows = [int(float(r)) for r in _ROWS.value]
  if _MEMORY_OF.value:
    print(json.dumps(memory_of(_MEMORY_OF.value, rows[0])), flush=True)
    return
  out_dir = pathlib.Path(_OUT.value or pathlib.Path(__file__).parent /
                         "results")
  out_dir.mkdir(parents=True, exist_ok=True)
  result = {"flags": {f.name: f.value for f in
                      flags.FLAGS.get_key_flags_for_module(sys.modules[
                          __name__])},
            "load_start": os.getloadavg(), "time": [], "memory": {}}
  for r in rows:
    if "time" not in _SKIP.value:
      t = time_rows(r, _MODES.value, _ROUNDS.value, _ROUND_SECONDS.value)
      print(json.dumps(t), flush=True)
      result["time"].append(t)
    if "memory" not in _SKIP.value:
      result["memory"][str(r)] = measure_memory(r, _MODES.value)
      print(json.dumps(result["memory"][str(r)]), flush=True)
  if "utility" not in _SKIP.value:
    result["utility"] = utility(_UTILITY_ROWS.value, _EPSILONS.value,
                                _MODES.value)
  result["load_end"] = os.getloadavg()
  stem = out_dir / _OUTPUT_NAME.value
  stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
  stem.with_suffix(".md").write_text(markdown(result))
  print(markdown(result))


if __name__ == "__main__":
  app.run(main)
