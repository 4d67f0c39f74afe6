"""The privacy ledger: every noised release behind a model's weights.

ε is a property of what was released, not of the last optimizer's step
counter. The ledger records each **run**, a stretch of noised steps with
one DP event per step count (one sampler, mechanism and σ): the first
`fit`, a second `fit` with another batch size or sampling, the steps after
a recompile with a new DP optimizer, and the **unsampled** steps of
`train_on_batch` or a custom loop (batches no sampler drew: no ε is
claimed for them, ε = ∞, never 0). The reported ε (`PrivacyCallback`,
`model.epsilon(...)`, the step limit of a budget) is that of the
**composition of all runs' events** (`dp_accounting.ComposedDpEvent`),
computed by dp-accounting: heterogeneous where the runs differ, exact
where they do not (a run's own event is its sampler's, e.g.
`SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)`).

Contract:

* A run has an `id` (random, 128 bits), its settings, its step count and
  its event at that count (stored with it, so a ledger read back from
  JSON needs no sampler). The **open** run is the one `fit` trains;
  `add_steps(n, sampled=True)` counts n more of its steps. Steps with
  `sampled=False` close the open run and go to an unsampled run (no ε).
* `begin` continues the open run when the run about to train has its
  `key` (the events its sampler gives for 1 and 2 steps and its
  settings); otherwise it closes the open run and opens a new one.
* A run whose noise is correlated across steps (a stateful mechanism:
  BandMF, BLT) cannot be followed on the **same** noise state by a run with
  another key: its ε assumes one participation pattern for the whole
  stream. `begin` raises (`ComposeError`); a recompile with a new DP
  optimizer starts a fresh noise state (`fresh_noise_state`), after which
  the runs compose.
* **Merging** (`merge`): weights whose history is another ledger's (copied,
  shared, loaded) bring it: the runs are united by `id`, a run present in
  both keeping its larger step count (a run's steps only grow, so the
  larger count is the later state of the same run). A history is never
  counted twice, however often it is merged.
* `declare_public` starts a fresh history on purpose (weights the user
  states are public, e.g. pretrained on public data); the declaration is
  kept (`summary`).
* The ledger is state, not configuration: a JSON document (`to_json`).
  Where it lives and how it follows the weights is the owner's
  (`tf_pxg.keras._ledger`); the settings of each run are recorded for
  inspection (`summary()`), never read back as configuration.

The privacy argument: each run is a mechanism whose ε dp-accounting
bounds from its event; runs execute one after another on the same data,
and adaptive sequential composition of the events (`ComposedDpEvent`)
bounds the whole history (Dwork & Roth 2014, Thm 3.16; Mironov 2017 for
RDP; the PLD accountant composes the same way). Merged histories are
runs on the same data too (the union over-approximates when two
histories ran on disjoint data: conservative).
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from typing import Any, Callable, Dict, List, Optional

import attr
import dp_accounting

from tf_pxg import accounting
from tf_pxg import risk as risk_lib

__all__ = ["ComposeError", "PrivacyLedger", "Run", "UNSAMPLED",
           "event_from_json", "event_to_json"]


class ComposeError(ValueError):
  """A run cannot be composed with the open run (correlated noise)."""


#: The settings of steps on batches no sampler drew.
UNSAMPLED = {"sampler": "none (train_on_batch or a custom loop: batches no "
                        "sampler drew)"}


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


def _new_id() -> str:
  return secrets.token_hex(16)


class PrivacyLedger:
  """The runs released so far (module docstring).

  Args:
    state: a `to_json()` document to continue (default: empty).
  """

  def __init__(self, state: Optional[str] = None):
    doc = json.loads(state) if state else {}
    self.closed: List[dict] = [_with_id(r) for r in doc.get("closed", [])]
    self.open: Optional[dict] = doc.get("open")
    if self.open is not None:
      self.open = _with_id(self.open)
    self.public: List[str] = list(doc.get("public", []))
    self._run: Optional[Run] = None  # the open run's, in this process

  # Recording ---------------------------------------------------------------

  def begin(self, run: Run) -> None:
    """Continues the open run if `run` has its key, else closes it and
    opens `run` (0 steps).

    Raises:
      ComposeError: the open run's noise is correlated, it has steps, and
        `run` would continue its noise state with another key.
    """
    key = run.key
    if self.open is not None and self.open["key"] == key:
      self._run = run
      return
    if self.open is not None and self.open.get("stateful") and (
        self.open["steps"] > 0):
      raise ComposeError(
          "privacy ledger: the open run's noise is correlated across steps "
          f"({self.open['settings'].get('mechanism')}, "
          f"{self.open['steps']} steps); its ε assumes one participation "
          f"pattern for the whole stream, which a run with other settings "
          f"({run.settings}) would break. Finish with the same sampling and "
          "batch size, or compile the model with a new DP optimizer (a "
          "fresh noise state) before changing them.")
    self.close()
    self.open = {"id": _new_id(), "key": key, "settings": dict(run.settings),
                 "stateful": run.stateful, "steps": 0, "event": None,
                 "claimed": True}
    self._run = run

  def add_steps(self, steps: int, sampled: bool) -> None:
    """Counts `steps` more noised steps: the open run's when `sampled`
    (drawn by its sampler, in its `fit`), else an unsampled run's (no ε
    claimed; the open run is closed first)."""
    steps = int(steps)
    if steps <= 0:
      return
    if sampled and self.open is not None:
      self.open["steps"] += steps
      self._store_open_event()
      return
    self.close()
    last = self.closed[-1] if self.closed else None
    if last is not None and last.get("unsampled"):
      last["steps"] += steps
      return
    self.closed.append({"id": _new_id(), "settings": dict(UNSAMPLED),
                        "steps": steps, "event": None, "claimed": False,
                        "unsampled": True})

  def _store_open_event(self) -> None:
    if self._run is None:
      return  # restored: its stored event is at its stored steps
    event = self._run.event_fn(self.open["steps"])
    self.open["event"] = event_to_json(event)
    self.open["claimed"] = event is not None

  def close(self) -> None:
    """Freezes the open run into the ledger (dropped if it has no step)."""
    if self.open is None:
      return
    if self.open["steps"] > 0:
      self.closed.append({k: self.open[k] for k in
                          ("id", "settings", "steps", "event", "claimed")})
    self.open, self._run = None, None

  def fresh_noise_state(self) -> None:
    """A new DP optimizer (a fresh noise state) follows: the open run is
    closed, so the next run composes whatever its settings."""
    self.close()

  def merge(self, other: "PrivacyLedger") -> bool:
    """Unites `other`'s runs with these (module docstring: by `id`, the
    larger step count kept; `other`'s open run joins as a closed run).
    Returns whether anything was added."""
    mine = {r["id"]: r for r in self.closed}
    if self.open is not None:
      mine[self.open["id"]] = self.open
    changed = False
    theirs = list(other.closed)
    if other.open is not None and other.open["steps"] > 0:
      theirs.append({k: other.open[k] for k in
                     ("id", "settings", "steps", "event", "claimed")})
    for run in theirs:
      have = mine.get(run["id"])
      if have is None:
        self.closed.append(dict(run))
        mine[run["id"]] = self.closed[-1]
        changed = True
      elif run["steps"] > have["steps"]:
        for k in ("steps", "event", "claimed"):
          have[k] = run[k]
        changed = True
    for note in other.public:
      if note not in self.public:
        self.public.append(note)
    return changed

  def declare_public(self, note: str) -> None:
    """Starts a fresh history: the weights are declared public (`note`
    says by whom and which; kept for `summary`)."""
    self.closed, self.open, self._run = [], None, None
    self.public.append(note)

  def cover(self, event: dp_accounting.DpEvent,
            settings: Dict[str, Any]) -> None:
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
    covered = [r["settings"] for r in self.runs()]
    self.close()
    self.closed = [{"id": _new_id(), "settings": dict(settings,
                                                      covers=covered),
                    "steps": sum(int(r["steps"]) for r in self.closed),
                    "event": event_to_json(event), "claimed": True}]

  # Reading -------------------------------------------------------------------

  def _open_event(self, extra_steps: int = 0):
    steps = self.open["steps"] + extra_steps
    if steps <= 0:
      return dp_accounting.NoOpDpEvent()
    if self._run is not None:
      return self._run.event_fn(steps)
    if extra_steps:
      raise ValueError(
          "privacy ledger: the open run was restored without its sampler, "
          "so its event after more steps is unknown; call fit (which "
          "rebuilds the sampler) first.")
    return event_from_json(self.open["event"]) if self.open["claimed"] \
        else None

  def runs(self, steps_now: Optional[int] = None) -> List[dict]:
    """Every run, closed and open: its settings, steps and whether an ε is
    claimed for it (JSON-able). (`steps_now` is accepted for callers of
    the earlier signature and not used: the owner counts the steps.)"""
    del steps_now
    out = [dict(settings=r["settings"], steps=r["steps"],
                claimed=r["claimed"]) for r in self.closed]
    if self.open is not None and self.open["steps"] > 0:
      out.append(dict(settings=self.open["settings"],
                      steps=self.open["steps"],
                      claimed=self._open_event() is not None, open=True))
    return out

  @property
  def steps(self) -> int:
    """Noised steps behind the weights, over every run."""
    return sum(r["steps"] for r in self.runs())

  def event(self, extra_steps: int = 0) -> Optional[dp_accounting.DpEvent]:
    """The composition of every run's event, the open run's with
    `extra_steps` more (a budget's look-ahead); None if one run has no ε
    (unsampled steps, shuffled batches, past a whole-run mechanism's
    `num_steps`)."""
    events = []
    for r in self.closed:
      if not r["claimed"]:
        return None
      events.append(event_from_json(r["event"]))
    if self.open is not None:
      events.append(self._open_event(extra_steps))
    if any(e is None for e in events):
      return None
    events = [e for e in events if not isinstance(e, dp_accounting.NoOpDpEvent)]
    if not events:
      return dp_accounting.NoOpDpEvent()
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(
        events)

  def epsilon(self, delta: float, accountant: str = "rdp",
              extra_steps: int = 0) -> float:
    """ε of `event(extra_steps)` at `delta` (0 with nothing released; inf
    if a run claims none, or ran without noise)."""
    event = self.event(extra_steps)
    if isinstance(event, dp_accounting.NoOpDpEvent):
      return 0.0
    if event is None or _noiseless(event):
      return math.inf
    return accounting.event_epsilon(event, delta, accountant)

  def risk(self, delta: float = 1e-5,
           extra_steps: int = 0) -> risk_lib.PrivacyRisk:
    """The same composition, `event(extra_steps)`, in attack terms
    (`tf_pxg.risk.event_risk`): μ of μ-GDP (exact for Gaussian
    compositions, else the dominating fit at `delta`) and the best
    attack's TPR at FPR 1e-3 and 1e-2 (μ = inf, TPR = 1 if a run claims
    no ε; μ = 0, TPR = FPR with nothing released)."""
    return risk_lib.event_risk(self.event(extra_steps), delta)

  @property
  def current_run(self) -> Optional[Run]:
    """The open run's `Run` in this process (None: none, or restored)."""
    return self._run

  @property
  def is_empty(self) -> bool:
    """Whether no noised step is recorded."""
    return not self.runs()

  def to_json(self) -> str:
    return json.dumps({"closed": self.closed, "open": self.open,
                       "public": self.public}, sort_keys=True)

  def copy(self) -> "PrivacyLedger":
    """A copy of the recorded runs (no sampler: the copy's open run reads
    its stored event)."""
    return PrivacyLedger(self.to_json())

  def summary(self, steps_now: Optional[int] = None,
              delta: Optional[float] = None) -> str:
    """One line per run: its settings, steps and whether ε is claimed;
    with `delta`, a last line with the whole history's `risk(delta)`."""
    lines = [f"weights declared public: {note}" for note in self.public]
    for i, r in enumerate(self.runs(steps_now)):
      settings = ", ".join(f"{k}={v}" for k, v in sorted(
          r["settings"].items()))
      state = " (open)" if r.get("open") else ""
      claim = "" if r["claimed"] else " [no ε claimed: ε = ∞]"
      lines.append(f"run {i}{state}: {r['steps']} steps, {settings}{claim}")
    if not self.runs():
      lines.append("no noised release yet")
    if delta is not None:
      lines.append(self.risk(delta).describe())
    return "\n".join(lines)


def _with_id(run: dict) -> dict:
  """`run` with an id and a step count (a document of the earlier layout:
  an open run's steps were in its snapshot)."""
  run = dict(run)
  run.setdefault("id", _new_id())
  if "steps" not in run:
    snap = run.pop("snapshot", None) or {}
    run["steps"] = int(snap.get("steps", 0))
    run["event"] = snap.get("event")
    run["claimed"] = bool(snap.get("claimed", True))
  run.pop("start", None)
  run.setdefault("claimed", True)
  return run


def _noiseless(event) -> bool:
  """Whether a Gaussian inside `event` has noise multiplier 0."""
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return event.noise_multiplier == 0
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return any(_noiseless(e) for e in event.events)
  inner = getattr(event, "event", None)
  return inner is not None and _noiseless(inner)
