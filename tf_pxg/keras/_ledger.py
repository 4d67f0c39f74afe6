"""The privacy ledger belongs to the weights (`tf_pxg.dp.ledger`).

A DP model holds its ledger in a `LedgerState`, a model attribute that
every path carrying the model's weights carries too:

* Keras saving (`.keras`, `save_weights`/`load_weights`, so
  `ModelCheckpoint(save_weights_only=True)` and `BackupAndRestore`): the
  model's `save_own_variables` writes the ledger's JSON next to the
  model's own variables, `load_own_variables` reads it back, whatever the
  order of `compile`, the optimizer's build and the load;
* `tf.train.Checkpoint` and `CheckpointManager`, immediate or deferred
  restore: `LedgerState` is a `tf.train.experimental.PythonState`, written
  when the checkpoint is saved (the ledger settled at that moment) and
  read when it is restored;
* weights that move without the model (`get_weights`/`set_weights`,
  `clone_model` then `set_weights`, layers shared by two DP wrappers, a
  DP-trained backbone under a new head): each floating weight's value has
  a **digest**; the values a DP model's training wrote are registered in
  this process (`_REGISTRY`: digest -> the ledger behind that value).
  Before a DP model trains, and whenever its ε is read, each of its
  weights is checked (`reconcile`): a value the model's ledger answers for
  passes; a registered value brings its ledger (merged:
  `PrivacyLedger.merge`, so the history is never counted twice); any
  other change since the model's last DP step warns, naming the weights
  (`WeightsChangedWarning`): the ledger cannot tell what they were trained
  on. `declare_public_weights` starts a fresh history on purpose, and
  refuses weights this process knows to be DP-trained.

Steps are counted from the compiled `DPOptimizer`'s `iterations` at each
**settle** (the start and end of `fit`, every read of ε, every save, a
recompile): the steps since the last settle are the open run's when they
were taken inside `fit` (its sampler drew them), else an unsampled run's
(`train_on_batch`, a custom loop: no ε claimed). A restore re-bases the
count (the restored ledger is exact at the moment it was saved). A
settle alone counts steps but registers nothing; `reconcile` registers
the values written by every step since the last reconcile (not the last
settle), so an ε read at each epoch end (`fit` logs it) does not keep
the trained values from carrying their history.

Residual limits (docs/threat_model.md, "What ε means"): values read out of
a model between its last settle and a copy made without its
`get_weights` (a layer's own `get_weights`, `variable.numpy()`) after
steps outside `fit`; weights moved to another process by a route that
carries no ledger (numpy files): the receiving model warns only if it has
a history of its own.
"""

from __future__ import annotations

import collections
import hashlib
import json
import warnings
import weakref
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_pxg.data import samplers
from tf_pxg.dp import ledger as ledger_lib

#: Where the ledger's JSON is kept among a model's own saved variables.
STORE_KEY = "dp_privacy_ledger"

#: Registered digests kept in this process (least recently used dropped).
REGISTRY_SIZE = 1 << 16

# digest of a DP-trained value -> the JSON of the ledger behind it.
_REGISTRY: "collections.OrderedDict[str, str]" = collections.OrderedDict()


class WeightsChangedWarning(UserWarning):
  """A DP model's weights changed outside its DP training."""


def dp_optimizer(optimizer):
  """The DPOptimizer of `optimizer` (inside a LossScaleOptimizer), else
  None (`tf_pxg.keras.optimizers.dp_optimizer_of`)."""
  from tf_pxg.keras.optimizers import dp_optimizer_of  # noqa: PLC0415
  return dp_optimizer_of(optimizer)


