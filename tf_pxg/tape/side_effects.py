"""What the recorded forward pass computed from the data, besides the loss.

DP-SGD releases the data only through the clipped, noised gradient sum. A
forward pass can also carry the data out another way: an op that *writes*
state (a variable assignment such as a running statistic's, a scatter
update, a stateful RNN's carried state, a summary write) keeps a value that
is saved with the model, checkpointed or logged, un-clipped and un-noised.
Such ops have no outputs, so they are on no path to the loss and the
backward pass never sees them; the recorder keeps them apart
(`Recorder.writes`), and this module decides which of them depend on the
data.

**Data dependence** is forward reachability over the recording: a tensor
depends on the data if it is one of the data tensors (the step's inputs,
labels and weights) or an output of a recorded op with such an input. The
recording is in topological order (ops are recorded as they run or are
built), so one pass decides it. A variable's value read back after a
data-dependent write is not followed: that write is refused first. Writes
whose value is data-independent (a step counter, a seed generator's state)
are allowed.

The privacy argument (invariant 4 of docs/design.md's guarantee): a write
whose value depends on the data stores, for every step it runs, a function
of the batch that is neither clipped per example nor noised; the saved
variable then reveals, e.g., whether one example was sampled (a shift of one
of 32 examples by 100 moves a running mean by 100 * 0.1 / 32). Refusing it
before any update leaves only the noised sum as the data's way out.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence

# Op types (or prefixes) that write state and have no outputs.
_WRITE_PREFIXES = ("Assign", "ResourceScatter", "ResourceStridedSliceAssign",
                   "ResourceApply", "ResourceSparseApply", "Write",
                   "TensorSummary", "ScalarSummary")


def is_write(op_type: str) -> bool:
  """Whether an op of `op_type` (with no outputs) writes state."""
  return op_type.startswith(_WRITE_PREFIXES)


def data_dependent_ids(entries: Sequence, seed_ids: Iterable[int]) -> set:
  """Ids of the recorded tensors that depend on the `seed_ids` tensors.

  Args:
    entries: `recording.Entry` objects in recording (topological) order.
    seed_ids: `recording.tensor_id` of the data tensors.

  Returns:
    The seed ids and every output id of an entry with a dependent input.
  """
  dependent = set(seed_ids)
  for entry in entries:
    if any(i in dependent for i in entry.input_ids):
      dependent.update(entry.output_ids)
  return dependent


def data_dependent_writes(writes: Sequence, dependent: set) -> List:
  """The write entries whose written value (any input but the resource
  handle, input 0) depends on the data."""
  return [w for w in writes
          if any(i in dependent for i in w.input_ids[1:])]
