"""A generated adversary: small models whose every op input may carry data.

Invariant 4 of the design (docs/design.md) says that whatever is derived from
an input or a label is data at *every* input of every op: a size, a depth, a
seed, a condition, a slice bound, a permutation, an index, a row partition,
and through variables and tables. This module composes small models from an
op vocabulary and feeds each such input position from one of

* `const`: a literal (independent of the examples);
* `ex`: a per-example value (a function of the example's own row: `sin(x)`,
  the token ids), where the position takes a `[B, ...]` tensor;
* `batch`: the batch axis itself, for an `axis` position (a constant that
  reduces or accumulates over the examples);
* `f.<kind>`: a float statistic of the whole batch (`f.mean`, `f.maxabs`,
  `f.row0`, `f.colmean`, `f.hmean`, `f.fromi`, `f.ymean` of the labels);
* `i.<kind>`: an integer statistic of the whole batch (`i.maxid`,
  `i.count`, `i.row0`, `i.lenmax`, `i.fromf`, `i.argmax0`, `i.uniq`,
  `i.freq`), and the same mixing written without a plain reduction over
  axis 0 (`f.flatmax`, `f.tmean`, `f.gram`, `f.softmax0`, `f.l2norm0`,
  `f.segmax`, `f.sortlast`, `f.scan`, `f.moments`).

Each model is `x -> ops -> x @ W -> ops -> 0.5 * ||h - y||^2` per example,
with `x: [B, K]` floats, `ids: [B, K]` token ids (0 is padding), `y: [B, K]`
labels and one parameter, the Dense kernel `W: [K, K]`. Every op maps the
data path `h: [B, K]` to `[B, K]`, so any composition is a valid model.

A composition is written as a string and parsed back, so a failure is its own
regression case:

    "one_hot[idx=ex,depth=i.maxid] > W > where3:1[cond=f.mean]"

(`op:variant[position=source,...]`, steps separated by ` > `, `W` the
parameter's matmul.) `generate(seed)` draws one from a
`numpy.random.RandomState(seed)`.

`check_models(compositions, modes)` judges each model in each mode (`eager`:
the tape eagerly; `function`: inside `tf.function`; `jit`: inside
`tf.function(jit_compile=True)`) the way DP training would: it must either be

* **refused**: a `ValueError` whose message names an op (`"op '"`), raised by
  `tf_pxg.GradientTape` or by the check a DP train step makes of the
  forward pass's state writes (`GradientTape.data_dependent_writes`); or
* **exact**: `per_example_gradient` on the batch D equals
  `reference_per_example_gradients` (a plain `tf.GradientTape` loop over
  single examples), and `clipped_gradient_sum` on D and on D' (D with its
  example 0 replaced by an extreme one: large values, the largest token id)
  equals the clipped sum of the reference; **and bounded**: the replace-one
  influence `||clipped_sum(D) - clipped_sum(D')||` is at most `2C`, C the clip
  norm (the median of the reference's per-example norms on D).

Anything else is a failure: `leak` (accepted, influence above 2C: DP's
sensitivity bound is broken), `inexact` (accepted, wrong per-example
gradients), `bad_refusal` (a `ValueError` naming no op) or `crash` (another
error where plain TensorFlow runs the model in that mode). A model plain
TensorFlow cannot run in a mode (a dynamic shape under XLA, a lookup table
under XLA) is `unsupported` there; one whose reference loop itself fails is
`invalid` (a generator bug).

Speed: each model is traced on its own in each graph mode (a `tf.function`
of its own, under XLA called from a `jit_compile=True` step), once for a
batch (called on D and on D'); a refusal is a `ValueError` while it traces,
and a refused model costs nothing more. The reference and the runs are only
for the models some mode accepted; under XLA one compilation serves D and
D', and a model XLA cannot compile fails alone. (Compiling several models
in one XLA program saves little, and costs more for some.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
import traceback
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

# The vocabulary half (`adversary_models`), whose names are this module's too.
from tf_pxg.testing.adversary_models import (
    ALL, AXIS, B, F_KINDS, I_KINDS, K, PARAM, PRE_STATS, SCALAR, V,
    VOCABULARY, Composition, Model, OpSpec, Step, generate, is_stat)

__all__ = [
    "ALL", "AXIS", "B", "F_KINDS", "I_KINDS", "K", "PARAM", "PRE_STATS",
    "SCALAR", "V", "VOCABULARY", "Composition", "Model", "OpSpec", "Step",
    "generate", "is_stat", "MODES", "OK_STATUSES", "FAIL_STATUSES",
    "Outcome", "make_data", "reference", "check_models", "unguarded",
    "summarize", "minimize", "search", "TIMINGS"]

MODES = ("eager", "function", "jit")
OK_STATUSES = ("refused", "exact", "unsupported")
FAIL_STATUSES = ("leak", "inexact", "bad_refusal", "crash", "invalid")

# Data ---------------------------------------------------------------------


EXTREME_X = np.arange(25.0, 25.0 - K, -1.0).astype(np.float32)


def make_data(seed: int):
  """(D, D'): `x, ids, y` of B ordinary examples (ids: 1 to 3 tokens in
  [1, V - 2], then padding 0), and the same batch with example 0 replaced
  by an extreme one (large x, every id V - 1, y = 20)."""
  rng = np.random.RandomState(seed)
  x = rng.standard_normal((B, K)).astype(np.float32)
  ids = np.zeros((B, K), np.int32)
  for b in range(B):
    n = rng.randint(1, K)
    ids[b, :n] = rng.randint(1, V - 1, size=n)
  y = rng.standard_normal((B, K)).astype(np.float32)
  x2, ids2, y2 = x.copy(), ids.copy(), y.copy()
  x2[0], ids2[0], y2[0] = EXTREME_X, V - 1, 20.0
  return ((tf.constant(x), tf.constant(ids), tf.constant(y)),
          (tf.constant(x2), tf.constant(ids2), tf.constant(y2)))


# Judging ------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
  composition: str
  mode: str
  status: str
  influence: float = float("nan")
  bound: float = float("nan")
  error: str = ""
  seed: int = 0
  data_seed: int = 0

  @property
  def failed(self):
    return self.status in FAIL_STATUSES

  def describe(self):
    s = (f"[{self.mode}] {self.status}: {self.composition!r} (model seed "
         f"{self.seed}, data seed {self.data_seed})")
    if self.status in ("leak", "inexact", "exact"):
      s += f" influence {self.influence:.4g} vs 2C = {self.bound:.4g}"
    if self.error:
      s += f"; {self.error}"
    return s


class _Refusal(ValueError):
  """The DP train step's refusal of a data-dependent state write."""