class LedgerState(tf.train.experimental.PythonState):
  """A DP model's privacy ledger and how it follows the weights.

  Attributes:
    ledger: the `PrivacyLedger`.
    vouched: digests of the weight values the ledger answers for (the
      values at the last settle, or restored with the ledger).
    written: those of them that DP training wrote (registered: a model
      that takes such a value takes the ledger).
    in_fit: a `fit` is training the open run.
  """

  def __init__(self, model):
    self._model = weakref.ref(model)
    self.ledger = ledger_lib.PrivacyLedger()
    self.vouched = set()
    self.written = set()
    self.in_fit = False
    self._counter = None  # (weakref to the DPOptimizer, its count)
    # Steps settled since the last `reconcile` (`take_unreconciled`).
    self._unreconciled = 0

  # tf.train.experimental.PythonState ------------------------------------

  def serialize(self) -> str:
    model = self._model()
    if model is not None:
      reconcile(model)
    return self.to_json()

  def deserialize(self, string_value) -> None:
    if isinstance(string_value, bytes):
      string_value = string_value.decode()
    self.restore(string_value)

  # ----------------------------------------------------------------------

  def to_json(self) -> str:
    return json.dumps({"ledger": self.ledger.to_json(),
                       "vouched": sorted(self.vouched),
                       "written": sorted(self.written)})

  def restore(self, doc: str) -> None:
    """Takes a saved ledger (its weights are restored with it): the step
    count re-bases; a `fit` in progress (`BackupAndRestore` restores at
    its start) goes on on top of it."""
    data = json.loads(doc) if doc else {}
    training = self.ledger.current_run if self.in_fit else None
    self.ledger = ledger_lib.PrivacyLedger(data.get("ledger"))
    self.vouched = set(data.get("vouched", []))
    self.written = set(data.get("written", []))
    self._counter = None
    self._unreconciled = 0  # the steps wrote values the restore replaced
    _register(self.written, self.ledger)
    if training is not None:
      self.ledger.begin(training)

  def settle(self, optimizer) -> int:
    """Counts the steps `optimizer` (a DPOptimizer, or None) applied since
    the last settle (module docstring); returns how many."""
    if optimizer is None:
      return 0
    now = optimizer.step_count()
    known = self._counter
    steps = 0
    if known is not None and known[0]() is optimizer and now > known[1]:
      steps = now - known[1]
      self.ledger.add_steps(
          steps, sampled=self.in_fit and self.ledger.current_run is not None)
    self._counter = (weakref.ref(optimizer), now)
    self._unreconciled += steps
    return steps

  def take_unreconciled(self) -> int:
    """The steps settled since the last call (`reconcile`'s): a settle
    alone (ε read inside `fit`, a recompile) counts steps for the ledger
    but does not register the values they wrote, so `reconcile` must still
    see them, or the trained values would not carry their history."""
    steps, self._unreconciled = self._unreconciled, 0
    return steps


def state_of(model) -> LedgerState:
  """The model's `LedgerState` (made on first use)."""
  state = model.__dict__.get("_dp_ledger_state")
  if state is None:
    state = LedgerState(model)
    model._dp_ledger_state = state  # pylint: disable=protected-access
  return state


def ledger_of(model) -> ledger_lib.PrivacyLedger:
  """The model's ledger, settled and checked against its weights
  (`reconcile`; inside `fit` only settled)."""
  state = state_of(model)
  if state.in_fit:
    state.settle(dp_optimizer(getattr(model, "optimizer", None)))
  else:
    reconcile(model)
  return state.ledger


# Digests ----------------------------------------------------------------------


def _weights(model):
  """The model's floating weights (a seed generator's integer state moves
  with every random draw, not with training)."""
  return [v for v in model.weights
          if keras.backend.is_float_dtype(v.dtype)]


def digest(variable) -> str:
  """A digest of a variable's current value (shape, dtype and bytes)."""
  value = np.ascontiguousarray(np.asarray(variable.numpy()))
  h = hashlib.blake2b(digest_size=16)
  h.update(repr((value.shape, value.dtype.str)).encode())
  h.update(value.tobytes())
  return h.hexdigest()


def _register(digests, ledger) -> None:
  if ledger.is_empty:
    return
  doc = ledger.to_json()
  for d in digests:
    _REGISTRY[d] = doc
    _REGISTRY.move_to_end(d)
  while len(_REGISTRY) > REGISTRY_SIZE:
    _REGISTRY.popitem(last=False)


def reconcile(model, check: bool = True) -> None:
  """Settles the step count, then checks each weight (module docstring):
  a registered value brings its ledger; another change since the last
  settle warns when the model has a history and took no DP step since
  (steps since explain the change). Then the current values are vouched
  for; those DP training wrote (the trainable ones the steps changed, the
  adopted ones) are registered with the ledger."""
  state = state_of(model)
  state.settle(dp_optimizer(getattr(model, "optimizer", None)))
  steps = state.take_unreconciled()  # since the last reconcile, not settle
  weights = _weights(model)
  digests = [digest(v) for v in weights]
  written = state.written & set(digests)
  if steps:
    # What the steps wrote: the trainable values they changed (a value
    # they left as it was, e.g. at learning rate 0, carries nothing of
    # them, and would match every model built from the same seed).
    trainable = {id(v) for v in model.trainable_weights}
    written |= {d for v, d in zip(weights, digests)
                if id(v) in trainable and d not in state.vouched}
  if check and not state.in_fit:
    changed = []
    for v, d in zip(weights, digests):
      if d in state.vouched or d in written:
        continue
      doc = _REGISTRY.get(d)
      if doc is not None:
        state.ledger.merge(ledger_lib.PrivacyLedger(doc))
        written.add(d)
      elif state.vouched and not steps:
        changed.append(v.path)
    if changed and not state.ledger.is_empty:
      warnings.warn(_changed_message(model, changed),
                    WeightsChangedWarning, stacklevel=3)
  state.vouched, state.written = set(digests), written
  _register(written, state.ledger)


