"""The DP search as a keras-tuner tuner (`pip install "tf_pxg[tuner]"`).

```python
import keras_tuner as kt
from tf_pxg import tuning

def build_model(hp):                      # keras-tuner's documented form
  model = keras.Sequential([...])
  model.compile(optimizer=keras.optimizers.Adam(
                    hp.Choice("learning_rate", [1e-3, 1e-2])),
                loss="sparse_categorical_crossentropy")
  hp.Choice("l2_norm_clip", [0.5, 1.0])   # reserved names: the DP settings
  hp.Choice("epochs", [10, 20])
  return model

tuner = tuning.DPTuner(build_model, num_runs=tuning.TruncatedNegativeBinomial(
                           eta=1, mean=5), score=tuning.NoisyTrainingLoss(),
                       target_epsilon=8.0, delta=1e-5)
tuner.search(x, y, batch_size=64)
model = tuner.get_best_models()[0]        # the winner, and only it
```

`DPTuner` is a `keras_tuner.Tuner` whose `search` is the DP search of
`tf_pxg.tuning.search` (the privacy argument is there): K ~ `num_runs`
runs, each of hyperparameters drawn independently from the space's prior
(`HyperParameter.prob_to_value` of a uniform from the OS CSPRNG: the
space's own prior, with replacement, unlike keras-tuner's RandomSearch,
which skips values already tried and so makes runs depend on each other).

Each run, in its own process (`tf_pxg.tuning.isolation`; a
`distribution_strategy` is made inside `build_model`, refused here):
`build_model(hp)`; a plain
compiled model is made private (`tf_pxg.keras.make_private`) with the
trial's clip (`hp` "l2_norm_clip", else the tuner's `l2_norm_clip`), the
run's calibrated σ, `NoisyLoss` when the score is the noised training
loss, and the tuner's `dp_options` (clipping policy, noise mechanism,
sampling), then recompiled from its compile config; a model that is
already DP is used as it is (read the run's σ with
`hp.get("noise_multiplier")`). Then `hypermodel.fit(hp, model, x, y,
epochs=..., batch_size=..., verbose=0)`; the ledger must show at most the
run's planned event. Reserved hyperparameter names: "noise_multiplier"
(set by the tuner), "l2_norm_clip", "epochs" and "batch_size" (read by
it; "epochs" and "batch_size" must take finitely many values: every one
gets its own σ before the search starts).

What keras-tuner would keep, and does not here: no project directory
(the tuner's scratch directory is removed at construction), no trial
files, checkpoints (`SaveBestEpoch` picks an epoch on un-noised validation
data: not used), TensorBoard directories or oracle state; no per-trial
display; `oracle.trials` holds the winner only, as trial "winner" (a
trial number would reveal how many runs came before it). `search`
refuses `callbacks`, `validation_data` and `validation_split` (they would
log or write losing runs' values), `oracle=` and `max_trials` (K is
random) and `executions_per_trial` other than 1.
"""

from __future__ import annotations

import itertools
import math
import shutil
import tempfile
from typing import Any, Dict, Optional

import keras_tuner
from keras_tuner.engine import hyperparameters as kt_hp
from keras_tuner.engine import trial as kt_trial

from tf_pxg.tuning import distributions
from tf_pxg.tuning import scores as scores_lib
from tf_pxg.tuning import search as search_lib

__all__ = ["DPTuner"]

RESERVED = ("noise_multiplier", "l2_norm_clip", "epochs", "batch_size")
_EVENT_HPS = ("epochs", "batch_size")
_REFUSED_SEARCH_ARGS = {
    "callbacks": "callbacks would see (and may write) every run's logs",
    "validation_data": "Keras would log un-noised validation metrics of "
                       "every run; score on validation data with "
                       "score=tuning.PrivateValidation(...) or "
                       "tuning.PublicValidation(...)",
    "validation_split": "DP models refuse it (it holds out private rows)",
}


