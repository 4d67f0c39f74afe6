"""tf_pxg.tuning.DPTuner: keras-tuner's documented `build_model(hp)` and
`HyperParameters`, unchanged, under the DP search; what keras-tuner would
write (trial directories, oracle state, checkpoints) is not written and
nothing of a losing run survives; the refusals."""

import gc
import os
import weakref

import keras
import numpy as np
import pytest

keras_tuner = pytest.importorskip("keras_tuner")

from tf_pxg import tuning  # noqa: E402
import test_tuning_search  # noqa: E402  (the attack's directories)

N = 120
_rng = np.random.default_rng(0)
X = _rng.random((N, 4)).astype("float32")
Y = (X[:, 0] > 0.5).astype("int32")


def build_model(hp):
  """keras-tuner's documented form: a compiled plain Keras model."""
  model = keras.Sequential([
      keras.Input((4,)),
      keras.layers.Dense(hp.Choice("units", [4, 8]), activation="relu"),
      keras.layers.Dense(2)])
  model.compile(
      optimizer=keras.optimizers.Adam(
          hp.Float("learning_rate", 1e-3, 1e-1, sampling="log")),
      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
  hp.Choice("l2_norm_clip", [0.5, 1.0])
  hp.Choice("epochs", [1, 2])
  return model


def _tuner(hypermodel=build_model, **kwargs):
  kwargs.setdefault("num_runs", tuning.TruncatedNegativeBinomial(1.0,
                                                                 mean=3.0))
  kwargs.setdefault("score", tuning.NoisyTrainingLoss())
  kwargs.setdefault("noise_multiplier", 1.5)
  return tuning.DPTuner(hypermodel, **kwargs)


def test_dp_tuner_is_a_keras_tuner_and_releases_the_winner(tmp_path,
                                                            monkeypatch):
  monkeypatch.chdir(tmp_path)
  tuner = _tuner(noise_multiplier=None, target_epsilon=5.0, seed=3)
  assert isinstance(tuner, keras_tuner.Tuner)
  assert {hp.name for hp in tuner.oracle.get_space().space} >= {
      "units", "learning_rate", "l2_norm_clip", "epochs"}
  result = tuner.search(X, Y, batch_size=30)
  model = tuner.get_best_models()[0]
  hp = tuner.get_best_hyperparameters()[0]
  assert model is result.model and hp.values == result.hyperparameters
  assert hp.values["units"] in (4, 8) and hp.values["epochs"] in (1, 2)
  assert 1e-3 <= hp.values["learning_rate"] <= 1e-1
  # the DP model the tuner made: the trial's clip and σ, the search's ε
  assert model.l2_norm_clip == hp.values["l2_norm_clip"]
  assert model.noise_multiplier == hp.values["noise_multiplier"]
  assert tuner.epsilon == pytest.approx(5.0, abs=1e-3)
  assert model.epsilon(1e-5) == pytest.approx(tuner.epsilon, rel=1e-12)
  assert list(tuner.oracle.trials) == ["winner"]
  assert tuner.oracle.get_best_trials()[0].score == result.score
  assert os.listdir(tmp_path) == []
  assert len(tuner.get_best_models(num_models=5)) == 1


# Weakrefs to the layers every build in this process makes (module level:
# each run is sent by reference to its own process, where it logs into its
# own copy of this list).
_LAYERS = []


def logged_build(hp):
  model = build_model(hp)
  _LAYERS.extend(weakref.ref(layer) for layer in model.layers)
  return model


def test_attack_nothing_of_a_losing_trial_survives(tmp_path, monkeypatch,
                                                   capfd):
  """After the search only the winner's layers are alive in the caller (the
  runs built theirs in processes of their own); no file in the working or
  temp directory; no output (keras-tuner prints a table per trial)."""
  dirs = test_tuning_search.isolated_dirs(tmp_path, monkeypatch)
  _LAYERS.clear()
  tuner = _tuner(logged_build, seed=11,
                 num_runs=tuning.TruncatedNegativeBinomial(1.0, mean=4.0))
  tuner.search(X, Y, batch_size=30)
  # The number of runs is drawn in secret and never leaves the search; at
  # least the winner's ran.
  gc.collect()
  winner = tuner.get_best_models()[0]
  alive = [r() for r in _LAYERS if r() is not None]
  leftovers = [layer for layer in alive
               if not any(layer is w for w in winner.layers)]
  assert leftovers == [], leftovers
  assert test_tuning_search.files_in(dirs) == []
  out = capfd.readouterr()
  assert out.out == "" and out.err == "", out
  assert [layer.name for layer in winner.layers] == ["dense", "dense_1"]


def test_dp_model_from_build_model_reads_sigma_from_hp():
  import tf_pxg.keras as dpk  # pylint: disable=g-import-not-at-top

  def dp_build(hp):
    model = dpk.DPSequential(
        [keras.Input((4,)), keras.layers.Dense(2)], l2_norm_clip=1.0,
        noise_multiplier=hp.get("noise_multiplier"),
        noisy_loss=dpk.NoisyLoss(5.0, 10 * hp.get("noise_multiplier")))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

  tuner = _tuner(dp_build, seed=1)
  tuner.search(X, Y, batch_size=30, epochs=1)
  model = tuner.get_best_models()[0]
  assert model.epsilon(1e-5) == pytest.approx(tuner.epsilon)

  def ignores_sigma(hp):
    model = dpk.DPSequential([keras.Input((4,)), keras.layers.Dense(2)],
                             l2_norm_clip=1.0, noise_multiplier=0.3,
                             noisy_loss=dpk.NoisyLoss(5.0, 3.0))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model

  with pytest.raises(tuning.SearchError, match="more than its planned"):
    _tuner(ignores_sigma, seed=1).search(X, Y, batch_size=30, epochs=1)


@pytest.mark.parametrize("kwargs", [
    dict(oracle="bayesian"), dict(max_trials=5), dict(directory="x"),
    dict(overwrite=True), dict(executions_per_trial=2)])
def test_refuses_what_would_adapt_write_or_repeat(kwargs):
  with pytest.raises(ValueError, match="DPTuner"):
    _tuner(**kwargs)


@pytest.mark.parametrize("fit_kwargs", [
    dict(callbacks=[keras.callbacks.CSVLogger("x.csv")]),
    dict(validation_data=(X, Y)), dict(validation_split=0.2)])
def test_search_refuses_per_run_logs(fit_kwargs):
  with pytest.raises(ValueError, match="refused"):
    _tuner(seed=0).search(X, Y, batch_size=30, **fit_kwargs)


def test_event_hyperparameters_must_be_finite():

  def float_epochs(hp):
    model = build_model(keras_tuner.HyperParameters())
    hp.Float("epochs", 1.0, 3.0)
    return model

  with pytest.raises(ValueError, match="finitely many"):
    _tuner(float_epochs, seed=0).search(X, Y, batch_size=30)


def test_draws_are_independent_with_replacement():
  """keras-tuner's RandomSearch never repeats values; the DP search's
  draws are i.i.d. from the prior: a two-value space repeats."""
  hp = keras_tuner.HyperParameters()
  hp.Choice("a", [1, 2])
  tuner = _tuner(hyperparameters=hp, seed=0)
  draws = [tuner.oracle.draw_values()["a"] for _ in range(400)]
  assert set(draws) == {1, 2}
  assert abs(np.mean(draws) - 1.5) < 5 * 0.5 / np.sqrt(400)
  repeats = sum(a == b for a, b in zip(draws, draws[1:]))
  assert repeats > 100  # about half of consecutive pairs repeat