def _changed_message(model, paths) -> str:
  shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more"
                                   if len(paths) > 5 else "")
  return (
      f"Model {model.name!r}: weights {shown} changed outside DP training "
      "since its last DP step (set_weights, an assignment, a load without "
      "a privacy ledger). Its privacy ledger still counts its own history, "
      "but cannot tell what the new values were trained on. If they are "
      "public (e.g. pretrained on public data), call "
      "model.declare_public_weights() to start a fresh history; if they "
      "come from a DP model, copy them from it after its fit (or with its "
      "get_weights) in this process, or load its saved weights with "
      "load_weights: its ledger then comes with them.")


# The model's moments -----------------------------------------------------------


def hand_over(model, old, new) -> None:
  """At `compile`: the old optimizer's steps are counted; a new DP
  optimizer (a fresh noise state) closes the open run."""
  state = state_of(model)
  old_dp, new_dp = dp_optimizer(old), dp_optimizer(new)
  state.settle(old_dp)
  if new_dp is not None and new_dp is not old_dp:
    state.ledger.fresh_noise_state()
    state.settle(new_dp)


def run_for(plan, sampler) -> ledger_lib.Run:
  """The ledger's `Run` of `sampler` under `plan`."""
  mechanism, sigma = plan.mechanism, plan.noise_multiplier

  def event_fn(t: int):
    try:
      return sampler.dp_event(mechanism, sigma, t)
    except samplers.NotCertifiedError:
      return None  # shuffled batches: no ε claimed for this run

  settings = {
      "sampler": type(sampler).__name__,
      "sampling_rate": sampler.sampling_rate,
      "expected_batch_size": sampler.expected_batch_size,
      "num_examples": sampler.num_examples,
      "privacy_unit": sampler.privacy_unit,
      "noise_multiplier": sigma,
      "mechanism": repr(mechanism),
      "l2_norm_clip": plan.l2_norm_clip,
      **getattr(sampler, "ledger_settings", {}),
  }
  if plan.unprotected_training_metrics:
    # Logged un-noised on every private batch: outside every ε (the key is
    # only there when on, so older ledgers' runs keep their keys).
    settings["unprotected_training_metrics"] = "logged, not covered by ε"
  return ledger_lib.Run(event_fn, settings, stateful=mechanism.stateful)


def begin_fit(model, sampler) -> None:
  """Records the run `fit` is about to train, after checking the weights
  (`reconcile`: steps since the last settle are unsampled).

  Raises:
    tf_pxg.dp.ledger.ComposeError: it cannot follow the open run.
  """
  dp = dp_optimizer(getattr(model, "optimizer", None))
  if dp is None or sampler is None:
    return
  state = state_of(model)
  reconcile(model)
  state.ledger.begin(run_for(dp.plan, sampler))
  state.in_fit = True


def end_fit(model) -> None:
  """At the end of `fit` (also when it raised): its steps are counted as
  its run's, and the trained values registered."""
  state = state_of(model)
  if not state.in_fit:
    return
  try:
    reconcile(model, check=False)  # the steps counted as the run's
  finally:
    state.in_fit = False


def cover(model, event, settings) -> None:
  """The model's ledger is replaced by one release of `event`
  (`PrivacyLedger.cover`, a DP search's winner); its values registered."""
  state = state_of(model)
  reconcile(model, check=False)
  state.ledger.cover(event, settings)
  reconcile(model, check=False)


