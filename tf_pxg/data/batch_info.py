"""`BatchInfo`: what the DP train step reads about a masked physical batch.

A sampler (`tf_pxg.data.samplers`) yields fixed-shape physical batches
`(x, y, info)`; `info` tells the train step which rows are real, whether
this physical batch ends its logical step, and what the step's noisy sum
is divided by. The train step reads it only as the typed `BatchInfo`.

Keras' `fit` and `train_on_batch` carry it in the `sample_weight` slot of
`(x, y, sample_weight)`, and a `tf.data` element must be a nest of tensors
of one row count, so on the wire (`tf.data` elements, `train_on_batch`'s
`sample_weight`, a custom pipeline's third component) it is a dict of `[P]`
float32 tensors under the keys below (the scalars broadcast to every row,
so that `shard_batch` and `tf.distribute` can cut it by rows like `x`).
`BatchInfo.to_element` and `BatchInfo.from_element` are the only two
functions that know the keys: producers build a `BatchInfo` and call the
first, the train step calls the second.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

# The wire keys (public: `tf_pxg.data.MASK` ...; read them through
# `BatchInfo.from_element`).
MASK = "dp_mask"
STEP_END = "dp_step_end"
NORMALIZER = "dp_normalizer"
WEIGHT = "dp_weight"
# Per-row mask of a batch of privacy units of several rows (augmult, users):
# `[P * G]`, the G rows of a unit contiguous; `MASK` is then per unit `[P]`.
ROW_MASK = "dp_row_mask"


class BatchInfo(NamedTuple):
  """The DP information of one physical batch (one replica's share of it
  under a strategy).

  Attributes:
    mask: `[P]` float32, 1 for a sampled privacy unit, 0 for a padding row
      (which contributes nothing: no gradient, norm, loss or metric).
    step_end: scalar bool, True on the physical batch that ends its logical
      step (the noise is drawn and the update applied there); None for a
      plain batch (`plain`), always a whole step.
    normalizer: scalar float32, what the logical step's noisy sum is
      divided by: the expected batch size qN, data-independent (a plain
      batch's realised size).
    weight: optional per-row sample weights (`[P]`, or `[P G]` with
      `row_mask`), the user's `sample_weight`/`class_weight` rows.
    row_mask: optional `[P G]` float32 mask of the rows of units of G
      contiguous rows (augmult copies, a user's examples): the unit's loss
      is the mean of its real rows' losses, clipped as one.
  """
  mask: Any
  step_end: Any
  normalizer: Any
  weight: Optional[Any] = None
  row_mask: Optional[Any] = None

  @classmethod
  def plain(cls, batch_size, weight=None) -> "BatchInfo":
    """A plain batch (not a sampler's: `train_on_batch` with arrays, Keras'
    shuffled batches, a custom loop's) as a `BatchInfo`: every one of its
    `batch_size` rows real, one whole step (`step_end` None), divided by
    its realised size (this replica's `batch_size`; the DP step
    all-reduces it under a strategy)."""
    return cls(mask=tf.ones([batch_size], tf.float32), step_end=None,
               normalizer=tf.cast(batch_size, tf.float32), weight=weight)

  @property
  def is_plain(self) -> bool:
    """Whether this is a plain batch (`plain`): a whole step of real rows."""
    return self.step_end is None

  def to_element(self) -> dict:
    """The wire form: a dict of `[P]` (`[P G]`) float32 tensors."""
    mask = tf.cast(self.mask, tf.float32)
    rows = tf.shape(mask)
    element = {
        MASK: mask,
        STEP_END: tf.broadcast_to(tf.cast(self.step_end, tf.float32), rows),
        NORMALIZER: tf.broadcast_to(tf.cast(self.normalizer, tf.float32),
                                    rows)}
    if self.weight is not None:
      element[WEIGHT] = tf.cast(self.weight, tf.float32)
    if self.row_mask is not None:
      element[ROW_MASK] = tf.cast(self.row_mask, tf.float32)
    return element

  @classmethod
  def from_element(cls, value) -> Optional["BatchInfo"]:
    """The `BatchInfo` of a wire dict; None for anything else (a plain
    `sample_weight`, or none: the batch is then one whole step)."""
    if not is_element(value):
      return None
    return cls(mask=value[MASK], step_end=value[STEP_END][0] > 0.5,
               normalizer=value[NORMALIZER][0], weight=value.get(WEIGHT),
               row_mask=value.get(ROW_MASK))


def is_element(value) -> bool:
  """Whether `value` is the wire form of a `BatchInfo`."""
  return isinstance(value, dict) and MASK in value


__all__ = ["BatchInfo", "MASK", "NORMALIZER", "ROW_MASK", "STEP_END",
           "WEIGHT", "is_element"]
