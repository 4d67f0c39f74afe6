"""tf_pxg.tuning.PrivateSearch end to end on tiny Keras models: the
winner's ε in its privacy ledger, an attack that looks for anything of a
losing run (files, output, live objects, names), the refusals, and the
interplay with clipping policies, BandMF and MirroredStrategy."""

import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import mf
from tf_pxg import tuning
import tf_pxg
import tf_pxg.keras as dpk

N = 120


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.random((N, 4)).astype("float32")
  return x, (x[:, 0] > 0.5).astype("int32")


X, Y = _data()
CANDIDATES = [dict(learning_rate=lr, l2_norm_clip=c, epochs=e, batch_size=30)
              for lr in (0.01, 0.1) for c in (0.5, 1.0) for e in (1, 2)]


def isolated_dirs(tmp_path, monkeypatch):
  """A fresh working directory and a fresh temporary directory for this
  process (`tempfile.tempdir`: AutoGraph writes one source file there per
  converted function; the machine's /tmp is shared with other processes),
  both empty."""
  dirs = tmp_path / "work", tmp_path / "temp"
  for d in dirs:
    d.mkdir()
  monkeypatch.chdir(dirs[0])
  monkeypatch.setattr(tempfile, "tempdir", str(dirs[1]))
  return dirs


def files_in(dirs):
  return sorted(str(p) for d in dirs for p in d.rglob("*"))