def _forward(model: Model, data):
  """The forward pass under `tf_pxg.GradientTape` (persistent), then the DP
  train step's refusal of a data-dependent state write."""
  from tf_pxg.gradient_tape import GradientTape  # noqa: PLC0415
  model.reset_state()
  pre = model.prestats(*data)            # before the tape records
  tape = GradientTape(persistent=True, examples=data)
  with tape:
    losses = model.losses(*data, pre=pre)
  writes = tape.data_dependent_writes(data, model.state_variables)
  if writes:
    raise _Refusal(f"{writes[0][0].describe()} writes state from the data")
  return tape, losses


def _pxg_first(model: Model, d):
  """Stage 1 on D: the forward pass and `per_example_gradient` (where the
  engine refuses a model, before any clipping)."""
  tape, losses = _forward(model, d)
  return tape, losses, tape.per_example_gradient(losses, [model.w])[0]


def _pxg_rest(model: Model, tape, losses, d2, clip):
  """Stage 2: `clipped_gradient_sum` on D (same tape) and on D'."""
  cs = tape.clipped_gradient_sum(losses, [model.w], clip)[0][0]
  tape2, losses2 = _forward(model, d2)
  cs2 = tape2.clipped_gradient_sum(losses2, [model.w], clip)[0][0]
  return cs, cs2


def _pxg_sum(model: Model, d, clip):
  """The graph and XLA modes' question: `clipped_gradient_sum` on one
  batch (asked of D and of D' by two calls of one traced function, so each
  model traces once per mode). Per-example gradients are compared eagerly;
  here a wrong one shows in the clipped sums (the clip, at the median norm,
  is active for half the examples)."""
  tape, losses = _forward(model, d)
  return tape.clipped_gradient_sum(losses, [model.w], clip)[0][0]


def _pxg(model: Model, d, d2, clip):
  """What DP training computes, under `tf_pxg.GradientTape`: per-example
  gradients and the clipped sum on D, the clipped sum on D'. Raises the
  tape's refusal, or the train step's (a data-dependent state write)."""
  tape, losses, pe = _pxg_first(model, d)
  cs, cs2 = _pxg_rest(model, tape, losses, d2, clip)
  return pe, cs, cs2


