"""How `check_example_independence` changes one example of a batch.

Two kinds of change:

* the explicit ones, `"perturb"` and `"swap"` (and a user's callable, which
  `independence.py` calls itself);
* the default search (`"search"`), which needs no outlier planted by the
  user: it changes a few chosen examples in several directions each, so
  that a batch statistic at any argument of any op (a depth, a slice bound,
  a condition, a size, a seed, a write into state, a row partition) moves
  whichever way it counts:

  - `perturb`: Gaussian noise on floats (scaled to the batch), integer,
    boolean and string rows swapped in;
  - `swap`: another example's rows;
  - `high`: floats `+100 * max|x|`, integers the largest id the model
    accepts (the largest `Embedding.input_dim - 1` / `num_tokens - 1` when
    the model has such layers, else one above the batch's largest, falling
    back to the batch's largest if the model refuses it), booleans True,
    every position (so a padded sequence becomes full length);
  - `low`: floats `-100 * max|x|`, integers id 1 at every position (full
    length, smallest non-padding id), booleans False;
  - `zeros`: zeros everywhere (an empty, all-padding sequence).

  Labels move in the same direction (integer labels within the model's
  classes when its output shows them). The examples changed are example 0
  and the ones holding the batch's extremes (the largest value, the longest
  sequence, the smallest value): changing the holder of a batch maximum
  down moves the maximum, changing any other up moves it too.
"""

from __future__ import annotations

from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_pxg import _compat

CHANGES = ("search", "perturb", "swap")
DIRECTIONS = ("perturb", "swap", "high", "low", "zeros")
MAX_SEARCH_INDICES = 3
_EXTREME = 100.0  # "high"/"low": this many times the leaf's largest |value|


class Change(NamedTuple):
  """One changed batch: example `index` changed `direction`-wise."""
  index: int
  source: int
  direction: str
  x: Any
  y: Any
  changed: bool  # whether the batch differs from the unchanged one


class IdRanges(NamedTuple):
  """Candidate "high" ids, tried in order until the model accepts one:
  for the inputs and the labels. None: one above the batch's largest
  value, then the largest; (): the batch's largest."""
  inputs: Optional[Tuple[int, ...]]
  labels: Optional[Tuple[int, ...]]


def _leaf(t, b_total: int, what: str) -> np.ndarray:
  t = tf.convert_to_tensor(t)
  if t.shape.rank == 0 or t.shape[0] != b_total:
    raise ValueError(
        f"Every tensor of `{what}` must have the batch ({b_total} examples) "
        f"on axis 0; got shape {t.shape}.")
  return t.numpy()


def _perturbed(a: np.ndarray, index: int, rng: np.random.Generator):
  """Example `index` of float `a` plus Gaussian noise of the batch's std."""
  wide = a.astype(np.float64)
  finite = wide[np.isfinite(wide)]
  scale = float(np.std(finite)) if finite.size else 0.0
  if not scale > 0:
    scale = float(np.max(np.abs(finite))) if finite.size else 0.0
  if not scale > 0:
    scale = 1.0
  wide[index] = wide[index] + scale * rng.standard_normal(a.shape[1:])
  return wide.astype(a.dtype)


def _extreme(a: np.ndarray) -> float:
  finite = a[np.isfinite(a)].astype(np.float64)
  top = float(np.max(np.abs(finite))) if finite.size else 0.0
  value = _EXTREME * (top if top > 0 else 1.0)
  if a.dtype == np.float16:
    value = min(value, 1e3)
  return value


def _high_id(a: np.ndarray, highs: Optional[Tuple[int, ...]],
             variant: int) -> Optional[int]:
  """The `variant`-th candidate "high" id for integer leaf `a` (None: no
  more candidates)."""
  top = int(np.max(a)) if a.size else 0
  if highs is None:  # unknown: one above the batch's largest, or it
    candidates = [top + 1, top]
  else:
    candidates = list(highs) or [top]  # (): the batch's largest
  limit = int(np.iinfo(a.dtype).max)
  candidates = list(dict.fromkeys(min(c, limit) for c in candidates
                                  if c >= 0))
  return candidates[variant] if variant < len(candidates) else None


def _changed_leaf(a: np.ndarray, index: int, source: int, direction: str,
                  rng: np.random.Generator, highs, variant: int):
  """`a` with row `index` changed (None: no such variant)."""
  new = a.copy()
  kind = a.dtype.kind
  if direction == "swap" or (direction == "perturb" and kind != "f"):
    new[index] = a[source]
  elif direction == "perturb":
    return _perturbed(a, index, rng)
  elif kind == "f":
    new[index] = {"high": _extreme(a), "low": -_extreme(a),
                  "zeros": 0.0}[direction]
  elif kind == "b":
    new[index] = direction == "high"
  elif kind in "iu":
    if direction == "high":
      value = _high_id(a, highs, variant)
      if value is None:
        return None
    else:
      value = 1 if direction == "low" and int(np.max(a)) >= 1 else 0
    new[index] = value
  return new  # strings: unchanged except by swap / perturb


