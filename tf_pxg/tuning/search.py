"""A DP hyperparameter search that releases only its winner.

`PrivateSearch(candidates, train_fn, ...)` is Papernot and Steinke's
random search (ICLR 2022, arXiv:2110.03620) over a list of candidate
configurations fixed before the data is seen:

1. Draw K from `num_runs` (`tf_pxg.tuning.distributions`) with the OS
   CSPRNG (a `seed` only for tests).
2. K times, independently: draw a candidate c from the prior (uniform over
   the list, or `weights`), train it with its noise multiplier σ_c
   (`train_fn(config, noise_multiplier)` returns the trained DP model),
   and release its score (`tf_pxg.tuning.scores`). Each run checks that
   the model's privacy ledger released at most the run's planned event
   (its RDP at most the per-run reference at every order), else the
   search stops and releases nothing.
3. Keep the best run so far; a losing run's model is dropped at once.
4. Release the best run's model, configuration, score and the search's ε
   (`tf_pxg.tuning.accounting`); its privacy ledger is rewritten to the
   search's `RepeatAndSelectDpEvent` (`PrivacyLedger.cover`), so
   `model.epsilon(δ)` is the search's ε like any other release.

**The guarantee** (RDP, then (ε, δ)): the output above — winner's
weights, configuration, score, and nothing that depends on K or on a
losing run — satisfies the Rényi DP bound of Theorem 2 (truncated negative
binomial K) or 6 (Poisson K) for the per-run RDP curve; dp-accounting's
`RepeatAndSelectDpEvent` computes it. The conditions the code keeps:

* *Independent, identical runs.* Every run draws its candidate afresh
  from one data-independent prior (with replacement: a grid is the
  uniform prior over its points; keras-tuner's RandomSearch, which skips
  values already tried, and adaptive proposals — Bayesian optimisation,
  Hyperband — are refused: the theorem is for repetitions of one
  mechanism).
* *One per-run event.* Candidates that train for different steps or rates
  get their own σ_c, calibrated so that their RDP is inside the per-run
  reference event at every order (`accounting.calibrate`), or all keep the
  reference σ when `calibrate=False` (the worst case taken).
* *A private score.* The score is an output of the run, inside its event
  (`scores`); a user-declared public validation set is said so in the
  result.
* *Nothing else leaves: isolation by construction.* Each run executes in
  a process of its own (`tf_pxg.tuning.isolation`: a child of a fork
  server that imported TensorFlow once and ran nothing), seeded from the
  OS CSPRNG whatever global seeds the caller set, silent for its whole
  life (file descriptors 1 and 2 and Python's streams to /dev/null,
  logging off), in a private directory removed after it. Only its score,
  the score's noise std and its model's `.keras` bytes come back; the
  caller keeps the best and rebuilds only the winner's model
  (`keras.models.load_model`; its privacy ledger comes with it). Nothing a
  losing run did reaches the caller: no output at any time (TF's
  "unrestored values" warnings at garbage collection included), no RNG
  state, no TF or Keras global counters (op and function ids, layer name
  uids), no files, no objects. K is never returned, printed or stored. A
  run that raises stops the search; the error raised is a new
  `SearchError` with the candidate and the error's type and message (a
  string: no traceback or object crosses).

Not covered: timing (the search's wall time grows with K), files a
`train_fn` writes to absolute paths, the message of a run's own
exception. `train_fn` is sent to each run's process (cloudpickle when
installed, else pickle: a module-level function).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import dp_accounting

from tf_pxg import accounting as dp_accounting_lib
from tf_pxg.tuning import accounting
from tf_pxg.tuning import distributions
from tf_pxg.tuning import isolation
from tf_pxg.tuning import scores as scores_lib

__all__ = ["PrivateSearch", "RunPlan", "SearchError", "SearchResult",
           "dpsgd_run_event"]

Config = Dict[str, Any]
RunEventFn = Callable[[Mapping[str, Any], float], dp_accounting.DpEvent]


class SearchError(RuntimeError):
  """A run of a DP search failed or released more than planned; nothing
  of the search is released."""


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """One candidate's run: its configuration, its σ and its training event
  (all data-independent, fixed before the search)."""
  config: Config
  noise_multiplier: float
  event: dp_accounting.DpEvent


@dataclasses.dataclass
class SearchResult:
  """What a DP search releases (and nothing else).

  Attributes:
    model: the winning run's trained model (None if K = 0, Poisson only);
      its privacy ledger holds the search's event.
    hyperparameters: the winner's configuration.
    noise_multiplier: the winner's σ.
    score: its released score; `score_stddev` its noise std where that is
      a closed form (None otherwise), `score_source` where it comes from.
      (The winner's score is the best of K noisy scores: biased upwards.)
    epsilon, delta: the search's (ε, δ), `event` its dp-accounting event.
    num_runs: K's distribution (not K).
  """
  model: Any
  hyperparameters: Optional[Config]
  noise_multiplier: Optional[float]
  score: Optional[float]
  score_stddev: Optional[float]
  score_source: str
  epsilon: float
  delta: float
  event: dp_accounting.DpEvent
  num_runs: distributions.NumRuns

  def summary(self) -> str:
    if self.model is None:
      return (f"no run (K = 0); ε = {self.epsilon:.3f} at δ = "
              f"{self.delta:g}")
    return (f"winner {self.hyperparameters} (σ = "
            f"{self.noise_multiplier:.4g}): score {self.score:.4g} "
            f"[{self.score_source}]; search ε = {self.epsilon:.3f} at "
            f"δ = {self.delta:g}, runs ~ {self.num_runs!r}")


def dpsgd_run_event(num_examples: int, batch_size: Optional[int] = None,
                    epochs: Optional[float] = None,
                    mechanism=None) -> RunEventFn:
  """`(config, σ) -> event` of a `fit` with Poisson sampling: the
  config's "batch_size" and "epochs" (else these defaults), N examples;
  `mechanism` (a model's `noise_mechanism=` setting, e.g.
  `tf_pxg.mf.BandedToeplitz(b)`, or a `tf_pxg.dp.mechanisms.NoiseMechanism`)
  through `tf_pxg.accounting.mechanism_dp_event`, DP-SGD by default.

  Raises (when called):
    ValueError: no batch size or epochs for a config.
  """

  def event(config: Mapping[str, Any], sigma: float):
    batch = config.get("batch_size", batch_size)
    epochs_c = config.get("epochs", epochs)
    if batch is None or epochs_c is None:
      raise ValueError(
          f"candidate {dict(config)}: its run's DP event needs a batch_size "
          "and epochs (in the candidate, or the search's defaults).")
    steps = dp_accounting_lib.steps_for(num_examples, int(batch), epochs_c)
    if mechanism is None:
      return dp_accounting_lib.dp_event(num_examples, int(batch), sigma,
                                        steps=steps)
    from tf_pxg.dp import mechanisms  # noqa: PLC0415
    return dp_accounting_lib.mechanism_dp_event(
        mechanisms.from_setting(mechanism), num_examples, int(batch), sigma,
        steps)

  return event


def _compose(train_event, score_event):
  if score_event is None:
    return train_event
  return dp_accounting.ComposedDpEvent([train_event, score_event])


def config_key(config: Mapping[str, Any]) -> str:
  return json.dumps(dict(config), sort_keys=True, default=repr)


class PrivateSearch:
  """A DP random search over fixed candidates (module docstring).

  Args:
    candidates: the configurations (dicts), fixed before seeing the data.
    train_fn: `(config, noise_multiplier) -> model`: trains one run with
      DP and returns the model (a tf_pxg DP model: its privacy ledger is
      checked against the run's plan).
    score: a `tf_pxg.tuning.scores.Score`.
    num_runs: K's distribution (`TruncatedNegativeBinomial`, `Poisson`).
    run_event: `(config, σ) -> DpEvent` of one run's training; default
      `dpsgd_run_event(num_examples, batch_size, epochs)`.
    num_examples, batch_size, epochs: for the default `run_event`.
    target_epsilon: the whole search's ε; the reference σ is solved for
      it. Or give `noise_multiplier` (the reference σ) instead.
    delta: δ.
    weights: the prior's weights over `candidates` (default uniform).
    calibrate: True (default): each candidate gets the smallest σ_c whose
      run is inside the reference event (shorter runs get less noise);
      False: every candidate trains at the reference σ (the worst case).
    seed: seeds K and the candidate draws (tests); default OS entropy.

  Raises:
    ValueError: no candidates, negative or all-zero weights, both or
      neither of `target_epsilon` and `noise_multiplier`, a candidate
      outside the reference event with `calibrate=False`, an unreachable
      target.
  """

  def __init__(self, candidates: Sequence[Mapping[str, Any]],
               train_fn: Callable[[Config, float], Any],
               score: scores_lib.Score,
               num_runs: distributions.NumRuns, *,
               run_event: Optional[RunEventFn] = None,
               num_examples: Optional[int] = None,
               batch_size: Optional[int] = None,
               epochs: Optional[float] = None,
               target_epsilon: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               delta: float = 1e-5,
               weights: Optional[Sequence[float]] = None,
               calibrate: bool = True, seed: Optional[int] = None):
    candidates = [dict(c) for c in candidates]
    if not candidates:
      raise ValueError("PrivateSearch: no candidates.")
    if weights is None:
      weights = [1.0] * len(candidates)
    weights = [float(w) for w in weights]
    if (len(weights) != len(candidates) or min(weights) < 0 or
        sum(weights) <= 0):
      raise ValueError(f"PrivateSearch: weights must be {len(candidates)} "
                       f"numbers >= 0, not all 0; got {weights!r}.")
    if not isinstance(score, scores_lib.Score):
      raise TypeError(f"PrivateSearch: score must be a tf_pxg.tuning "
                      f"Score (NoisyTrainingLoss, PrivateValidation, "
                      f"PublicValidation); got {score!r}.")
    if not isinstance(num_runs, distributions.NumRuns):
      raise TypeError(f"PrivateSearch: num_runs must be a tf_pxg.tuning "
                      f"TruncatedNegativeBinomial or Poisson; got "
                      f"{num_runs!r}.")
    if run_event is None:
      if num_examples is None:
        raise ValueError("PrivateSearch: give num_examples (for the default "
                         "DP-SGD run event) or run_event.")
      run_event = dpsgd_run_event(num_examples, batch_size, epochs)
    self.candidates, self.weights = candidates, weights
    self.train_fn, self.score, self.num_runs = train_fn, score, num_runs
    self.delta = float(delta)
    self._run_event = run_event
    self._rng = distributions.random_source(seed)
    self.plans = plan_runs(candidates, run_event, score, num_runs,
                           target_epsilon=target_epsilon,
                           noise_multiplier=noise_multiplier, delta=delta,
                           calibrate=calibrate)
    self.per_run_event = self.plans.per_run_event
    self.event = accounting.search_event(self.per_run_event, num_runs)
    self.epsilon = accounting.search_epsilon(self.per_run_event, num_runs,
                                             self.delta)

  def _draw(self) -> RunPlan:
    config = self._rng.choices(self.candidates, weights=self.weights)[0]
    return self.plans.by_key[config_key(config)]

  def run(self) -> SearchResult:
    """Runs the search (module docstring) and returns only the winner.

    Raises:
      SearchError: a run raised or released more than its plan; nothing of
        the search is returned.
    """
    # What each run's process gets: the user's train_fn, not this search
    # (its generator of K and the draws stays here).
    return run_search(self._draw,
                      functools.partial(_train_and_check, self.train_fn),
                      self.score,
                      self.num_runs, self._rng, self.event, self.epsilon,
                      self.delta, len(self.candidates))



def _train_and_check(train_fn, plan: RunPlan):
  """A run's training (in its own process): `train_fn` on the plan, its
  ledger checked against the plan (`check_released`)."""
  model = train_fn(dict(plan.config), plan.noise_multiplier)
  check_released(model, plan)
  return model


@dataclasses.dataclass
class Plans:
  """Every candidate's `RunPlan` and the per-run reference event."""
  by_key: Dict[str, RunPlan]
  reference_noise_multiplier: float
  per_run_event: dp_accounting.DpEvent


def plan_runs(candidates: Sequence[Config], run_event: RunEventFn,
              score: scores_lib.Score, num_runs: distributions.NumRuns, *,
              target_epsilon: Optional[float],
              noise_multiplier: Optional[float], delta: float,
              calibrate: bool) -> Plans:
  """The reference σ (given, or solved for `target_epsilon`) and each
  candidate's σ_c (module docstring of `tf_pxg.tuning.accounting`).

  The reference candidate is the one whose run has the largest ε at
  σ = 1 (the longest, most sampled run): the others then need at most
  its σ.
  """
  if (target_epsilon is None) == (noise_multiplier is None):
    raise ValueError("give exactly one of target_epsilon (the whole "
                     "search's ε) and noise_multiplier (the reference σ); "
                     f"got {target_epsilon!r} and {noise_multiplier!r}.")
  unique = {config_key(c): c for c in candidates}
  # Candidates that differ only in settings the event does not see
  # (learning rate, clip) share one calibration.
  shapes = {}
  for key, config in unique.items():
    shapes.setdefault(repr(run_event(config, 1.0)), []).append(key)
  reference = max((unique[keys[0]] for keys in shapes.values()),
                  key=lambda c: dp_accounting_lib.event_epsilon(
                      run_event(c, 1.0), delta))

  def per_run(sigma):
    return _compose(run_event(reference, sigma), score.event)

  if noise_multiplier is None:
    noise_multiplier = accounting.noise_multiplier_for_search(
        target_epsilon, delta, num_runs, per_run)
  sigma = float(noise_multiplier)
  ref_event = run_event(reference, sigma)
  by_key = {}
  for keys in shapes.values():
    config = unique[keys[0]]
    if run_event(config, sigma) == ref_event:
      sigma_c = sigma
    elif calibrate:
      sigma_c = accounting.calibrate(lambda s, c=config: run_event(c, s),
                                     ref_event, 4 * sigma)
    else:
      sigma_c = sigma
      if not accounting.dominates(ref_event, run_event(config, sigma)):
        raise ValueError(
            f"candidate {config}: at the reference σ = {sigma:.4g} its run "
            f"releases more than the reference candidate {reference}'s; "
            "use calibrate=True or make it the reference.")
    for key in keys:
      by_key[key] = RunPlan(dict(unique[key]), sigma_c,
                            run_event(unique[key], sigma_c))
  return Plans(by_key, sigma, per_run(sigma))


def _dp_optimizer(model):
  """The model's DPOptimizer (inside a LossScaleOptimizer), else None."""
  from tf_pxg.keras.optimizers import dp_optimizer_of  # noqa: PLC0415
  return dp_optimizer_of(getattr(model, "optimizer", None))


def check_released(model, plan: RunPlan) -> None:
  """Raises SearchError unless `model`'s privacy ledger released at most
  `plan.event` (RDP at every order) and its plan logged no un-noised
  training metrics (`unprotected_training_metrics`: outside every ε, and
  the winner's `history` holds them)."""
  ledger = getattr(model, "privacy_ledger", None)
  optimizer = _dp_optimizer(model)
  if ledger is None or optimizer is None:
    raise SearchError(
        "a run's train_fn returned a model without a privacy ledger: it must "
        "return the tf_pxg DP model it trained (DPSequential, DPModel, "
        "make_private(...)), compiled and fitted.")
  if optimizer.plan.unprotected_training_metrics:
    raise SearchError(
        f"a run of candidate {plan.config} logged un-noised training "
        "metrics (unprotected_training_metrics=True), which no ε covers; the "
        "search would release them with the winner's model. Train without "
        "unprotected_training_metrics (score runs with NoisyTrainingLoss or "
        "PrivateValidation).")
  released = ledger.event()
  if released is None or not accounting.dominates(plan.event, released):
    raise SearchError(
        f"a run of candidate {plan.config} released {released!r}, more than "
        f"its planned event {plan.event!r} (σ = {plan.noise_multiplier:.6g}); "
        "train with the noise multiplier, batch size and epochs the search "
        "gives.")


def _one_run(train: Callable[[RunPlan], Any], score: scores_lib.Score,
             plan: RunPlan):
  """A run, in its own process (`tf_pxg.tuning.isolation`): trains
  `plan`, checks its ledger (`train` does), releases its score, and
  returns `(score, its noise std, the model's .keras bytes)`: all that
  crosses back."""
  model = train(plan)
  value = float(score.release(model))
  stddev = score.stddev(model)
  path = os.path.join(os.getcwd(), "run.keras")  # the run's private dir
  model.save(path)
  with open(path, "rb") as f:
    return value, stddev, f.read()


def _load_winner(data: bytes):
  """The winner's model, rebuilt in the caller's process from its .keras
  bytes (its privacy ledger comes with them)."""
  import keras  # noqa: PLC0415
  workdir = tempfile.mkdtemp(prefix="tf_pxg_winner_")
  try:
    path = os.path.join(workdir, "winner.keras")
    with open(path, "wb") as f:
      f.write(data)
    return keras.models.load_model(path)
  except Exception as e:  # pylint: disable=broad-except
    raise SearchError(
        f"the winner's model could not be rebuilt in the caller's process "
        f"({type(e).__name__}: {e}); register its custom layers and "
        "objects (keras.saving.register_keras_serializable) in the module "
        "that defines them, so keras.models.load_model can rebuild it. "
        "Nothing of the search is released.") from None
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def run_search(draw: Callable[[], RunPlan], train: Callable[[RunPlan], Any],
               score: scores_lib.Score, num_runs: distributions.NumRuns,
               rng, event, epsilon: float, delta: float,
               num_candidates: int) -> SearchResult:
  """The search loop shared by `PrivateSearch` and the keras-tuner tuner
  (module docstring): K runs, each in its own process
  (`tf_pxg.tuning.isolation.run_isolated`), the best kept, nothing else.
  `train(plan)` runs in the run's process and must be picklable there
  (cloudpickle: closures too)."""
  best_plan, best, failure = None, None, None
  for _ in range(num_runs.sample(rng)):
    plan = draw()
    try:
      value, stddev, data = isolation.run_isolated(
          functools.partial(_one_run, train, score.for_run(), plan))
    except isolation.IsolationError as e:
      message = str(e)
      failure = (message[len("SearchError: "):]
                 if message.startswith("SearchError: ") else
                 f"a run of candidate {plan.config} failed with {message}")
      break
    if best_plan is None or score.better(value, best[0]):
      best_plan, best = plan, (value, stddev, data)
  if failure is not None:
    raise SearchError(failure + " The search stopped and releases nothing.")
  if best_plan is None:
    return SearchResult(None, None, None, None, None, score.source, epsilon,
                        delta, event, num_runs)
  model = _load_winner(best[2])
  _record(model, event, score, num_runs, num_candidates)
  return SearchResult(
      model=model, hyperparameters=dict(best_plan.config),
      noise_multiplier=best_plan.noise_multiplier, score=best[0],
      score_stddev=best[1], score_source=score.source,
      epsilon=epsilon, delta=delta, event=event, num_runs=num_runs)


def _record(model, event, score, num_runs, num_candidates: int) -> None:
  """The winner's ledger now holds the search's event (`cover`)."""
  from tf_pxg.keras import _ledger  # noqa: PLC0415
  settings = {"release": "DP hyperparameter search (winner only)",
              "num_runs": repr(num_runs), "mean_runs": num_runs.mean,
              "candidates": num_candidates, "score": score.source}
  _ledger.cover(model, event, settings)