def _plain(model: Model, d):
  """Plain TensorFlow's batch gradient (does the model run in a mode?)."""
  model.reset_state()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model.losses(*d))
  return tape.gradient(loss, model.w)


@dataclasses.dataclass
class _Reference:
  pe: np.ndarray          # [B, K, K] on D
  cs: np.ndarray          # clipped sum on D
  cs2: np.ndarray         # clipped sum on D'
  clip: float
  scale: float            # magnitude for the tolerance


def _clipped(pe: np.ndarray, losses: np.ndarray, clip: float) -> np.ndarray:
  flat = pe.reshape(pe.shape[0], -1).astype(np.float64)
  norms = np.sqrt(np.sum(flat * flat, axis=1))
  finite = np.isfinite(norms) & np.isfinite(losses)
  with np.errstate(all="ignore"):
    c = np.where(finite, np.minimum(1.0, clip / np.maximum(norms, 1e-30)),
                 0.0)
  flat = np.where(finite[:, None], flat, 0.0)
  return (c[:, None] * flat).sum(0).reshape(pe.shape[1:])


def _single(model: Model, data, b: int):
  """Example b alone (a batch of one) under a plain `tf.GradientTape`: its
  loss and the gradient of its loss with respect to W (zeros if
  unconnected)."""
  model.reset_state()
  with tf.GradientTape() as tape:
    loss = model.losses(*(t[b:b + 1] for t in data))
  g = tape.gradient(loss, model.w)
  g = tf.zeros_like(model.w) if g is None else tf.convert_to_tensor(g)
  return g.numpy(), float(loss.numpy()[0])


def reference(model: Model, d, d2) -> _Reference:
  """The plain `tf.GradientTape` loop over single examples (as
  `tf_pxg.testing.reference_per_example_gradients`, which also returns each
  example's loss here), on D and on D'. D' differs from D in example 0
  only, and each example runs alone, so D' needs one more run."""
  runs = [_single(model, d, b) for b in range(B)]
  pe = np.stack([g for g, _ in runs])
  losses = np.array([l for _, l in runs])
  g0, l0 = _single(model, d2, 0)
  pe2, losses2 = pe.copy(), losses.copy()
  pe2[0], losses2[0] = g0, l0
  norms = np.sqrt(np.sum(pe.reshape(B, -1).astype(np.float64) ** 2, 1))
  finite = norms[np.isfinite(norms)]
  clip = float(np.median(finite)) if finite.size else 1.0
  clip = max(clip, 1e-3)
  scale = max(float(np.max(np.abs(pe[np.isfinite(pe)]), initial=0.0)),
              clip)
  return _Reference(pe, _clipped(pe, losses, clip), _clipped(pe2, losses2,
                                                             clip),
                    clip, scale)


RTOL = {"eager": 1e-4, "function": 1e-4, "jit": 1e-3}


def _judge(comp: str, mode: str, ref: _Reference, pe, cs, cs2, **kw):
  rtol = RTOL[mode]
  if pe is None:                       # graph and XLA: clipped sums only
    pe = ref.pe
  pe, cs, cs2 = (np.asarray(a, np.float64) for a in (pe, cs, cs2))
  bound = 2.0 * ref.clip
  influence = float(np.linalg.norm((cs - cs2).ravel()))
  tol_pe = rtol * max(ref.scale, 1e-12) + 64 * 1.2e-7 * ref.scale
  tol_cs = rtol * B * ref.clip + 64 * 1.2e-7 * B * ref.scale
  same_finite = np.array_equal(np.isfinite(pe), np.isfinite(ref.pe))
  with np.errstate(invalid="ignore"):
    exact = (same_finite and
             np.all(np.abs(np.nan_to_num(pe - ref.pe)) <= tol_pe) and
             np.all(np.abs(cs - ref.cs) <= tol_cs) and
             np.all(np.abs(cs2 - ref.cs2) <= tol_cs))
  leak = not math.isfinite(influence) or influence > bound * (1 + rtol) + (
      tol_cs)
  status = "leak" if leak else "exact" if exact else "inexact"
  err = ""
  if status == "inexact":
    err = (f"max |pe - ref| {np.nanmax(np.abs(pe - ref.pe)):.3g} "
           f"(tol {tol_pe:.2g}), |cs - ref| "
           f"{np.max(np.abs(cs - ref.cs)):.3g}, |cs' - ref'| "
           f"{np.max(np.abs(cs2 - ref.cs2)):.3g} (tol {tol_cs:.2g})")
  return Outcome(comp, mode, status, influence, bound, err, **kw)


