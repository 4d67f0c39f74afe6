"""Merging the uses of one parameter into one interface (loops, tied weights).

A weight shared across the T steps of an unrolled recurrent loop (or a layer
called several times) reaches the engine as T interfaces, each with one row
per example. Its per-example gradient is the sum over uses, and its norm the
norm of that sum, so the uses cannot be handled one by one with the `sq_norm`
shortcut; materialising `T` per-example gradients of `[B, *weight]` and
adding them costs T times the weight-gradient matmul in memory traffic.

Instead, uses of the same parameter *value* by the same kind of op (same op
type, attributes and constant inputs, and the same non-batch shapes) are
merged into one interface whose data, outputs and output gradients hold, for
each example, the rows of all uses: `[B, k_1 + ... + k_T, ...]` reshaped to
`[B * K, ...]` (examples contiguous). For an op whose output rows of
example b depend only on example b's input rows (the contract of every
per-example rule) this merged op is exact, and its rule computes the sum over
uses at once: a contraction over all `K` rows (with the ghost norm over `K`
rows where that is cheaper, Li et al. 2022), one weighted-sum matmul.

Parameter values are compared structurally: reads of one variable handle,
and the same PARAM-only op (cast, split, reshape...) applied to equal
values, are the same value (common-subexpression keys).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, List

import numpy as np
import tensorflow as tf

from tf_pxg.interface.classify import Classifier, Interface
from tf_pxg.rules import base
from tf_pxg.tape.recording import Entry

# The uses of op types whose rule is `mergeable` (it acts row by row on its
# data, with no input that encodes the batch size, unlike
# Conv2DBackpropInput's `input_sizes`) are merged; those whose rule is also
# `chunked` (norms of a sum over chunks need no concatenation of the chunks'
# rows: contractions' `chunked_sq_norm`; elementwise rules' per-example
# gradients are parameter-sized and add up) are split into chunks of steps
# (`_CHUNKS` of them, from `_MIN_CHUNKED_USES` uses).
_CHUNKS = 4
_MIN_CHUNKED_USES = 8

_ALIASES = ("ReadVariableOp", "Identity")
_MAX_CONST_KEY = 256  # Elements; larger constants are keyed by identity.


def attrs_key(entry: Entry):
  """A hashable description of an entry's attributes."""
  if entry.attr_overrides:
    return (repr(sorted(entry.attr_overrides.items())),
            attrs_key(dataclasses.replace(entry, attr_overrides=None)))
  if entry.op is not None:
    return tuple(sorted(
        (k, v.SerializeToString()) for k, v in entry.op.node_def.attr.items()
        if not k.startswith("_")))
  return repr(entry.attrs)


def _static_key(t, tid):
  if getattr(t, "dtype", None) in (tf.resource, tf.variant):
    return ("t", tid)
  n = t.shape.num_elements() if t.shape.is_fully_defined() else None
  if n is None or n > _MAX_CONST_KEY:
    return ("t", tid)
  value = tf.get_static_value(t)
  if value is None:
    return ("t", tid)
  value = np.asarray(value)
  return ("v", value.dtype.str, value.shape, value.tobytes())


class ValueKeys:
  """Structural keys of PARAM tensors: equal keys mean equal values."""

  def __init__(self, producer, classifier: Classifier, source_ids):
    self._producer = producer
    self._classifier = classifier
    self._sources = set(source_ids)
    self._memo: Dict[int, tuple] = {}

  def __call__(self, tid: int):
    if tid not in self._memo:
      self._memo[tid] = self._key(tid)
    return self._memo[tid]

  def _key(self, tid: int):
    entry = self._producer.get(tid)
    if tid in self._sources or entry is None:
      return ("t", tid)
    if entry.op_type in _ALIASES and entry.inputs:
      return self(entry.input_ids[0])
    params = set(self._classifier.param_inputs(entry))
    ins = tuple(self(t) if i in params else _static_key(x, t)
                for i, (t, x) in enumerate(zip(entry.input_ids,
                                               entry.inputs)))
    return (entry.op_type, attrs_key(entry), ins,
            entry.output_ids.index(tid))


def _fully_defined_tail(t) -> bool:
  return t.shape.rank is not None and t.shape[1:].is_fully_defined()