class _IIDOracle(keras_tuner.Oracle):
  """Holds the space; draws each trial's values independently from its
  prior with the search's random source (never deduplicated)."""

  def __init__(self, rng, **kwargs):
    super().__init__(**kwargs)
    self._draws = rng

  def populate_space(self, trial_id):
    del trial_id
    return {"status": kt_trial.TrialStatus.RUNNING,
            "values": self.draw_values()}

  def draw_values(self) -> Dict[str, Any]:
    hps = keras_tuner.HyperParameters()
    for hp in self.hyperparameters.space:
      hps.merge([hp])
      if hps.is_active(hp):
        hps.values[hp.name] = hp.prob_to_value(self._draws.random())
    return hps.values

  def save(self):  # nothing is written
    pass

  def _save_trial(self, trial):
    pass


class DPTuner(keras_tuner.Tuner):
  """A keras-tuner tuner that runs the DP search (module docstring).

  Args:
    hypermodel: `build_model(hp)` or a `keras_tuner.HyperModel`.
    num_runs: K's distribution (`tuning.TruncatedNegativeBinomial`,
      `tuning.Poisson`).
    score: `tuning.NoisyTrainingLoss()`, `tuning.PrivateValidation(...)` or
      `tuning.PublicValidation(...)`.
    target_epsilon: the whole search's ε (or the reference
      `noise_multiplier` instead).
    delta: δ.
    l2_norm_clip: the clip when the space has no "l2_norm_clip".
    dp_options: extra `make_private` arguments (`clipping`,
      `noise_mechanism`, `sampling`, `secure_mode`).
    run_event: `(config, σ) -> DpEvent` of a run (default: Poisson-sampled
      DP-SGD, or BandMF for a `noise_mechanism`); config holds "epochs"
      and "batch_size".
    calibrate: per-candidate σ (default) or the worst case.
    seed: seeds K and the draws (tests); default OS entropy.
    hyperparameters, tune_new_entries, allow_new_entries, max_model_size,
    distribution_strategy: as keras-tuner's.

  Raises:
    ValueError: `oracle`, `max_trials`, `directory`, `project_name`,
      `overwrite`, `executions_per_trial` != 1 or other keras-tuner
      arguments that would write or adapt; invalid DP settings.
  """

  def __init__(self, hypermodel, *, num_runs: distributions.NumRuns,
               score: scores_lib.Score,
               target_epsilon: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               delta: float = 1e-5, l2_norm_clip: float = 1.0,
               dp_options: Optional[Dict[str, Any]] = None,
               run_event=None, calibrate: bool = True,
               seed: Optional[int] = None, hyperparameters=None,
               tune_new_entries: bool = True, allow_new_entries: bool = True,
               max_model_size=None, distribution_strategy=None, **kwargs):
    for name in ("oracle", "max_trials", "directory", "project_name",
                 "overwrite", "tuner_id", "logger"):
      if name in kwargs:
        raise ValueError(
            f"DPTuner: {name}= is not supported: the number of runs is "
            "random (num_runs) and secret, proposals are independent draws "
            "from the space (an adaptive oracle is outside Papernot and "
            "Steinke's theorem), and nothing is written to disk.")
    if kwargs.pop("executions_per_trial", 1) != 1:
      raise ValueError("DPTuner: executions_per_trial must be 1 (each run "
                       "is one DP training; averaging runs is another "
                       "mechanism).")
    if kwargs:
      raise ValueError(f"DPTuner: unknown arguments {sorted(kwargs)}.")
    if (target_epsilon is None) == (noise_multiplier is None):
      raise ValueError("DPTuner: give exactly one of target_epsilon and "
                       "noise_multiplier.")
    if not isinstance(score, scores_lib.Score):
      raise TypeError(f"DPTuner: score must be a tf_pxg.tuning Score; got "
                      f"{score!r}.")
    if not isinstance(num_runs, distributions.NumRuns):
      raise TypeError(f"DPTuner: num_runs must be a tf_pxg.tuning "
                      f"distribution; got {num_runs!r}.")
    self._rng = distributions.random_source(seed)
    if hyperparameters is None:
      hyperparameters = keras_tuner.HyperParameters()
    hyperparameters.Fixed("noise_multiplier", 1.0)
    oracle = _IIDOracle(
        self._rng, objective=keras_tuner.Objective("score", score.direction),
        hyperparameters=hyperparameters, tune_new_entries=tune_new_entries,
        allow_new_entries=allow_new_entries)
    scratch = tempfile.mkdtemp(prefix="tf_pxg_tuner_")
    try:
      super().__init__(oracle=oracle, hypermodel=hypermodel,
                       max_model_size=max_model_size,
                       distribution_strategy=distribution_strategy,
                       directory=scratch, project_name="search",
                       overwrite=True)
    finally:
      shutil.rmtree(scratch, ignore_errors=True)
    self.num_runs, self.score, self.delta = num_runs, score, float(delta)
    self.target_epsilon = target_epsilon
    self.noise_multiplier = noise_multiplier
    self.l2_norm_clip = float(l2_norm_clip)
    self.dp_options = dict(dp_options or {})
    self.calibrate = calibrate
    self._run_event = run_event
    self.result: Optional[search_lib.SearchResult] = None
    self.plans: Optional[search_lib.Plans] = None

  # Planning ------------------------------------------------------------------

  def _event_configs(self, epochs, batch_size):
    """Every ("epochs", "batch_size") pair the space can draw."""
    supports = []
    for name, default in (("epochs", epochs), ("batch_size", batch_size)):
      hp = next((h for h in self.oracle.hyperparameters.space
                 if h.name == name), None)
      if hp is None:
        if default is None:
          raise ValueError(f"DPTuner.search: give {name}= (or declare the "
                           f"hyperparameter {name!r} in the space).")
        supports.append([default])
        continue
      # A Float's `values` is a sample of its range, not its support.
      values = (None if isinstance(hp, kt_hp.Float) else
                list(getattr(hp, "values", None) or []))
      if not values:
        raise ValueError(
            f"DPTuner: the hyperparameter {name!r} ({hp!r}) must take "
            "finitely many values (hp.Choice, hp.Int, hp.Fixed): every one "
            "gets its noise multiplier before the search starts.")
      supports.append(values)
    return [{"epochs": e, "batch_size": b}
            for e, b in itertools.product(*supports)]

  def plan(self, num_examples: int, epochs=None,
           batch_size=None) -> search_lib.Plans:
    """Every (epochs, batch size) run's σ, and the per-run event, for
    `num_examples` training rows (data-independent: before the search)."""
    mechanism = self.dp_options.get("noise_mechanism")
    run_event = self._run_event or search_lib.dpsgd_run_event(
        num_examples, mechanism=mechanism)
    return search_lib.plan_runs(
        self._event_configs(epochs, batch_size), run_event, self.score,
        self.num_runs, target_epsilon=self.target_epsilon,
        noise_multiplier=self.noise_multiplier, delta=self.delta,
        calibrate=self.calibrate)

  # The search ---------------------------------------------------------------

  def search(self, x, y, *, epochs=None, batch_size=None, **fit_kwargs):
    """Runs the DP search on numpy `x`, `y` and keeps only the winner
    (`get_best_models`, `get_best_hyperparameters`, `result`).

    Raises:
      ValueError: a refused `fit` argument (module docstring).
      tf_pxg.tuning.SearchError: a run failed or released more than
        planned (nothing is kept).
    """
    for name, why in _REFUSED_SEARCH_ARGS.items():
      if fit_kwargs.get(name) not in (None, 0, 0.0):
        raise ValueError(f"DPTuner.search: {name}= is refused: {why}.")
      fit_kwargs.pop(name, None)
    fit_kwargs.pop("verbose", None)
    self.plans = self.plan(len(x), epochs, batch_size)
    event = search_lib.accounting.search_event(self.plans.per_run_event,
                                               self.num_runs)
    epsilon = search_lib.accounting.search_epsilon(
        self.plans.per_run_event, self.num_runs, self.delta)
    def draw():
      values = self.oracle.draw_values()
      values.setdefault("epochs", epochs)
      values.setdefault("batch_size", batch_size)
      base = self.plans.by_key[search_lib.config_key(
          {"epochs": values["epochs"], "batch_size": values["batch_size"]})]
      values["noise_multiplier"] = base.noise_multiplier
      return search_lib.RunPlan(values, base.noise_multiplier, base.event)

    if self.distribution_strategy is not None:
      raise ValueError(
          "DPTuner: distribution_strategy= cannot reach the runs: each run "
          "is its own process (tf_pxg.tuning.isolation) and a strategy "
          "object does not cross processes. Create the strategy (and its "
          "logical devices) inside build_model and build the model in its "
          "scope; call search inside the caller's strategy scope to get a "
          "distributed winner.")
    # What each run's process gets (not this tuner: its generator of K and
    # the draws stay here).
    train = _TunerRun(self.hypermodel, self.oracle.get_space(), self.score,
                      self.l2_norm_clip, self.dp_options, x, y,
                      dict(fit_kwargs))

    self.result = None
    self.oracle.trials = {}
    result = search_lib.run_search(draw, train, self.score, self.num_runs,
                                   self._rng, event, epsilon, self.delta,
                                   len(self.plans.by_key))
    self.result = result
    if result.model is not None:
      hp = self.oracle.get_space()
      hp.values = dict(result.hyperparameters)
      trial = kt_trial.Trial(hp, trial_id="winner",
                             status=kt_trial.TrialStatus.COMPLETED)
      trial.score = result.score
      self.oracle.trials = {"winner": trial}
    return result

  # keras-tuner's API, on the winner only -------------------------------------

  def get_best_models(self, num_models: int = 1):
    """[the winner's model] (a DP search releases one model)."""
    del num_models
    return [] if self.result is None or self.result.model is None else [
        self.result.model]

  def get_best_hyperparameters(self, num_trials: int = 1):
    del num_trials
    return [t.hyperparameters for t in self.oracle.trials.values()]

  def results_summary(self, num_trials: int = 1):
    del num_trials
    print("DP search (only the winner is released)")
    print("no search yet" if self.result is None else self.result.summary())

  @property
  def epsilon(self) -> float:
    """The last search's ε (inf before any)."""
    return math.inf if self.result is None else self.result.epsilon

  def save(self):  # nothing is written
    pass

  def save_model(self, trial_id, model, step=0):
    pass

  def on_trial_end(self, trial):
    pass

  def load_model(self, trial):
    raise ValueError("DPTuner keeps no checkpoints: get_best_models() "
                     "returns the winner held in memory.")