def _error_outcome(comp, mode, err, model, d, **kw) -> Outcome:
  """A refusal, or an error that plain TensorFlow shares (unsupported), or a
  crash."""
  msg = f"{type(err).__name__}: {err}".splitlines()[0][:300]
  if isinstance(err, ValueError) and not isinstance(
      err, tf.errors.OpError):
    return Outcome(comp, mode, "refused" if "op '" in str(err) else
                   "bad_refusal", error=msg, **kw)
  try:
    _plain(model, d)
  except Exception as plain:  # noqa: BLE001  (the model itself is broken)
    return Outcome(comp, mode, "invalid", error=(
        f"plain TensorFlow fails eagerly too: {type(plain).__name__}: "
        f"{plain}").splitlines()[0][:300], **kw)
  if mode != "eager":
    try:
      tf.function(_plain_fn(model), jit_compile=(mode == "jit"),
                  autograph=False)(*d)
    except Exception:  # noqa: BLE001  (plain TF cannot run it in this mode)
      return Outcome(comp, mode, "unsupported", error=msg, **kw)
  return Outcome(comp, mode, "crash", error=msg + " | " + "".join(
      traceback.format_exception_only(type(err), err))[-300:], **kw)


def _plain_fn(model):
  def fn(x, ids, y):
    return _plain(model, (x, ids, y))
  return fn


@dataclasses.dataclass
class _Case:
  index: int
  comp: str
  model: Model
  seed: int
  data_seed: int
  ref: Optional[_Reference] = None
  ref_error: Optional[str] = None

  @property
  def kw(self):
    return dict(seed=self.seed, data_seed=self.data_seed)

  def take_reference(self, d, d2) -> None:
    """Computes the single-example reference, or keeps why it failed."""
    try:
      self.ref = reference(self.model, d, d2)
    except Exception as err:  # noqa: BLE001  (a generator bug)
      self.ref_error = f"{type(err).__name__}: {err}".splitlines()[0][:300]


class _Traced:
  """One model in one graph mode, traced on its own, once for a batch, and
  called on D and on D' with the clip norm as an input: a `tf.function` of
  its own, and under XLA that function called from a `jit_compile=True`
  step, as a compiled DP train step calls the model (XLA compiles the step
  with the function inlined: an op whose result is unused is pruned). A
  refusal is an error while it traces, judged then (the error, whose
  traceback holds the failed trace, is not kept): a refused model costs
  its failed trace, and nothing is compiled or run for it."""

  def __init__(self, case: _Case, mode: str, d):
    self.case, self.mode = case, mode
    self.refused: Optional[Outcome] = None
    self.concrete = None
    model = case.model
    spec = [tf.TensorSpec(t.shape, t.dtype) for t in d] + [
        tf.TensorSpec([], tf.float32)]
    fn = tf.function(
        lambda x, ids, y, clip: _pxg_sum(model, (x, ids, y), clip),
        autograph=False)
    if mode == "jit":
      inner = fn
      fn = tf.function(lambda x, ids, y, clip: inner(x, ids, y, clip),
                       jit_compile=True, autograph=False)
    try:
      self.concrete = fn.get_concrete_function(*spec)
    except Exception as err:  # noqa: BLE001  (a refusal, or a crash)
      self.refused = _error_outcome(case.comp, mode, err, model, d,
                                    **case.kw)

  @property
  def accepted(self) -> bool:
    return self.refused is None

  def outcome(self, d, d2) -> Outcome:
    """Calls the function on D and on D' (under XLA one compilation
    serves both: same function, same shapes) and judges it; a model XLA
    cannot compile fails alone."""
    c, mode = self.case, self.mode
    if self.refused is not None:
      return self.refused
    if c.ref is None:
      return Outcome(c.comp, mode, "invalid", error=c.ref_error, **c.kw)
    clip = tf.constant(c.ref.clip, tf.float32)
    try:
      cs = self.concrete(*d, clip).numpy()
      cs2 = self.concrete(*d2, clip).numpy()
    except Exception as err:  # noqa: BLE001  (when it runs or compiles)
      return _error_outcome(c.comp, mode, err, c.model, d, **c.kw)
    return _judge(c.comp, mode, c.ref, None, cs, cs2, **c.kw)


@contextlib.contextmanager
def _young_gc():
  """Python's cyclic collector scans only the objects made inside: those
  that existed before are frozen (`gc.freeze`) for the while, then what
  the models left (traced graphs hold cycles) is collected, and they are
  unfrozen. (A full collection otherwise walks every object of the
  process, several times per 50 models.) Nested uses, or a caller's own
  freeze, leave the collector as it is."""
  if gc.get_freeze_count():
    yield
    return
  gc.freeze()
  try:
    yield
  finally:
    gc.collect()
    gc.unfreeze()


