"""Participation schemas: what a sampler gives, what a mechanism needs, and
the one check between them.

A noise mechanism's ε is stated for a participation schema: how often, and
at which steps, one privacy unit can enter the run.

- Independent Gaussian noise (DP-SGD) composes one event per step and
  holds for any schema the sampler accounts for itself.
- BandMF and BLT correlated noise state their ε for **b-min-separation**
  participation on a fixed cycle (Choquette-Choo et al. 2023, "Amplified
  banded matrix factorization"): each unit joins only steps `g mod b` of
  its group g, so two of its participations are at least b steps apart.
  b is `min_separation`, on the mechanism (what its ε needs) and on the
  sampler (what its batches give).
- A mechanism whose `dp_event` is already the event of the whole run
  (`whole_run_event`, BLT) is not composed over steps: the sampler must be
  one that takes such an event as it is (cyclic Poisson sampling does;
  balls-in-bins composes one event per epoch, so it does not).

A sampler states its schema as a `Participation` (`sampler.participation`
for an instance, `SamplerClass.schema` for the class, where a
`min_separation` of None means "whatever the config asks for"), a mechanism
states what it needs by its `min_separation` and `whole_run_event`, and
`check` refuses a mismatch, in one place, before any step: so a sampler
that ignores the cyclic groups it is given cannot report BandMF's ε. A
sampler that states cyclic groups but selects its steps itself
(`step_indices`) is drawn for its first cycle here and refused if a step
takes an example outside the step's group; and the stream draws every
later step through `guarded_selection` (each call checks, in TF ops, that
the drawn indices belong to group `step mod b`, and fails the step that
strays before its batch reaches training: one gather and one compare per
step; `tf_pxg.data.sampling_ops.index_stream` uses it). So a selection that follows the groups in the first
cycle and not afterwards is refused at the first step that leaves them.
(The built-in cyclic selection is tested where it is defined.)

Imports nothing of tf_pxg: it reads the sampler and the mechanism by their
protocols (`tf_pxg.data.samplers.Sampler`,
`tf_pxg.dp.mechanisms.NoiseMechanism`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["Participation", "ParticipationError", "check", "of"]


class ParticipationError(ValueError):
  """A sampler's participation schema does not fit a mechanism's ε."""


@dataclasses.dataclass(frozen=True)
class Participation:
  """How a sampler lets one privacy unit into the steps of a run.

  Attributes:
    kind: a short name for messages: "poisson" (cyclic when
      `min_separation` > 1), "balls in bins", "shuffled", or a new
      sampler's own.
    min_separation: b: a unit joins only steps `g mod b` of its group g
      (1: any step). None: not fixed yet (a sampler class whose config
      sets it, `PoissonSampler`).
    certified: whether the sampler's `dp_event` is a guarantee (False:
      Keras' shuffled batches; nothing is claimed, so only the
      `min_separation` a mechanism needs is checked).
    whole_run_events: whether the sampler's `dp_event` takes a mechanism
      whose event is the whole run's (`whole_run_event`) as it is.
    sampling_rate: q, for messages (None: none, or not known yet).
    note: what the sampler's own ε takes, for messages (e.g. balls in
      bins: "a per-step mechanism without cyclic participation").
  """
  kind: str
  min_separation: Optional[int] = 1
  certified: bool = True
  whole_run_events: bool = False
  sampling_rate: Optional[float] = None
  note: str = ""

  @classmethod
  def poisson(cls, sampling_rate: Optional[float] = None,
              min_separation: Optional[int] = 1) -> "Participation":
    """(Cyclic) Poisson sampling at rate q (`tf_pxg.data.PoissonSampler`):
    takes whole-run events (`tf_pxg.accounting.cyclic_poisson_event`)."""
    return cls("poisson", min_separation, True, True, sampling_rate)

  def describe(self) -> str:
    """E.g. "poisson participation (min_separation=4, the old
    num_groups=4, q=0.1)"."""
    # The old name too while its deprecated aliases exist (users know it).
    parts = [f"min_separation={self.min_separation}, the old "
             f"num_groups={self.min_separation}"
             if self.min_separation is not None else
             "min_separation set by its config"]
    if self.sampling_rate is not None:
      parts.append(f"q={self.sampling_rate:.6g}")
    if not self.certified:
      parts.append("no certified ε")
    return f"{self.kind} participation ({', '.join(parts)})"


def of(sampler_or_class) -> Participation:
  """The schema of a sampler instance (`participation`) or class
  (`schema`)."""
  if isinstance(sampler_or_class, type):
    return sampler_or_class.schema
  return sampler_or_class.participation


def _name(sampler_or_class) -> str:
  if isinstance(sampler_or_class, type):
    return sampler_or_class.__name__
  return f"<{type(sampler_or_class).__name__} instance>"


def _note(schema: Participation) -> str:
  return f"; {schema.note}" if schema.note else ""


