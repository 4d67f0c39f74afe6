"""Per-example clipping factors (flat L2 clipping, Abadi et al. 2016).

Non-finite examples. An example whose gradient norm (or, in
`tf_pxg.GradientTape.clipped_gradient_sum`, whose per-example target, e.g.
its loss) is NaN or inf gets clip factor 0, and every weighted sum selects
its rows to exactly 0 (`tf_pxg.rules.base.scale_examples`: a select, not a
multiply, since `0 * NaN = NaN`). Its contribution to the clipped sum is
then exactly 0 and the other examples' contributions are unchanged, so the
sum's L2 sensitivity to adding or removing one example stays at most the
clip C whatever that example holds, and DP-SGD's Gaussian noise covers it.

The alternative, skipping the whole update when any example is non-finite,
is not private: whether the weights move would depend on one example (a
planted NaN-producing record reveals whether it was sampled), a change of
unbounded size that no noise covers.
"""

import tensorflow as tf

# Norms below this are treated as this, so zero gradients get factor 1.
_TINY = 1e-12


def clip_factors(norms, l2_norm_clip):
  """`c_b = min(1, l2_norm_clip / ||g_b||)` for `[B]` norms; 0 where the
  norm is NaN or inf.

  Scaling example b's gradient by `c_b` leaves it unchanged when its norm is
  at most the clip and otherwise gives it norm exactly `l2_norm_clip`.
  An infinite clip gives ones for finite norms. A non-finite norm gives 0
  (by a select), and the weighted sums drop that example exactly (see the
  module doc).
  """
  norms = tf.convert_to_tensor(norms)
  clip = tf.cast(l2_norm_clip, norms.dtype)
  factors = tf.minimum(tf.ones_like(norms),
                       clip / tf.maximum(norms, tf.cast(_TINY, norms.dtype)))
  return tf.where(tf.math.is_finite(norms), factors, tf.zeros_like(factors))