def check_models(compositions: Sequence, modes: Sequence[str] = MODES,
                 data_seed: int = 0,
                 seeds: Optional[Sequence[int]] = None) -> List[Outcome]:
  """Judges each composition (a `Composition` or its string) in each mode;
  one `Outcome` per (model, mode), in the order of `compositions` and then
  `modes`. `seeds` are the models' kernel seeds (default 0).

  Order of work (each model still runs in every mode, and is traced on its
  own in each graph mode): eagerly up to `per_example_gradient` (a refusal
  comes before any clipping; the persistent tape is kept), then each
  model's `tf.function` and XLA function is traced (a refusal ends there);
  the reference runs only for the models some mode accepted, and only
  those go on (eagerly, on the kept tape) or are called with their clip
  norm."""
  with _young_gc():
    cases = []
    for j, comp in enumerate(compositions):
      seed = seeds[j] if seeds is not None else 0
      cases.append(_Case(j, str(comp), Model(Composition.parse(str(comp)),
                                             seed), seed, data_seed))
    return _check_cases(cases, modes)


def _check_cases(cases: Sequence[_Case],
                 modes: Sequence[str]) -> List[Outcome]:
  """`check_models` for cases that may differ in their data seed."""
  data = {ds: make_data(ds) for ds in sorted({c.data_seed for c in cases})}
  outcomes = {}
  eager_first = {}
  if "eager" in modes:
    with _timed("eager"):
      for c in cases:
        d = data[c.data_seed][0]
        try:
          eager_first[c.index] = _pxg_first(c.model, d)
        except Exception as err:  # noqa: BLE001
          outcomes[(c.index, "eager")] = _error_outcome(
              c.comp, "eager", err, c.model, d, **c.kw)
  traced = {}
  for m in modes:
    if m != "eager":
      with _timed(f"trace {m}"):
        traced[m] = [_Traced(c, m, data[c.data_seed][0]) for c in cases]
  with _timed("reference"):
    for k, c in enumerate(cases):
      wanted = c.index in eager_first or any(
          t[k].accepted for t in traced.values())
      if wanted:
        c.take_reference(*data[c.data_seed])
  with _timed("eager"):
    for c in cases:
      if c.index not in eager_first:
        continue
      if c.ref is None:
        outcomes[(c.index, "eager")] = Outcome(c.comp, "eager", "invalid",
                                               error=c.ref_error, **c.kw)
      else:
        outcomes[(c.index, "eager")] = _run_eager(
            c, eager_first.pop(c.index), data[c.data_seed][1])
  for m, ts in traced.items():
    with _timed(f"run {m}"):
      for t in ts:
        outcomes[(t.case.index, m)] = t.outcome(*data[t.case.data_seed])
  return [outcomes[(c.index, m)] for c in cases for m in modes]


# CPU seconds (`time.process_time`) spent per phase, summed over calls.
TIMINGS: Dict[str, float] = {}


class _timed:
  def __init__(self, name):
    self.name = name

  def __enter__(self):
    self.t0 = time.process_time()

  def __exit__(self, *exc):
    TIMINGS[self.name] = TIMINGS.get(self.name, 0.0) + (
        time.process_time() - self.t0)


def _run_eager(case: _Case, first, d2) -> Outcome:
  tape, losses, pe = first
  try:
    cs, cs2 = _pxg_rest(case.model, tape, losses, d2, case.ref.clip)
  except Exception as err:  # noqa: BLE001
    return _error_outcome(case.comp, "eager", err, case.model, d2, **case.kw)
  return _judge(case.comp, "eager", case.ref, pe.numpy(), cs.numpy(),
                cs2.numpy(), **case.kw)


def _unguarded(model: Model, d, d2, clip):
  """What an engine that trusted every op would compute: each example's
  row of the batch Jacobian (cross-example terms included) and the sums
  clipped with those rows, by plain TensorFlow."""
  def rows(data):
    model.reset_state()
    with tf.GradientTape(persistent=True) as tape:
      losses = model.losses(*data)
    jac = tape.jacobian(losses, model.w, experimental_use_pfor=False)
    return (tf.zeros([B, K, K]) if jac is None else jac).numpy(), (
        losses.numpy())
  pe, losses = rows(d)
  pe2, losses2 = rows(d2)
  return pe, _clipped(pe, losses, clip), _clipped(pe2, losses2, clip)


