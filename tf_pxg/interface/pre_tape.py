"""Eagerly, values computed from the examples before the tape started.

Inside `tf.function` the classifier walks the graph behind every tensor the
tape consumes, so a statistic of the batch computed before the tape, or a
variable assigned from one (`tf_pxg.interface.written_state`), is seen for
what it is. Eagerly there is no graph: a tensor the tape did not see being
made is judged by its shape alone (`Classifier._external`), and a batch
maximum computed before the tape is a scalar like any literal.

The examples, declared to the tape (`tf_pxg.GradientTape(examples=...)`),
close that gap by time instead of ancestry. TF numbers eager tensors from
one increasing counter (`tf_pxg._compat.next_tensor_id`). A tensor numbered
after the earliest example and before the tape started, that is not an
example itself, was made while the examples existed and outside the
record: the tape cannot prove it does not depend on them, so it is
refused (refuse what is not proven safe). Literals the step needs can be
made before the examples, or inside the tape (recorded, or converted
while recording: numbered after the tape started). What this does not
see is state: a variable assigned from the examples in that window keeps
its old handle (docs/threat_model.md "Provenance", not covered).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import tensorflow as tf

from tf_pxg.tape.recording import Entry, tensor_id

_STATE_DTYPES = (tf.resource, tf.variant)


class ExampleWindow:
  """The examples declared to an eager tape, and the ids between them and
  the tape's start.

  Args:
    examples: a nest of tensors (eager; composite tensors are expanded to
      their components). Symbolic tensors are ignored: in a graph the
      classifier sees their ancestry.
  """

  def __init__(self, examples):
    flat = tf.nest.flatten(examples, expand_composites=True)
    self.ids = {tensor_id(t) for t in flat
                if isinstance(t, tf.Tensor) and not tf.is_symbolic_tensor(t)}
    self.first: Optional[int] = min(self.ids) if self.ids else None

  def made_outside(self, t, start_uid: Optional[int]) -> bool:
    """Whether eager tensor `t` was made after the first example and before
    the tape started, and is no example."""
    if self.first is None or start_uid is None or tf.is_symbolic_tensor(t):
      return False
    if t.dtype in _STATE_DTYPES:
      return False
    tid = tensor_id(t)
    return self.first < tid < start_uid and tid not in self.ids


def check_no_pre_tape_values(entries: Sequence[Entry], recorded: Iterable[int],
                             window: Optional[ExampleWindow],
                             start_uid: Optional[int]) -> None:
  """Raises if a recorded op consumed an eager tensor made outside the
  record while the declared examples existed (`ExampleWindow`).

  Args:
    entries: the recorded ops.
    recorded: ids of the tensors the recorded ops made.
    window: the tape's declared examples, or None (nothing to check).
    start_uid: the tensor id counter when the tape first started.

  Raises:
    ValueError: naming the op that consumed such a tensor.
  """
  if window is None or window.first is None:
    return
  recorded = set(recorded)
  for entry in entries:
    for i, (tid, t) in enumerate(zip(entry.input_ids, entry.inputs)):
      if tid in recorded or not window.made_outside(t, start_uid):
        continue
      raise ValueError(
          f"{entry.describe()} takes, at input {i}, a tensor of shape "
          f"{t.shape.as_list()} and dtype {t.dtype.name} that was computed "
          "after the examples given to the tape and before it started "
          "recording. Eagerly, the tape cannot see how it was computed, so "
          "it cannot prove it does not depend on the examples (a batch "
          "statistic computed before the tape mixes every example into "
          "each one's gradient: no DP guarantee). Compute it inside the "
          "tape, or, if it is a constant, make it before the examples.")