def _group_key(itf: Interface, keys: ValueKeys):
  entry = itf.entry
  if (not itf.rule.mergeable or itf.batch_minor or itf.copy_axis is not None
      or itf.rule.batch_axes(itf) != (0, 0)):
    return None  # Rows are merged on axis 0 of the data and the outputs.
  data = set(itf.data_indices)
  tensors = [entry.inputs[i] for i in data] + list(entry.outputs)
  if not all(_fully_defined_tail(t) for t in tensors):
    return None
  if any(g is None for g in itf.output_grads):
    return None
  others = tuple(
      (i, _static_key(t, tid)) for i, (tid, t) in enumerate(
          zip(entry.input_ids, entry.inputs))
      if i not in data and i != itf.param_index)
  if any(k[1][0] == "t" and entry.inputs[k[0]].dtype != tf.resource
         for k in others):
    return None  # A non-constant operand other than the data: keep apart.
  shapes = tuple(tuple(t.shape[1:].as_list()) for t in tensors)
  return (keys(itf.param_id), entry.op_type, itf.param_index,
          itf.data_indices, attrs_key(entry), others, shapes, id(itf.rule))


def _rows(tensors: List, batch_size):
  """Concatenates each example's rows of every tensor: `[B * K, ...]`."""
  if len(tensors) == 1:
    return tensors[0]
  parts = [base.split_batch(t, batch_size) for t in tensors]
  merged = tf.concat(parts, axis=1)
  tail = merged.shape[2:].as_list()
  return tf.reshape(merged, [-1] + tail)


class _SharedRows:
  """`_rows`, built once per list of tensors.

  The weights of one recurrent cell (an LSTM's kernel, recurrent kernel and
  bias) meet the same output gradient at every step; their groups, in
  recording order, list the same T tensors, and one `[B * T, ...]`
  concatenation serves them all (each copy is as large as the step's whole
  output gradient, e.g. 8 MB for an LSTM(128) at B = T = 64).
  """

  def __init__(self, batch_size):
    self._batch_size = batch_size
    self._memo = {}

  def __call__(self, tensors: List):
    key = tuple(id(t) for t in tensors)
    if key not in self._memo:
      # The tensors are kept with the result, so their ids stay unique.
      self._memo[key] = (_rows(tensors, self._batch_size),
                         tensors)
    return self._memo[key][0]


def merge(interfaces: List[Interface], keys: ValueKeys,
          batch_size: Callable[[Interface], object]) -> List[Interface]:
  """Merges interfaces that use one parameter value the same way.

  Args:
    interfaces: the interfaces found by phase 1 (rules already chosen).
    keys: structural keys of PARAM tensors.
    batch_size: B for an interface (int or scalar tensor).

  Returns:
    The interfaces, each group of mergeable uses replaced by one interface
    (on the first use's parameter tensor) whose rows are all the uses'
    rows; or, for rules that are `chunked`, with at least `_MIN_CHUNKED_USES`
    uses, by `_CHUNKS` such interfaces over consecutive runs of the uses
    (recording order), sharing the first use's parameter tensor and a
    `chunk_set`. Chunks bound the memory of the rows: a concatenation holds
    its inputs and its result at once, which for one concatenation of all
    T steps' output gradients is twice their size at the end of the
    backward pass; per chunk, the inputs are freed chunk by chunk.
  """
  groups = collections.OrderedDict()
  for itf in interfaces:
    key = _group_key(itf, keys)
    groups.setdefault(key if key is not None else ("single", id(itf)),
                      []).append(itf)
  out = []
  shared = {}
  for key, group in groups.items():
    if len(group) == 1:
      out.append(group[0])
      continue
    # Recording order: groups over the same steps list them alike, so
    # their equal row lists are concatenated once (`_SharedRows`).
    group = sorted(group, key=lambda u: u.entry.index)
    b = batch_size(group[0])
    rows = shared.setdefault(id(b) if tf.is_tensor(b) else b,
                             _SharedRows(b))
    if len(group) < _MIN_CHUNKED_USES or not group[0].rule.chunked:
      out.append(_merged(group, rows))
      continue
    for piece in np.array_split(np.arange(len(group)), _CHUNKS):
      out.append(_merged([group[i] for i in piece], rows, head=group[0],
                         chunk_set=key))
  return out


def _merged(group: List[Interface], rows: "_SharedRows", head=None,
            chunk_set=None) -> Interface:
  """One interface whose rows are all the rows of `group`'s uses, on the
  parameter tensor of `head` (default: the first use), so that the chunks
  of one group have one parameter id."""
  first = group[0]
  head = head or first
  inputs = list(head.entry.inputs)
  for i in first.data_indices:
    inputs[i] = rows([u.entry.inputs[i] for u in group])
  outputs = [rows([u.entry.outputs[j] for u in group])
             for j in range(len(first.entry.outputs))]
  grads = [rows([u.output_grads[j] for u in group])
           for j in range(len(first.output_grads))]
  e = head.entry
  entry = Entry(e.op_type, tuple(inputs), tuple(outputs), e.attrs, e.op,
                e.scope, first.entry.index, attr_overrides=e.attr_overrides)
  return Interface(entry, head.param_index, grads, head.data_indices,
                   False, head.rule,
                   original_param_id=head.original_param_id,
                   original_param_shape=head.original_param_shape,
                   chunk_set=chunk_set)