def unguarded(compositions: Sequence, data_seed: int = 0,
              seeds: Optional[Sequence[int]] = None) -> List[Outcome]:
  """The generator's teeth: each composition judged as if the engine had
  accepted it and followed the batch (the mode is reported as
  "unguarded"). A composition that mixes examples comes out `leak` or
  `inexact` here; one that keeps them apart comes out `exact`."""
  d, d2 = make_data(data_seed)
  out = []
  for j, comp in enumerate(compositions):
    seed = seeds[j] if seeds is not None else 0
    model = Model(Composition.parse(str(comp)), seed)
    kw = dict(seed=seed, data_seed=data_seed)
    try:
      ref = reference(model, d, d2)
      pe, cs, cs2 = _unguarded(model, d, d2, ref.clip)
    except Exception as err:  # noqa: BLE001
      out.append(Outcome(str(comp), "unguarded", "invalid",
                         error=f"{type(err).__name__}: {err}"[:300], **kw))
      continue
    o = _judge(str(comp), "eager", ref, pe, cs, cs2, **kw)
    o.mode = "unguarded"
    out.append(o)
  return out


def summarize(outcomes: Sequence[Outcome]) -> Dict[str, Dict[str, int]]:
  """Counts per mode and status."""
  table: Dict[str, Dict[str, int]] = {}
  for o in outcomes:
    row = table.setdefault(o.mode, {})
    row[o.status] = row.get(o.status, 0) + 1
  return table


def minimize(outcome: Outcome, budget: int = 40) -> Composition:
  """A smaller composition that fails the same way in the same mode:
  drops steps and turns feeds to `const` (then variants to 0) while the
  status stays."""
  comp = Composition.parse(outcome.composition)

  def fails(c):
    o = check_models([c], [outcome.mode], data_seed=outcome.data_seed,
                     seeds=[outcome.seed])[0]
    return o.status == outcome.status

  changed = True
  while changed and budget > 0:
    changed = False
    candidates = []
    for i, s in enumerate(comp.steps):
      if s is not PARAM:
        candidates.append(Composition(comp.steps[:i] + comp.steps[i + 1:]))
    for i, s in enumerate(comp.steps):
      for k, (p, src) in enumerate(s.feeds):
        if src != "const":
          feeds = s.feeds[:k] + ((p, "const"),) + s.feeds[k + 1:]
          candidates.append(Composition(
              comp.steps[:i] + (Step(s.op, s.variant, feeds),) +
              comp.steps[i + 1:]))
      if s is not PARAM and s.variant:
        candidates.append(Composition(
            comp.steps[:i] + (Step(s.op, 0, s.feeds),) + comp.steps[i + 1:]))
    for c in candidates:
      budget -= 1
      if fails(c):
        comp, changed = c, True
        break
      if budget <= 0:
        break
  return comp


def search(n: int, start: int = 0, modes: Sequence[str] = MODES,
           data_seeds: int = 4, block: int = 50, **gen_kw):
  """Generates and judges models `start .. start + n - 1` (the model seed
  is the composition's seed; data seeds cycle over `data_seeds`), `block`
  models at a time (what one block traced is freed before the next).
  Returns (outcomes, seconds), ordered by data seed, then model seed, then
  mode."""
  t0 = time.time()
  outcomes = []
  for first in range(start, start + n, block):
    seeds = sorted(range(first, min(first + block, start + n)),
                   key=lambda s: (s % data_seeds, s))
    with _young_gc():
      cases = []
      for k, s in enumerate(seeds):
        comp = str(generate(s, **gen_kw))
        cases.append(_Case(k, comp, Model(Composition.parse(comp), s), s,
                           s % data_seeds))
      outcomes += _check_cases(cases, modes)
  outcomes.sort(key=lambda o: (o.data_seed, o.seed))   # stable: modes
  return outcomes, time.time() - t0


if __name__ == "__main__":
  import argparse
  import json
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("-n", type=int, default=200)
  parser.add_argument("--start", type=int, default=0)
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--minimize", action="store_true")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  outs, secs = search(args.n, args.start, args.modes.split(","))
  print(json.dumps(summarize(outs), indent=1), f"{secs:.1f} s")
  for o in outs:
    if o.failed:
      line = o.describe()
      if args.minimize:
        line += f"\n    minimal: {minimize(o)!s}"
      print(line)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump([dataclasses.asdict(o) for o in outs], fh)