def _trainer(log=None, fit_kwargs=None, **model_kwargs):
  """The user's training function: a DP model with NoisyLoss, string loss,
  numpy arrays. `log` collects weakrefs of every model it trains."""

  def train(config, noise_multiplier):
    model = dpk.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(2)],
        l2_norm_clip=config["l2_norm_clip"], noise_multiplier=noise_multiplier,
        noisy_loss=dpk.NoisyLoss(5.0, 10 * noise_multiplier), **model_kwargs)
    model.compile(optimizer=keras.optimizers.Adam(config["learning_rate"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    model.fit(X, Y, batch_size=config["batch_size"], epochs=config["epochs"],
              verbose=0, **(fit_kwargs or {}))
    if log is not None:
      log.append(weakref.ref(model))
    return model

  return train


def _search(train, seed, **kwargs):
  kwargs.setdefault("noise_multiplier", 1.5)
  return tuning.PrivateSearch(
      CANDIDATES, train, tuning.NoisyTrainingLoss(),
      kwargs.pop("num_runs", tuning.TruncatedNegativeBinomial(1.0, mean=3.0)),
      num_examples=N, seed=seed, **kwargs)


def test_winner_is_released_with_the_searchs_epsilon_in_its_ledger():
  search = tuning.PrivateSearch(
      CANDIDATES, _trainer(), tuning.NoisyTrainingLoss(),
      tuning.TruncatedNegativeBinomial(1.0, mean=2.0), num_examples=N,
      target_epsilon=4.0, seed=5)
  assert search.epsilon == pytest.approx(4.0, abs=1e-3)
  result = search.run()
  assert result.hyperparameters in CANDIDATES
  assert result.epsilon == search.epsilon and result.delta == 1e-5
  assert result.event == search.event
  plan = search.plans.by_key[tuning.search.config_key(result.hyperparameters)]
  assert result.noise_multiplier == plan.noise_multiplier
  assert result.model.noise_multiplier == plan.noise_multiplier
  # The ledger: one release, the search's event; ε as any release.
  assert result.model.epsilon(1e-5) == pytest.approx(result.epsilon,
                                                     rel=1e-12)
  assert "DP hyperparameter search" in result.model.privacy_summary()
  assert np.isfinite(result.score)
  # K is not among the released fields
  assert set(vars(result)) == {
      "model", "hyperparameters", "noise_multiplier", "score",
      "score_stddev", "score_source", "epsilon", "delta", "event",
      "num_runs"}
  # a later fit composes on top of the search
  result.model.fit(X, Y, batch_size=30, epochs=1, verbose=0)
  assert result.model.epsilon(1e-5) > result.epsilon


def _dp_models_alive():
  gc.collect()
  return [o for o in gc.get_objects() if isinstance(o, dpk.DPSequential)]


def test_attack_a_losing_run_leaves_nothing(tmp_path, capfd, monkeypatch):
  """The user's train_fn prints (print, tf.print), shows Keras' progress
  bar, writes a TensorBoard event file, a CSV log, a checkpoint and a
  backup (relative paths), and draws from the global generators. After
  the search: no file in the working directory or the temp directory, no
  output (TF's "unrestored values" warnings at garbage collection
  included), the caller's global generators where they were, no new live
  model but the winner, and the winner's names count no run (each run is
  its own process: tf_pxg.tuning.isolation)."""
  dirs = isolated_dirs(tmp_path, monkeypatch)

  def noisy_train(config, noise_multiplier):
    import random  # pylint: disable=import-outside-toplevel
    print("run of", config, random.random(), np.random.rand(), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    model = dpk.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(2)],
        l2_norm_clip=config["l2_norm_clip"], noise_multiplier=noise_multiplier,
        noisy_loss=dpk.NoisyLoss(5.0, 10 * noise_multiplier))
    model.compile(optimizer=keras.optimizers.Adam(config["learning_rate"]),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    model.fit(X, Y, batch_size=30, epochs=config["epochs"], verbose=1,
              callbacks=[keras.callbacks.CSVLogger("log.csv"),
                         keras.callbacks.ModelCheckpoint(
                             "ckpt.weights.h5", save_weights_only=True),
                         keras.callbacks.BackupAndRestore("backup",
                                                          delete_checkpoint=
                                                          False)])
    tf.print("tf.print from the run", model.trainable_variables[0][0])
    with tf.summary.create_file_writer("tb").as_default():  # TensorBoard
      tf.summary.write("score", model.history.history["loss"][-1], step=0)
    # A checkpoint restored and dropped: TF warns of unrestored values
    # when it is garbage-collected (after the run's code returned).
    tf.train.Checkpoint(model=model).write("partial")
    tf.train.Checkpoint(model=keras.Sequential([keras.layers.Dense(
        1)])).restore("partial")
    assert os.listdir(".")  # it did write, in the run's directory
    return model

  np.random.seed(7)
  before = _dp_models_alive()
  tf.zeros([1]).numpy()  # the caller's own TF start logs before capture
  capfd.readouterr()
  result = _search(noisy_train, seed=11,
                   num_runs=tuning.TruncatedNegativeBinomial(
                       1.0, mean=4.0)).run()
  gc.collect()
  out = capfd.readouterr()
  assert out.out == "" and out.err == "", out
  assert files_in(dirs) == [], files_in(dirs)
  # NumPy's global generator is the caller's alone (Python's `random` is
  # drawn from by Keras when it rebuilds the winner's layers: once,
  # whatever K).
  assert np.random.rand() == np.random.RandomState(7).rand()
  new = [m for m in _dp_models_alive() if not any(m is b for b in before)]
  assert new == [result.model]
  assert [layer.name for layer in result.model.layers] == ["dense"]
  assert result.model.name == "dp_sequential"


def _untrained(config, noise_multiplier):
  """A run that builds its model from the global generators and trains
  nothing (its ledger is empty: inside any plan)."""
  del config
  model = dpk.DPSequential([keras.Input((4,)), keras.layers.Dense(64)],
                           l2_norm_clip=1.0,
                           noise_multiplier=noise_multiplier)
  model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
  return model


def test_attack_a_seeded_caller_cannot_replay_the_winners_index():
  """keras.utils.set_random_seed before the search (as the tuning example
  does) must not reach the runs: before issue 50 the winner's initial
  weights equalled (correlation 0.999) the j-th model a replay of that
  seed builds, which tells the winner's index among the K runs. Each run
  now seeds itself from the OS CSPRNG in its own process."""
  xv, yv = _data(1)
  keras.utils.set_random_seed(0)
  result = tuning.PrivateSearch(
      [{"epochs": 1}], _untrained,
      tuning.PrivateValidation(xv, yv, noise_multiplier=1.0),
      tuning.TruncatedNegativeBinomial(1.0, mean=3.0), num_examples=N,
      batch_size=30, noise_multiplier=1.0).run()
  if result.model is None:
    return
  winner = result.model.layers[0].kernel.numpy().ravel()
  keras.utils.set_random_seed(0)
  replayed = [_untrained(None, 1.0).layers[0].kernel.numpy().ravel()
              for _ in range(12)]
  corr = max(abs(np.corrcoef(winner, r)[0, 1]) for r in replayed)
  assert corr < 0.5, corr


def test_a_run_releasing_more_than_planned_stops_the_search():
  train = _trainer()

  def cheating(config, noise_multiplier):
    return train(config, noise_multiplier / 2)

  before = len(_dp_models_alive())
  with pytest.raises(tuning.SearchError, match="more than its planned"):
    _search(cheating, seed=2).run()
  assert len(_dp_models_alive()) == before


@pytest.mark.parametrize("where", ["model", "fit"])
def test_a_run_logging_unprotected_metrics_stops_the_search(where):
  # The winner's model carries its History: un-noised metrics of the
  # private batches there would leave the search outside every ε.
  if where == "model":
    train = _trainer(unprotected_training_metrics=True)
  else:
    train = _trainer(fit_kwargs=dict(unprotected_training_metrics=True))
  before = len(_dp_models_alive())
  with pytest.raises(tuning.SearchError, match="unprotected_training_metrics"):
    _search(train, seed=2).run()
  assert len(_dp_models_alive()) == before


def test_a_failing_run_raises_without_traceback_to_its_objects():
  train = _trainer()

  def failing(config, noise_multiplier):
    train(config, noise_multiplier)
    raise RuntimeError(f"boom at lr {config['learning_rate']}")

  before = len(_dp_models_alive())
  with pytest.raises(tuning.SearchError, match="RuntimeError: boom") as info:
    _search(failing, seed=11,
            num_runs=tuning.TruncatedNegativeBinomial(1.0, mean=4.0)).run()
  assert info.value.__context__ is None and info.value.__cause__ is None
  del info
  assert len(_dp_models_alive()) == before


def test_a_plain_model_is_refused():

  def plain(config, noise_multiplier):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

  with pytest.raises(tuning.SearchError, match="privacy ledger"):
    _search(plain, seed=0).run()


def test_poisson_k_zero_releases_nothing_but_epsilon():
  calls = []

  def train(config, noise_multiplier):
    calls.append(1)
    return _trainer()(config, noise_multiplier)

  # find a seed whose first draw is K = 0 (P = e^-1 for mean 1)
  dist = tuning.Poisson(1.0)
  seed = next(s for s in range(100)
              if dist.sample(tuning.distributions.random_source(s)) == 0)
  result = _search(train, seed=seed, num_runs=dist).run()
  assert calls == [] and result.model is None and result.score is None
  assert np.isfinite(result.epsilon)


def test_private_and_public_validation_scores():
  xv, yv = _data(1)
  private = tuning.PrivateValidation(xv, yv, noise_multiplier=2.0, seed=0)
  search = tuning.PrivateSearch(
      CANDIDATES[:2], _trainer(), private,
      tuning.TruncatedNegativeBinomial(1.0, mean=2.0), num_examples=N,
      noise_multiplier=1.5, seed=3)
  # the score's Gaussian is inside the per-run event
  assert search.per_run_event.events[1] == private.event
  result = search.run()
  assert result.score_stddev == pytest.approx(2.0 / N)
  assert "private held-out" in result.score_source
  public = tuning.PublicValidation(xv, yv)
  result = tuning.PrivateSearch(
      CANDIDATES[:2], _trainer(), public,
      tuning.TruncatedNegativeBinomial(1.0, mean=2.0), num_examples=N,
      noise_multiplier=1.5, seed=3).run()
  pred = result.model.predict(xv, verbose=0).argmax(-1)
  assert result.score == pytest.approx((pred == yv).mean())
  assert "DECLARED PUBLIC" in result.score_source


def test_clipping_policy_and_bandmf_inside_a_search():
  """A clipping policy and BandMF with cyclic Poisson sampling work in a
  run as in fit: the run's ledger matches the planned BandMF event."""
  mechanism = mf.BandedToeplitz(2)
  search = tuning.PrivateSearch(
      CANDIDATES[:4], _trainer(clipping=tf_pxg.clipping.Automatic(),
                               noise_mechanism=mechanism),
      tuning.NoisyTrainingLoss(),
      tuning.TruncatedNegativeBinomial(1.0, mean=2.0),
      run_event=tuning.dpsgd_run_event(N, mechanism=mechanism),
      noise_multiplier=2.0, seed=4)
  result = search.run()
  assert result.model.epsilon(1e-5) == pytest.approx(result.epsilon)
  # and the DP-SGD event would not have described the run
  with pytest.raises(tuning.SearchError, match="more than its planned"):
    tuning.PrivateSearch(
        CANDIDATES[:1], _trainer(noise_mechanism=mf.BandedToeplitz(2)),
        tuning.NoisyTrainingLoss(),
        tuning.TruncatedNegativeBinomial(1.0, mean=2.0), num_examples=N,
        noise_multiplier=2.0, seed=4).run()


_MIRRORED = textwrap.dedent("""
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np, tensorflow as tf, keras
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import tf_pxg.keras as dpk
    from tf_pxg import tuning
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.random((64, 4)).astype("float32")
    y = (x[:, 0] > 0.5).astype("int32")

    def train(config, noise_multiplier):
      # Each run is its own process: it makes its own devices and strategy
      # (a strategy object does not cross processes).
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(
          cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
      with strategy.scope():
        model = dpk.DPSequential(
            [keras.Input((4,)), keras.layers.Dense(2)], l2_norm_clip=1.0,
            noise_multiplier=noise_multiplier,
            noisy_loss=dpk.NoisyLoss(5.0, 10 * noise_multiplier))
        model.compile(optimizer=keras.optimizers.SGD(config["lr"]),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
      model.fit(x, y, batch_size=16, epochs=1, verbose=0)
      return model

    # The winner is rebuilt in the caller's strategy scope.
    with strategy.scope():
      result = tuning.PrivateSearch(
          [{"lr": 0.1}, {"lr": 0.5}], train, tuning.NoisyTrainingLoss(),
          tuning.TruncatedNegativeBinomial(1.0, mean=2.0), num_examples=64,
          batch_size=16, epochs=1, noise_multiplier=1.5, seed=1).run()
    print("RESULT", result.model.distribute_strategy is strategy,
          result.model.epsilon(1e-5) == result.epsilon, result.epsilon)
    try:
      import keras_tuner  # the [tuner] extra
    except ImportError:
      raise SystemExit(0)

    def build_model(hp):  # a plain model, made private in the scope
      model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
      model.compile(optimizer=keras.optimizers.SGD(
          hp.Choice("lr", [0.1, 0.5])),
          loss="sparse_categorical_crossentropy")
      return model

    # A strategy object cannot reach the runs' processes: refused by name;
    # the winner is rebuilt in the caller's strategy scope.
    try:
      tuning.DPTuner(
          build_model,
          num_runs=tuning.TruncatedNegativeBinomial(1.0, mean=2.0),
          score=tuning.NoisyTrainingLoss(), noise_multiplier=1.5, seed=1,
          distribution_strategy=strategy).search(x, y, batch_size=16,
                                                 epochs=1)
      raise SystemExit("distribution_strategy= was not refused")
    except ValueError as e:
      assert "distribution_strategy" in str(e)
    tuner = tuning.DPTuner(
        build_model, num_runs=tuning.TruncatedNegativeBinomial(1.0, mean=2.0),
        score=tuning.NoisyTrainingLoss(), noise_multiplier=1.5, seed=1)
    with strategy.scope():
      tuner.search(x, y, batch_size=16, epochs=1)
    model = tuner.get_best_models()[0]
    print("TUNER", model.distribute_strategy is strategy,
          model.epsilon(1e-5) == tuner.epsilon)
""")


def test_search_under_mirrored_strategy():
  """PrivateSearch, and DPTuner with `distribution_strategy=` (when the
  [tuner] extra is installed), on two logical CPUs."""
  out = subprocess.run([sys.executable, "-c", _MIRRORED],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           sys.path)))
  line = [l for l in out.stdout.splitlines() if l.startswith("RESULT")]
  assert line, out.stderr[-3000:]
  assert line[0].split()[1:3] == ["True", "True"], line
  tuner = [l for l in out.stdout.splitlines() if l.startswith("TUNER")]
  try:
    import keras_tuner  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return
  assert tuner and tuner[0].split()[1:] == ["True", "True"], (
      out.stdout[-2000:], out.stderr[-3000:])


def test_winner_score_noise_is_the_max_of_k_gaussians_closed_form():
  """Every run returns the same weights (a fresh DP wrapper of one model,
  not trained: its ledger is empty), so the winner's score is the true
  accuracy plus the largest of K Gaussian noises of std s = z / n: its CDF
  at t is E[Φ(t/s)^K] = G(Φ(t/s)), G the geometric K's generating
  function γx / (1 - (1-γ)x). 60 searches against it (Kolmogorov-Smirnov
  at the 1 % level, and the mean within 5 standard errors)."""
  from scipy import integrate, stats  # pylint: disable=g-import-not-at-top
  xv, yv = _data(2)
  keras.utils.set_random_seed(0)
  base = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  truth = float((base.predict(xv, verbose=0).argmax(-1) == yv).mean())
  z = 3.0
  s = z / len(xv)
  dist = tuning.TruncatedNegativeBinomial(1.0, mean=2.0)
  current = {}

  def same_weights(config, noise_multiplier):
    del config
    return current["model"]

  search = tuning.PrivateSearch(
      [{"epochs": 1}], same_weights,
      tuning.PrivateValidation(xv, yv, noise_multiplier=z, seed=0), dist,
      num_examples=N, batch_size=30, noise_multiplier=1.0, seed=0)
  noises = []
  for _ in range(60):
    current["model"] = dpk.make_private(base, l2_norm_clip=1.0,
                                        noise_multiplier=1.0)
    current["model"].compile(optimizer="sgd",
                             loss="sparse_categorical_crossentropy")
    result = search.run()
    assert result.score_stddev == pytest.approx(s)
    noises.append(result.score - truth)
  gamma = dist.gamma

  def cdf(t):
    x = stats.norm.cdf(np.asarray(t) / s)
    return gamma * x / (1 - (1 - gamma) * x)

  assert stats.kstest(noises, cdf).pvalue > 0.01
  mean = integrate.quad(lambda t: 1 - cdf(t), 0, 10 * s)[0] - integrate.quad(
      cdf, -10 * s, 0)[0]
  second = integrate.quad(lambda t: 2 * t * (1 - cdf(t)), 0, 10 * s)[0] + \
      integrate.quad(lambda t: -2 * t * cdf(t), -10 * s, 0)[0]
  sd = np.sqrt(second - mean**2)
  assert mean > 0  # selection biases the winner's score upwards
  assert abs(np.mean(noises) - mean) < 5 * sd / np.sqrt(len(noises))
