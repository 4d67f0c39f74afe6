"""Backpropagation over a recorded tape: a Python port of TF's `imperative_grad`.

The algorithm is the seed's (`tensorflow/python/eager/imperative_grad.py`):

1. filter the tape to the entries between the targets and the sources,
   counting how many filtered entries use each tensor and how many of each
   entry's outputs still wait for gradients;
2. start a stack with the entries whose outputs need nothing more;
3. pop an entry, call its backward function, add the results into its
   inputs' gradient lists; an input whose usages are all done may make its
   producer ready. An entry none of whose outputs received a gradient gives
   its inputs none either, without running (as TF's C++ tape does).

Our additions are parameters, not a different algorithm: `backward` is the
per-entry backward function (the per-example engine wraps TF's to stop at the
interface), `stop_ids` are tensors not to look through (sources, and for the
per-example engine the parameter-only region), and `initial_gradients` may
seed tensors that are also used inside the filtered tape.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence

import tensorflow as tf

from tf_pxg.backprop import gradient_functions
from tf_pxg.tape.recording import Entry

# If over MIN_AGGREGATE_COUNT gradients are accumulated and the total memory
# consumption is over MIN_AGGREGATE_BYTES, aggregate early to free memory.
_MIN_AGGREGATE_COUNT = 4
_MIN_AGGREGATE_BYTES = 128 * 1024 * 1024

Backward = Callable[[Entry, List[Any], List[int]], List[Any]]


def prepare_backprop(target_ids: Iterable[int], producer: Mapping[int, Entry],
                     stop_ids: Iterable[int]):
  """Filters the tape to the entries on paths from the targets to the sources.

  Walks back from the targets without looking through `stop_ids` (the
  sources). Unlike TF's C++ tape, our recorder keeps every op run while it is
  active, so entries that do not depend on any source (label preprocessing,
  say) are pruned here: TF never records them in the first place.

  Returns:
    (tensor_usage_counts, entries, op_missing_tensor): how many filtered
    entries use each source-dependent tensor; the filtered entries keyed by
    `id(entry)`; per entry, how many of its used outputs still lack a complete
    gradient.
  """
  stop_ids = set(stop_ids)
  tensor_stack = list(target_ids)
  found: Dict[int, Entry] = {}
  seen = set()
  while tensor_stack:
    t = tensor_stack.pop()
    if t in seen or t in stop_ids:
      continue
    seen.add(t)
    entry = producer.get(t)
    if entry is None or id(entry) in found:
      continue
    found[id(entry)] = entry
    tensor_stack.extend(entry.input_ids)
  dependent = set(stop_ids)
  entries: Dict[int, Entry] = {}
  for entry in sorted(found.values(), key=lambda e: e.index):
    if any(t in dependent for t in entry.input_ids):
      entries[id(entry)] = entry
      dependent.update(entry.output_ids)
  usage: Dict[int, int] = collections.defaultdict(int)
  for entry in entries.values():
    for t in entry.input_ids:
      if t in dependent:
        usage[t] += 1
  missing: Dict[int, int] = collections.defaultdict(int)
  for t in usage:
    entry = producer.get(t)
    if entry is not None and id(entry) in entries and t not in stop_ids:
      missing[id(entry)] += 1
  return usage, entries, missing, dependent


class _ZerosCache:
  """Zeros for missing output gradients, reusing the last (shape, dtype)."""

  def __init__(self):
    self._key = None
    self._zeros = None

  def __call__(self, like):
    if like.dtype in (tf.resource, tf.variant, tf.string):
      return None
    shape = like.shape
    if shape.is_fully_defined():
      key = (tuple(shape.as_list()), like.dtype)
      if key != self._key:
        self._key, self._zeros = key, tf.zeros(shape, like.dtype)
      return self._zeros
    return tf.zeros_like(like)


def imperative_grad(producer: Mapping[int, Entry],
                    initial_gradients: Mapping[int, Sequence[Any]],
                    stop_ids: Iterable[int],
                    backward: Backward,
                    zeros_like: Callable[[Any], Any] = None,
                    aggregate: Callable[[Sequence[Any]], Any] = (
                        gradient_functions.aggregate),
                    ) -> Dict[int, Any]:
  """Backpropagates `initial_gradients` through the recorded entries.

  Args:
    producer: map from tensor id to the entry that produced it.
    initial_gradients: map from a target's tensor id to its output gradients.
    stop_ids: tensor ids not to look through (their gradient is collected).
    backward: `backward(entry, out_grads, skip) -> in_grads`; `skip` lists
      the inputs that do not depend on any source (their gradient is unused).
    zeros_like: builds the gradient for an output nobody used; defaults to a
      cached `tf.zeros`.
    aggregate: sums a list of gradients for one tensor.

  Returns:
    Map from tensor id to its aggregated gradient for every stop id (and any
    other tensor outside the filtered tape) that received one.
  """
  stop_ids = set(stop_ids)
  zeros_like = zeros_like or _ZerosCache()
  usage, entries, missing, dependent = prepare_backprop(
      initial_gradients, producer, stop_ids)
  ready = [e for k, e in entries.items() if k not in missing]
  gradients = collections.defaultdict(list)
  for t, gs in initial_gradients.items():
    gradients[t].extend(g for g in gs if g is not None)
  gradients_size: Dict[int, int] = {}
  while ready:
    entry = ready.pop()
    del entries[id(entry)]
    out_grads = [gradients.pop(t, None) for t in entry.output_ids]
    if not any(out_grads):
      # As TF's C++ tape: no output gradient at all means no input gradient,
      # without calling the backward function or building zeros.
      in_grads = [None] * len(entry.inputs)
    else:
      none_ok = gradient_functions.GRAD_FN_ACCEPTS_NONE_FOR_INDICES.get(
          entry.op_type, ())
      for i, g in enumerate(out_grads):
        if g:
          out_grads[i] = aggregate(g)
        elif i not in none_ok:
          out_grads[i] = zeros_like(entry.outputs[i])
        else:
          out_grads[i] = None
      skip = [i for i, t in enumerate(entry.input_ids) if t not in dependent]
      in_grads = backward(entry, out_grads, skip)
    for i, t in enumerate(entry.input_ids):
      if in_grads[i] is not None:
        t_grads = gradients[t]
        t_grads.append(in_grads[i])
        if len(t_grads) >= _MIN_AGGREGATE_COUNT:
          if t not in gradients_size:
            gradients_size[t] = gradient_functions.num_elements(t_grads[-1])
          if len(t_grads) * gradients_size[t] * 4 > _MIN_AGGREGATE_BYTES:
            t_grads[:] = [aggregate(t_grads)]
      if usage.get(t, 0) > 0:
        usage[t] -= 1
        in_entry = producer.get(t)
        if (usage[t] == 0 and in_entry is not None and t not in stop_ids and
            missing.get(id(in_entry), 0) > 0):
          missing[id(in_entry)] -= 1
          if missing[id(in_entry)] == 0:
            ready.append(in_entry)
  return {t: aggregate(g) for t, g in gradients.items() if g}
