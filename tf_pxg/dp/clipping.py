"""Per-example clipping factors (flat L2 clipping, Abadi et al. 2016)."""

import tensorflow as tf

# Norms below this are treated as this, so zero gradients get factor 1.
_TINY = 1e-12


def clip_factors(norms, l2_norm_clip):
  """`c_b = min(1, l2_norm_clip / ||g_b||)` for `[B]` norms.

  Scaling example b's gradient by `c_b` leaves it unchanged when its norm is
  at most the clip and otherwise gives it norm exactly `l2_norm_clip`.
  An infinite clip gives all ones.
  """
  norms = tf.convert_to_tensor(norms)
  clip = tf.cast(l2_norm_clip, norms.dtype)
  return tf.minimum(tf.ones_like(norms),
                    clip / tf.maximum(norms, tf.cast(_TINY, norms.dtype)))
