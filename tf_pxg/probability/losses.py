"""The per-example negative log-likelihood loss of a distribution head.

`NegativeLogLikelihood(head)` is a `keras.losses.Loss`: compile a Keras 3
model (or a `tf_pxg.keras.DPModel`) with it, and `fit` trains by maximum
likelihood, under DP with per-example clipping. Its unreduced `call`
returns `-log p(y_b | params_b)`, one value per example, which is what
tf_pxg's DP step clips (`tf_pxg.keras.losses`).

`head` is a `tf_pxg.probability.heads.Head`, or any function
`params -> tfd.Distribution` (a distribution-making function) whose
`log_prob` takes the labels as `[B]` (a `[B, 1]` label is squeezed).

Before its first use with given dtypes and shapes, the loss traces its own
log-likelihood on placeholders and registers the literals TFP builds in it
(`tf_pxg.tape.library_constants`), so that TFP's coefficient tables are
never mistaken for a batch of examples (at B = 2, 3 or 6, say) while real
data of the same shape still are.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import keras
import tensorflow as tf

from tf_pxg.probability import constants
from tf_pxg.probability import heads as heads_lib

_PACKAGE = "tf_pxg.probability"


def _from_callable(make_distribution: Callable[[Any], Any]):
  def log_likelihood(y, params):
    params = tf.convert_to_tensor(params)
    y = tf.convert_to_tensor(y)
    if y.shape.rank == 2 and y.shape[-1] == 1:
      y = y[:, 0]
    return make_distribution(params).log_prob(tf.cast(y, params.dtype))
  return log_likelihood


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NegativeLogLikelihood(keras.losses.Loss):
  """`-log p(y | params)` per example, for a distribution head.

  Args:
    head: a `Head` (`tf_pxg.probability.Normal()`, ...) or a function
      `params -> tfd.Distribution`.
    reduction, name, dtype: as for `keras.losses.Loss`; give
      `dtype="float64"` for a float64 model (Keras casts predictions to
      the loss's dtype, float32 by default, which also keeps a mixed
      precision model's likelihood in float32).

  Call:
    `y_true`: labels, `[B]` or `[B, k]` as the head expects; `y_pred`:
    `[B, head.num_params]`. Returns `[B]` (unreduced `call`).

  Saving: a `Head` is serialized by its config; a function must be
  registered with `keras.saving.register_keras_serializable` (a lambda
  loads only with `safe_mode=False`).
  """

  def __init__(self, head: Union[heads_lib.Head, Callable[[Any], Any]],
               reduction="sum_over_batch_size",
               name: str = "negative_log_likelihood", dtype=None):
    super().__init__(name=name, reduction=reduction, dtype=dtype)
    self._dtype_arg = dtype
    if isinstance(head, dict):
      head = keras.saving.deserialize_keras_object(head)
    self.head = head
    self._log_likelihood = (head.log_likelihood if isinstance(
        head, heads_lib.Head) else _from_callable(head))

  def call(self, y_true, y_pred):
    constants.register_for(self._log_likelihood, y_true, y_pred)
    return -self._log_likelihood(y_true, y_pred)

  def get_config(self) -> dict:
    return {**super().get_config(), "dtype": self._dtype_arg,
            "head": keras.saving.serialize_keras_object(self.head)}