def check(sampler_or_class, mechanism, where: str) -> Participation:
  """Refuses a sampler whose participation does not fit `mechanism`'s ε.

  Rules (module docstring): the sampler's `min_separation` must be the
  mechanism's (unless the sampler class leaves it to its config); a
  mechanism with a whole-run event needs a certified sampler that takes
  one (`whole_run_events`); an instance with b > 1 and its own
  `step_indices` must draw each of its first b steps from that step's
  group. An uncertified sampler (shuffled batches)
  claims no ε, so only the first rule applies to it.

  Args:
    sampler_or_class: a `tf_pxg.data.samplers.Sampler` instance or class.
    mechanism: a `tf_pxg.dp.mechanisms.NoiseMechanism` (what it reads:
      `min_separation`, `whole_run_event`).
    where: the caller, for the message (e.g. "DPPlan", "fit").

  Returns:
    The sampler's `Participation`.

  Raises:
    ParticipationError (a ValueError): naming the sampler, the mechanism,
      what each states, and the fix.
  """
  schema = of(sampler_or_class)
  if not isinstance(sampler_or_class, type):
    _check_selection(sampler_or_class, where)
  need = int(mechanism.min_separation)
  whole = bool(mechanism.whole_run_event)
  name = _name(sampler_or_class)
  if schema.min_separation is not None and schema.min_separation != need:
    if need > 1:
      fix = (f"Use sampling='poisson' (fit then samples cyclic Poisson "
             f"with min_separation={need}), or a sampler built with "
             f"min_separation={need}.")
    else:
      fix = ("Use a sampler with min_separation=1, or a mechanism whose ε "
             f"is stated for min_separation={schema.min_separation}.")
    needs = (f"needs cyclic Poisson sampling with min_separation={need} "
             f"(each unit joins only steps g mod {need} of its group g)"
             if need > 1 else "states its ε for min_separation=1")
    raise ParticipationError(
        f"{where}: the sampler {name} gives {schema.describe()}{_note(schema)}"
        f", but the noise mechanism {mechanism!r} {needs}. {fix}")
  if whole and schema.certified and not schema.whole_run_events:
    raise ParticipationError(
        f"{where}: the noise mechanism {mechanism!r} states one event for "
        f"the whole run, which the sampler {name} ({schema.describe()}"
        f"{_note(schema)}) would compose over its steps or epochs. Use "
        "sampling='poisson' for it.")
  return schema


def _check_selection(sampler, where: str) -> None:
  """Draws the first b steps of a sampler with b > 1 groups and its own
  selection (`step_indices`, eagerly), and refuses it if a step takes an
  example outside group `step mod b` (`sampler.group_index`)."""
  b = int(sampler.min_separation)
  if b <= 1 or sampler.step_indices is None:
    return
  import tensorflow as tf  # noqa: PLC0415  (only for such samplers)
  groups = sampler.group_index.assignment()
  for step in range(b):
    key = tf.constant([0, step], tf.int64)
    drawn = np.asarray(sampler.step_indices(tf.constant(step, tf.int64),
                                            key), np.int64)
    outside = drawn[groups[drawn] != step % b]
    if outside.size:
      raise ParticipationError(
          f"{where}: the sampler <{type(sampler).__name__} instance> states "
          f"cyclic participation with min_separation={b}, but its "
          f"step_indices drew example {int(outside[0])} (group "
          f"{int(groups[outside[0]])}) at step {step}, which samples only "
          f"group {step % b}. Its ε would not hold: make step_indices draw "
          "step s from group s mod b only (sampler.group_index), or state "
          "the participation it has (schema).")


def guarded_selection(sampler, where: str):
  """The sampler's own selection (`step_indices`), checked at every step
  of every cycle when it states b > 1 cyclic groups (module docstring);
  else `step_indices` as it is (None: the built-in selection).

  The check is data-independent (it reads the sampler's indices and the
  group assignment, never the data) and raises `tf.errors.
  InvalidArgumentError` from the input pipeline at the step that strays,
  naming the sampler, the step, the example, its group and the fix.
  """
  select = sampler.step_indices
  b = int(sampler.min_separation)
  if b <= 1 or select is None:
    return select
  import tensorflow as tf  # noqa: PLC0415  (only for such samplers)
  groups = tf.constant(sampler.group_index.assignment(), tf.int64)
  name = type(sampler).__name__

  def guarded(step, key=None):
    drawn = select(step, key)
    indices = tf.cast(drawn, tf.int64)
    group = tf.math.floormod(tf.cast(step, tf.int64), b)
    outside = tf.not_equal(tf.gather(groups, indices), group)
    first = tf.gather(indices, tf.argmax(tf.cast(outside, tf.int32)))
    check = tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(outside)),
        [f"{where}: the sampler <{name} instance> states cyclic "
         f"participation with min_separation={b}, but its step_indices "
         "drew example", first, "of group",
         tf.gather(groups, first), "at step", step, "which samples only "
         "group", group, ". Its ε would not hold: make step_indices draw "
         "step s from group s mod b only (sampler.group_index), in every "
         "cycle, or state the participation it has (schema)."],
        summarize=8)
    with tf.control_dependencies([check]):
      return tf.identity(drawn)

  return guarded