def change_batch(nest, index: int, source: int, direction: str,
                 rng: np.random.Generator, b_total: int, what: str,
                 highs=None, variant: int = 0):
  """`(new nest of tensors, whether anything changed)`, or `(None, False)`
  when the direction has no `variant`-th form."""
  if nest is None:
    return None, False
  leaves = [_leaf(t, b_total, what) for t in tf.nest.flatten(nest)]
  new = [_changed_leaf(a, index, source, direction, rng, highs, variant)
         for a in leaves]
  if any(n is None for n in new):
    return None, False
  changed = any(not np.array_equal(n, a) for n, a in zip(new, leaves))
  return tf.nest.pack_sequence_as(
      nest, [tf.constant(n, dtype=a.dtype) for n, a in zip(new, leaves)]
  ), changed


def _layer_sizes(model) -> List[int]:
  """The id ranges the model's id layers accept (Embedding's input_dim,
  CategoryEncoding's num_tokens)."""
  sizes = []
  for layer in _compat.flatten_layers(model, include_self=True):
    for name in ("input_dim", "num_tokens"):
      size = getattr(layer, name, None)
      if isinstance(size, (int, np.integer)) and size > 1:
        sizes.append(int(size))
  return sizes


def _classes(model) -> Optional[int]:
  try:
    shape = model.output_shape
  except (AttributeError, ValueError, RuntimeError):
    return None
  if isinstance(shape, tuple) and shape and isinstance(shape[-1], int):
    return shape[-1] if shape[-1] > 1 else None
  return None


def id_ranges(model) -> IdRanges:
  sizes = _layer_sizes(model)
  inputs = tuple(dict.fromkeys([max(sizes) - 1, min(sizes) - 1])) if (
      sizes) else None
  classes = _classes(model)
  return IdRanges(inputs, (classes - 1,) if classes else ())


def _per_example(a: np.ndarray, reduce) -> Optional[np.ndarray]:
  if a.dtype.kind not in "fiub" or a.size == 0:
    return None
  rows = np.reshape(a.astype(np.float64), [a.shape[0], -1])
  rows = np.where(np.isfinite(rows), rows, 0.0)
  return reduce(rows, axis=1)


def search_indices(x, y, b_total: int) -> Tuple[int, ...]:
  """Example 0 and the holders of the batch's extremes (the largest value,
  the most non-zero entries, the smallest value; of the inputs, then of
  the labels), at most `MAX_SEARCH_INDICES`; at least two (the last
  example if need be)."""
  picks = [0]
  leaves = [np.asarray(tf.convert_to_tensor(t)) for t in
            tf.nest.flatten(x) + ([] if y is None else tf.nest.flatten(y))]
  for reduce in (np.max, np.count_nonzero, np.min):
    for a in leaves:
      stat = _per_example(a, reduce)
      if stat is not None:
        pick = int(np.argmin(stat) if reduce is np.min else np.argmax(stat))
        picks.append(pick)
  # At least two examples: the last one when the extremes are example 0's.
  picks.append(b_total - 1)
  picks = tuple(dict.fromkeys(picks))
  return picks[:max(2, min(MAX_SEARCH_INDICES, len(picks) - 1))]


def search_changes(x, y, indices: Sequence[int], source: Optional[int],
                   b_total: int, rng: np.random.Generator, ranges: IdRanges,
                   change_labels: bool) -> Iterator[Tuple[int, str, list]]:
  """For each example and direction: `(index, direction, variants)`, the
  variants being the changed batches to try in order (the first that the
  model runs is used); changes that leave the batch as it was, or repeat
  one already made for the example, are dropped."""
  for i in indices:
    j = (i + 1) % b_total if source is None else int(source)
    seen = []
    for direction in DIRECTIONS:
      variants = []
      for variant in range(2 if direction == "high" else 1):
        x1, x_changed = change_batch(x, i, j, direction, rng, b_total, "x",
                                     ranges.inputs, variant)
        if x1 is None:
          break
        y1, y_changed = (change_batch(y, i, j, direction, rng, b_total, "y",
                                      ranges.labels, min(variant, 0))
                         if change_labels and y is not None else (y, False))
        if not (x_changed or y_changed) or any(
            _same(x1, y1, *old) for old in seen):
          continue
        seen.append((x1, y1))
        variants.append(Change(i, j, direction, x1, y1, True))
      if variants:
        yield i, direction, variants


def _same(x1, y1, x2, y2) -> bool:
  a = tf.nest.flatten(x1) + ([] if y1 is None else tf.nest.flatten(y1))
  b = tf.nest.flatten(x2) + ([] if y2 is None else tf.nest.flatten(y2))
  return all(np.array_equal(np.asarray(u), np.asarray(v))
             for u, v in zip(a, b))


def describe(change: Change, x) -> str:
  """`"high"` with what it set, e.g. `"high: example 2 set to +412 (floats)
  / id 49 (integers)"`."""
  i = change.index
  if change.direction == "swap":
    return f"swap: example {i} took example {change.source}'s rows"
  if change.direction == "perturb":
    return (f"perturb: example {i}'s floats got Gaussian noise, its other "
            f"inputs took example {change.source}'s rows")
  values = []
  for old, new in zip(tf.nest.flatten(x), tf.nest.flatten(change.x)):
    new = np.asarray(new)
    if not np.array_equal(np.asarray(old), new) and new[i].size:
      values.append(f"{new[i].reshape(-1)[0]:.4g}" if new.dtype.kind == "f"
                    else str(new[i].reshape(-1)[0]))
  shown = ", ".join(dict.fromkeys(values)) or "its labels only"
  return (f"{change.direction}: every entry of example {i}'s inputs set to "
          f"{shown} (labels too)")
