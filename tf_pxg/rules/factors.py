"""A matrix parameter's per-example gradient as a sum of outer products.

Two rules give example b's gradient of a 2-D parameter `W [m, n]` as a
sum over its rows r (tokens, positions) of outer products,
`G_b = sum_r a_{b,r} (x) z_{b,r}`:

* a contraction (`MatMul`, `BatchMatMul`, `Einsum` with no per-head
  letter): `a` the data rows, `z` the output gradient's rows (or the
  reverse, when the parameter's first axis is the output's);
* a gather from a table `[V, n]` on axis 0 (an embedding lookup): `a_{b,r}`
  the one-hot row `e_{id_{b,r}}` of the token id, `z` the gradient at the
  gathered row.

The inner product of two such gradients of one parameter (its two uses:
a tied embedding's lookup and its LM head, GPT-2's `ReversibleEmbedding`)
needs neither:

    <G^u_b, G^v_b> = sum_{r,s} <a^u_{b,r}, a^v_{b,s}> <z^u_{b,r}, z^v_{b,s}>,

two `[R_u, R_v]` Grams per example, O(R_u R_v (m + n)) (the ghost norm's
Grams, Goodfellow 2015, Li et al. 2022, across two uses). A Gram with a
one-hot side is a gather: `<e_{id_r}, y_s> = y_s[id_r]`; two one-hot sides
compare ids. For the lookup and the head of a tied `[V, d]` embedding,
with `dE` the lookup's output gradient `[T, d]`, `h` the head's input
`[T, d]` and `dY` its output gradient `[T, V]`:

    <G^lookup_b, G^head_b> = sum_{t,s} dY_b[s, id_{b,t}] <dE_{b,t}, h_{b,s}>,

so the norm of the sum, `||G^u||^2 + ||G^v||^2 + 2 <G^u, G^v>`, never
builds the `[B, V, d]` per-example gradient (1.2 GB for GPT-2 small at
B = 8).

`tf_pxg.per_example.backward` uses this for a parameter that reaches several
interfaces through `ReadVariableOp`/`Identity`/`Cast` and 2-D transposes
(`OuterFactors.transposed`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import tensorflow as tf

from tf_pxg.rules import grams


@dataclasses.dataclass(frozen=True)
class Dense:
  """Rows `[B, R, size]` of one side of the outer products (float32/64)."""
  rows: tf.Tensor

  @property
  def size(self) -> Optional[int]:
    return self.rows.shape[2]

  @property
  def count(self) -> Optional[int]:
    return self.rows.shape[1]


@dataclasses.dataclass(frozen=True)
class OneHot:
  """One-hot rows `e_{ids[b, r]}` of length `size`; `ids` is `[B, R]`."""
  ids: tf.Tensor
  size: Optional[int]

  @property
  def count(self) -> Optional[int]:
    return self.ids.shape[1]


Side = Union[Dense, OneHot]


@dataclasses.dataclass(frozen=True)
class OuterFactors:
  """`G_b = sum_r left[b, r] (x) right[b, r]`, a `[m, n]` gradient
  (`left` has size m, `right` size n)."""
  left: Side
  right: Side

  def transposed(self) -> "OuterFactors":
    """The factors of `G_b^T` (the parameter seen through a 2-D
    transpose)."""
    return OuterFactors(self.right, self.left)

  @property
  def rows(self) -> Optional[int]:
    """R, the number of outer products per example (None if dynamic)."""
    return self.left.count


def _gram(u: Side, v: Side):
  """`[B, R_u, R_v]` float32: `<u_{b,r}, v_{b,s}>` for every r, s."""
  if isinstance(u, OneHot) and isinstance(v, OneHot):
    return tf.cast(tf.equal(u.ids[:, :, None], tf.cast(v.ids, u.ids.dtype)[
        :, None, :]), tf.float32)
  if isinstance(u, OneHot):
    return tf.transpose(_gram(v, u), [0, 2, 1])
  if isinstance(v, OneHot):  # v_s = e_{id_s}: the column id_s of u's rows.
    picked = tf.gather(u.rows, v.ids, axis=2, batch_dims=1)
    return tf.cast(picked, tf.float32)
  return tf.cast(grams.row_gram(u.rows, tf.cast(v.rows, u.rows.dtype)),
                 tf.float32)


def inner(f: OuterFactors, g: OuterFactors):
  """`[B]` float32: `<G^f_b, G^g_b>`, the Frobenius inner product of the
  two per-example gradients, from their Grams (never the gradients).

  Raises:
    ValueError: the two do not describe gradients of one shape.
  """
  for a, b in ((f.left, g.left), (f.right, g.right)):
    if a.size is not None and b.size is not None and a.size != b.size:
      raise ValueError(
          f"Outer-product factors of different shapes ({a.size} vs "
          f"{b.size}): they are not gradients of one parameter.")
  return tf.reduce_sum(_gram(f.left, g.left) * _gram(f.right, g.right),
                       axis=[1, 2])


def _side_cost(u: Side, v: Side) -> Optional[int]:
  """Multiply-adds per Gram entry: 1 for a one-hot side, else the size."""
  if isinstance(u, OneHot) or isinstance(v, OneHot):
    return 1
  return u.size


def inner_cost(f: OuterFactors, g: OuterFactors) -> Optional[int]:
  """Multiply-adds per example of `inner(f, g)` (None if not static)."""
  parts = [f.rows, g.rows, _side_cost(f.left, g.left),
           _side_cost(f.right, g.right)]
  if None in parts:
    return None
  return parts[0] * parts[1] * (parts[2] + parts[3])
