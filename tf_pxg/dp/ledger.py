"""The privacy ledger: every noised release of a model's training history.

ε is a property of what was released, not of the last optimizer's step
counter. The ledger records each **run**, a stretch of noised steps with
one DP event per step count (one sampler, mechanism and σ): the first
`fit`, a second `fit` with another batch size or sampling, the steps after
a recompile with a new DP optimizer. The reported ε (`PrivacyCallback`,
`model.privacy_ledger.epsilon(...)`, the step limit of a budget) is that of
the **composition of all runs' events** (`dp_accounting.ComposedDpEvent`),
computed by dp-accounting: heterogeneous where the runs differ, exact
where they do not (a run's own event is its sampler's, e.g.
`SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)`).

Contract:

* A run is identified by its `key`: the events its sampler gives for 1
  and 2 steps and its settings (two runs with the same key release the
  same mechanism, so their steps add up to one run). `begin` continues the open run when the
  key is equal; otherwise it **closes** the open run at its current step
  count (its event frozen into the ledger) and opens a new one at the
  current count of the step counter that will count it.
* The open run's steps are `steps_now - start`, where `steps_now` is the
  DP optimizer's `iterations` (every applied logical step; a non-finite
  example never skips one). Its event comes from its sampler while the
  process has it, else from the **snapshot** taken at the last `fit` end
  or save (`snapshot`), which is exact when no step was taken after it.
* A run whose noise is correlated across steps (a stateful mechanism:
  BandMF, BLT) cannot be followed on the **same** noise state by a run with
  another key: its ε assumes one participation pattern for the whole
  stream. `begin` raises (`ComposeError`); a recompile with a new DP
  optimizer starts a fresh noise state, after which the runs compose.
* The ledger is state, not configuration: a JSON document (`to_json`) held
  by the DP optimizer's `DPState` in a byte variable, so `.keras` saving,
  `save_weights` (`BackupAndRestore`, `ModelCheckpoint`) and
  `tf.train.Checkpoint` carry it; a recompile hands it to the new
  optimizer. The settings of each run are recorded for inspection
  (`summary()`), never read back as configuration: the plan
  (`tf_pxg.dp.plan.DPPlan`) stays the one owner of the settings.

The privacy argument: each run is a mechanism whose ε dp-accounting
bounds from its event; runs execute one after another on the same data,
and adaptive sequential composition of the events
(`ComposedDpEvent`) bounds the whole history (Dwork & Roth 2014, Thm 3.16;
Mironov 2017 for RDP; the PLD accountant composes the same way).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Dict, List, Optional

import attr
import dp_accounting

from tf_pxg import accounting

__all__ = ["ComposeError", "PrivacyLedger", "Run", "event_from_json",
           "event_to_json"]


class ComposeError(ValueError):
  """A run cannot be composed with the open run (correlated noise)."""


# DP events <-> JSON --------------------------------------------------------


def event_to_json(event: Optional[dp_accounting.DpEvent]) -> Any:
  """A JSON-able form of a dp-accounting event (its class name and fields,
  nested events included); None stays None."""
  if event is None:
    return None
  if isinstance(event, (list, tuple)):
    return [event_to_json(e) for e in event]
  if not attr.has(type(event)):
    return event
  return {"event": type(event).__name__,
          "fields": {k: event_to_json(v)
                     for k, v in attr.asdict(event, recurse=False).items()}}


def event_from_json(data: Any) -> Optional[dp_accounting.DpEvent]:
  """The event `event_to_json` wrote.

  Raises:
    ValueError: a class dp-accounting does not have.
  """
  if data is None or not isinstance(data, (dict, list)):
    return data
  if isinstance(data, list):
    return [event_from_json(d) for d in data]
  # dp-accounting exports most event classes at its top level; some
  # (RepeatAndSelectDpEvent, a DP search's) only in its dp_event module.
  cls = (getattr(dp_accounting, data["event"], None) or
         getattr(dp_accounting.dp_event, data["event"], None))
  if cls is None or not attr.has(cls):
    raise ValueError(f"privacy ledger: unknown dp-accounting event "
                     f"{data['event']!r}")
  return cls(**{k: event_from_json(v) for k, v in data["fields"].items()})


# Runs ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
  """A run the caller is about to train (`PrivacyLedger.begin`).

  Attributes:
    event_fn: steps -> the run's `DpEvent` (None: no ε for that many).
    settings: what it released with, for `summary()` (JSON-able).
    stateful: its noise is correlated across steps (module docstring).
  """
  event_fn: Callable[[int], Optional[dp_accounting.DpEvent]]
  settings: Dict[str, Any]
  stateful: bool = False

  @property
  def key(self) -> str:
    return json.dumps([event_to_json(self.event_fn(1)),
                       event_to_json(self.event_fn(2)), self.settings],
                      sort_keys=True, default=repr)


class PrivacyLedger:
  """The runs released so far (module docstring).

  Args:
    state: a `to_json()` document to continue (default: empty).
  """

  def __init__(self, state: Optional[str] = None):
    doc = json.loads(state) if state else {}
    self.closed: List[dict] = list(doc.get("closed", []))
    self.open: Optional[dict] = doc.get("open")
    self._run: Optional[Run] = None  # the open run's, in this process

  # Recording ---------------------------------------------------------------

  def begin(self, run: Run, steps_now: int) -> None:
    """Continues the open run if `run` has its key, else closes it at
    `steps_now` and opens `run` there.

    Args:
      run: the run about to train.
      steps_now: the step counter that counts the open run and will count
        `run` (the DP optimizer's `iterations`; a recompile closes the open
        run at the old optimizer's count first, `close`).

    Raises:
      ComposeError: the open run's noise is correlated, it has steps, and
        `run` would continue its noise state with another key.
    """
    key = run.key
    if self.open is not None and self.open["key"] == key:
      self._run = run
      return
    if self.open is not None:
      taken = steps_now - self.open["start"]
      if self.open.get("stateful") and taken > 0:
        raise ComposeError(
            "privacy ledger: the open run's noise is correlated across steps "
            f"({self.open['settings'].get('mechanism')}, {taken} steps); its "
            "ε assumes one participation pattern for the whole stream, which "
            f"a run with other settings ({run.settings}) would break. Finish "
            "with the same sampling and batch size, or compile the model "
            "with a new DP optimizer (a fresh noise state) before changing "
            "them.")
      self.close(steps_now)
    self.open = {"key": key, "start": int(steps_now),
                 "settings": dict(run.settings), "stateful": run.stateful,
                 "snapshot": None}
    self._run = run
    self.snapshot(steps_now)

  def close(self, steps_now: int) -> None:
    """Freezes the open run into the ledger at `steps_now` of its
    counter."""
    if self.open is None:
      return
    steps = steps_now - self.open["start"]
    if steps > 0:
      event = self._open_event(steps_now)
      self.closed.append({"settings": self.open["settings"],
                          "steps": int(steps),
                          "event": event_to_json(event),
                          "claimed": event is not None})
    self.open, self._run = None, None

  def snapshot(self, steps_now: int) -> None:
    """Stores the open run's event at `steps_now` (read after a restore
    in a process that has not rebuilt the run's sampler)."""
    if self.open is None or self._run is None:
      return
    steps = int(steps_now - self.open["start"])
    event = self._run.event_fn(steps) if steps > 0 else None
    self.open["snapshot"] = {"steps": steps,
                             "event": event_to_json(event),
                             "claimed": steps == 0 or event is not None}

  def cover(self, event: dp_accounting.DpEvent, settings: Dict[str, Any],
            steps_now: int) -> None:
    """Records a release whose event covers every run recorded so far.

    A DP hyperparameter search (`tf_pxg.tuning`) trains this model as one
    of its runs and releases it as the winner: the search's event
    (`RepeatAndSelectDpEvent` of the per-run event) bounds everything the
    runs released, this model's own runs included, so the ledger's runs
    are replaced by one closed entry of `event`, with `settings` and the
    covered runs' settings under "covers". Later runs compose on top as
    usual. The caller must have checked that the covered runs' event is
    inside `event` (the search checks each run's ledger against its
    planned per-run event before releasing anything).

    Raises:
      ValueError: `event` is None (a release must claim an ε).
    """
    if event is None:
      raise ValueError("privacy ledger: a covering release needs an event.")
    covered = [r["settings"] for r in self.runs(steps_now)]
    self.close(steps_now)
    self.closed = [{"settings": dict(settings, covers=covered),
                    "steps": sum(int(r["steps"]) for r in self.closed),
                    "event": event_to_json(event), "claimed": True}]

  # Reading -------------------------------------------------------------------

  def _open_event(self, steps_now: int):
    steps = steps_now - self.open["start"]
    if steps <= 0:
      return dp_accounting.NoOpDpEvent()
    if self._run is not None:
      return self._run.event_fn(steps)
    snap = self.open.get("snapshot") or {}
    if snap.get("steps") != steps:
      raise ValueError(
          f"privacy ledger: the open run has taken {steps} steps, but its "
          f"sampler is not in this process and its snapshot covers "
          f"{snap.get('steps')}; call fit (which rebuilds the sampler) or "
          "save the model at the end of training.")
    return event_from_json(snap["event"]) if snap.get("claimed") else None

  def runs(self, steps_now: Optional[int] = None) -> List[dict]:
    """Every run, closed and open: its settings, steps and whether an ε is
    claimed for it (JSON-able; the open run's steps at `steps_now`)."""
    out = [dict(settings=r["settings"], steps=r["steps"],
                claimed=r["claimed"]) for r in self.closed]
    if self.open is not None and steps_now is not None:
      steps = steps_now - self.open["start"]
      if steps > 0:
        out.append(dict(settings=self.open["settings"], steps=steps,
                        claimed=self._open_event(steps_now) is not None,
                        open=True))
    return out

  def event(self, steps_now: int,
            open_steps: Optional[int] = None) -> Optional[
                dp_accounting.DpEvent]:
    """The composition of every run's event, the open run at `steps_now`
    (or with `open_steps` steps: a budget's look-ahead); None if one run
    has no ε (e.g. past a whole-run mechanism's `num_steps`)."""
    events = []
    for r in self.closed:
      if not r["claimed"]:
        return None
      events.append(event_from_json(r["event"]))
    if self.open is not None:
      now = steps_now if open_steps is None else (
          self.open["start"] + open_steps)
      events.append(self._open_event(now))
    if any(e is None for e in events):
      return None
    events = [e for e in events if not isinstance(e, dp_accounting.NoOpDpEvent)]
    if not events:
      return dp_accounting.NoOpDpEvent()
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(
        events)

  def epsilon(self, steps_now: int, delta: float, accountant: str = "rdp",
              open_steps: Optional[int] = None) -> float:
    """ε of `event(...)` at `delta` (0 with nothing released; inf if a run
    claims none, or ran without noise)."""
    event = self.event(steps_now, open_steps)
    if isinstance(event, dp_accounting.NoOpDpEvent):
      return 0.0
    if event is None or _noiseless(event):
      return math.inf
    return accounting.event_epsilon(event, delta, accountant)

  @property
  def current_run(self) -> Optional[Run]:
    """The open run's `Run` in this process (None: none, or restored)."""
    return self._run

  @property
  def open_start(self) -> Optional[int]:
    """The step count at which the open run began (None: no open run)."""
    return None if self.open is None else self.open["start"]

  def to_json(self) -> str:
    return json.dumps({"closed": self.closed, "open": self.open},
                      sort_keys=True)

  def summary(self, steps_now: Optional[int] = None) -> str:
    """One line per run: its settings, steps and whether ε is claimed."""
    lines = []
    for i, r in enumerate(self.runs(steps_now)):
      settings = ", ".join(f"{k}={v}" for k, v in sorted(
          r["settings"].items()))
      state = " (open)" if r.get("open") else ""
      claim = "" if r["claimed"] else " [no ε claimed]"
      lines.append(f"run {i}{state}: {r['steps']} steps, {settings}{claim}")
    return "\n".join(lines) or "no noised release yet"


def _noiseless(event) -> bool:
  """Whether a Gaussian inside `event` has noise multiplier 0."""
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return event.noise_multiplier == 0
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return any(_noiseless(e) for e in event.events)
  inner = getattr(event, "event", None)
  return inner is not None and _noiseless(inner)