def declare_public(model, note: str) -> None:
  """Starts a fresh history for the model's current weights (declared
  public by the user).

  Raises:
    ValueError: a weight's value was written by DP training in this
      process (named): it is not public.
  """
  state = state_of(model)
  state.settle(dp_optimizer(getattr(model, "optimizer", None)))
  trained = [v.path for v in _weights(model)
             if digest(v) in _REGISTRY]
  if trained:
    raise ValueError(
        f"Model {model.name!r}: weights {', '.join(trained[:5])} hold "
        "values written by DP training in this process (their privacy "
        "ledger is known), so they are not public; their history stays "
        "with them. Declare public only weights trained on public data "
        "(e.g. loaded from a public checkpoint before any DP step).")
  state.ledger.declare_public(note)
  state.take_unreconciled()  # no step wrote the declared values
  state.vouched, state.written = {digest(v) for v in _weights(model)}, set()


def saved_bytes(model) -> np.ndarray:
  """The ledger's document for a save (settled and checked first)."""
  reconcile(model)
  return np.frombuffer(state_of(model).to_json().encode(), np.uint8)


def load_saved(model, data) -> None:
  """Restores the ledger `saved_bytes` wrote."""
  state_of(model).restore(np.asarray(data, np.uint8).tobytes().decode())


class StoreWithout:
  """A read-only view of a Keras weights store without one key (the
  ledger's), for the model's own variables."""

  def __init__(self, store, key: str):
    self._store, self._key = store, key

  def keys(self):
    return [k for k in self._store.keys() if k != self._key]

  def __len__(self):
    return len(self.keys())

  def __getitem__(self, key):
    return self._store[key]


class LedgerMixin:
  """The privacy ledger's methods of a DP model (`privacy_ledger`,
  `epsilon`, `privacy_summary`, `declare_public_weights`) and the Keras
  weights paths that carry it (`save_own_variables`, `load_own_variables`,
  `load_weights`, `get_weights`): a base of
  `tf_pxg.keras.models._DPTrainingMixin`, before Keras' model class in the
  MRO."""

  @property
  def privacy_ledger(self):
    """The `tf_pxg.dp.ledger.PrivacyLedger` of the history behind this
    model's weights (every fit, recompile, resume, and the histories of
    weights copied or loaded into it; `summary()` prints it): held by the
    model, settled and checked against the weights when read
    (this module)."""
    return ledger_of(self)

  def epsilon(self, delta: float = 1e-5,
              accountant: Optional[str] = None) -> float:
    """ε at `delta` of everything behind this model's weights: the
    composition of its privacy ledger's runs, by dp-accounting (∞ if
    steps on batches no sampler drew are among them: `train_on_batch`, a
    custom loop); `accountant` defaults to the plan's."""
    return self.privacy_ledger.epsilon(
        delta, accountant or self.dp_plan.accountant or "rdp")

  def privacy_summary(self, delta: float = 1e-5) -> str:
    """What the training released so far, one line per run of the privacy
    ledger (settings, steps, whether an ε is claimed), then a line with
    the risk of the whole history in attack terms
    (`PrivacyLedger.risk(delta)`: μ-GDP, exact or the dominating fit at
    `delta`, and the best membership attack's TPR at FPR 1e-3 and 1e-2;
    docs/threat_model.md, "Reading the risk")."""
    return self.privacy_ledger.summary(delta=delta)

  def declare_public_weights(self, note: str = "declared public by the "
                             "user") -> None:
    """Starts a fresh privacy history for the current weights, which the
    caller states are public (e.g. pretrained on public data); `note` is
    kept in the ledger's summary.

    Raises:
      ValueError: a weight holds a value DP training wrote in this
        process (named): its history is known and stays.
    """
    declare_public(self, note)

  # Weights paths carry the ledger ---------------------------------------------

  def save_own_variables(self, store):
    super().save_own_variables(store)
    store[STORE_KEY] = saved_bytes(self)

  def load_own_variables(self, store):
    if STORE_KEY in list(store.keys()):
      load_saved(self, store[STORE_KEY])
      store = StoreWithout(store, STORE_KEY)
    super().load_own_variables(store)

  def load_weights(self, filepath, *args, **kwargs):
    """Keras' `load_weights`; a compiled model's optimizer is built first,
    so its state (step count, noise buffers) is restored with the weights
    and the privacy ledger, not skipped."""
    optimizer = getattr(self, "optimizer", None)
    if optimizer is not None and not optimizer.built and self.built:
      optimizer.build(self.trainable_variables)
    return super().load_weights(filepath, *args, **kwargs)

  def get_weights(self):
    """Keras' `get_weights`, after the ledger is settled and the values
    registered (a DP model that takes them then takes their history)."""
    reconcile(self)
    return super().get_weights()