class _TunerRun:
  """One run of a `DPTuner` search, sent to the run's own process
  (`tf_pxg.tuning.isolation`): what it needs and nothing of the tuner."""

  def __init__(self, hypermodel, space, score, l2_norm_clip, dp_options, x,
               y, fit_kwargs):
    self.hypermodel, self.space, self.score = hypermodel, space, score
    self.l2_norm_clip, self.dp_options = l2_norm_clip, dp_options
    self.x, self.y, self.fit_kwargs = x, y, fit_kwargs

  def __call__(self, plan):
    hp = self.space
    hp.values = dict(plan.config)
    model = self.hypermodel.build(hp)
    if not hasattr(model, "privacy_ledger"):
      model = self._make_private(model, hp, plan.noise_multiplier)
    self.hypermodel.fit(hp, model, self.x, self.y,
                        epochs=hp.values["epochs"],
                        batch_size=hp.values["batch_size"], verbose=0,
                        **self.fit_kwargs)
    search_lib.check_released(model, plan)
    return model

  def _make_private(self, model, hp, sigma):
    from tf_pxg import keras as dpk  # noqa: PLC0415
    if getattr(model, "optimizer", None) is None or model.loss is None:
      raise ValueError("DPTuner: build_model(hp) must return a compiled "
                       "model (optimizer and loss).")
    config = model.get_compile_config()
    noisy_loss = None
    if isinstance(self.score, scores_lib.NoisyTrainingLoss):
      noisy_loss = dpk.NoisyLoss(self.score.bound,
                                 self.score.noise_factor * sigma)
    clip = hp.values.get("l2_norm_clip", self.l2_norm_clip)
    private = dpk.make_private(model, l2_norm_clip=float(clip),
                               noise_multiplier=sigma, noisy_loss=noisy_loss,
                               **self.dp_options)
    private.compile_from_config(config)
    return private

