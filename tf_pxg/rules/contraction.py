"""Bilinear contractions: MatMul, BatchMatMulV2/V3 and Einsum.

Each op is described as a two-operand einsum `data_sub,param_sub->out_sub`
with a batch letter X (examples) on the data operand. Then

* per-example: `einsum(data, dz -> X param_sub)`, after splitting a merged
  batch axis `[B*k]` into `[B, k]` (the k rows join the summed letters R);
* squared norm: either materialise, or the ghost form (Goodfellow 2015;
  Li et al. 2022) `sum_S sum_{r,r'} <d_r, d_r'>_Pd <dz_r, dz_r'>_Po`, which
  costs B*S*R^2*(Pd+Po) instead of B*S*R*Pd*Po; the cheaper is chosen from
  static sizes (for a 2-D MatMul, R=1 gives ||x_b||^2 ||dz_b||^2);
* weighted sum: TF's own weight gradient with dz scaled per example;
* squared norm of a sum over chunks of one parameter's merged uses
  (`tf_pxg.per_example.merge_uses`): the ghost terms of every pair of chunks, or the
  materialised chunks added (`chunked_sq_norm`), the form chosen for all
  rows together;
* outer factors of a matrix parameter (`tf_pxg.rules.factors`): the data
  rows and dz rows, for the inner product with another use of the
  parameter (a tied LM head and its embedding lookup).

Letters: R = summed (in data and out, not param), Pd = param letters in data
only (contracted), Po = param letters in out only, S = param letters in all
three (e.g. per-head weights).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg.rules import base
from tf_pxg.rules import factors
from tf_pxg.rules import grams as grams_lib
from tf_pxg.rules.base import register
from tf_pxg.tape import recording
from tf_pxg.tape.recording import Entry

_LETTERS = string.ascii_letters


@dataclasses.dataclass
class Spec:
  data_sub: str
  param_sub: str
  out_sub: str
  batch: str
  data_index: int
  param_keep: Optional[list] = None  # param axes kept (others are size-1)


def _fresh(used: str, n: int) -> str:
  out = [c for c in _LETTERS if c not in used][:n]
  if len(out) < n:
    raise NotImplementedError("einsum equation uses too many letters")
  return "".join(out)


def _unsupported(ctx, why):
  return NotImplementedError(f"{ctx.describe()}: {why}")


def _matmul_spec(ctx) -> Spec:
  ta, tb = ctx.attr("transpose_a"), ctx.attr("transpose_b")
  a_sub = "ji" if ta else "ij"
  b_sub = "kj" if tb else "jk"
  if ctx.param_index == 1:
    return Spec(a_sub, b_sub, "ik", "i", 0)
  return Spec(b_sub, a_sub, "ik", "k", 1)


def _batch_matmul_spec(ctx) -> Spec:
  x, y = ctx.inputs[0], ctx.inputs[1]
  adj_x, adj_y = ctx.attr("adj_x"), ctx.attr("adj_y")
  rx, ry = x.shape.rank, y.shape.rank
  if rx is None or ry is None:
    raise _unsupported(ctx, "operands of unknown rank")
  ro = max(rx, ry)
  batch_letters = _fresh("ijk", ro - 2)
  xb, yb = batch_letters[ro - rx:], batch_letters[ro - ry:]
  x_sub = xb + ("ji" if adj_x else "ij")
  y_sub = yb + ("kj" if adj_y else "jk")
  out_sub = batch_letters + "ik"
  subs = [x_sub, y_sub]
  shapes = [x.shape, y.shape]
  d, p = (0, 1) if ctx.param_index == 1 else (1, 0)
  keep = []
  param_sub = ""
  for ax, c in enumerate(subs[p]):
    size_p = shapes[p][ax]
    if c in batch_letters and c in subs[d]:
      size_d = shapes[d][subs[d].index(c)]
      # A size-1 parameter axis against a larger data axis, or against the
      # data's batch axis (even when B = 1), is broadcast: dropped, and
      # restored by a reshape.
      if size_p == 1 and (size_d != 1 or subs[d].index(c) == 0):
        continue
    keep.append(ax)
    param_sub += c
  data_sub = subs[d]
  batch = data_sub[0]
  if batch not in out_sub or batch in param_sub:
    raise _unsupported(ctx, "axis 0 of the data operand is not a batch axis")
  return Spec(data_sub, param_sub, out_sub, batch, d,
              keep if len(keep) != len(subs[p]) else None)


def _expand_ellipsis(eq: str, ranks):
  lhs, out = eq.replace(" ", "").split("->")
  ops = lhs.split(",")
  if "." not in eq:
    return ops, out
  n_ell = max(r - len(s.replace("...", "")) for s, r in zip(ops, ranks)
              if "..." in s)
  ell = _fresh(eq, n_ell)
  ops = [s.replace("...", ell[n_ell - (r - len(s.replace("...", ""))):])
         for s, r in zip(ops, ranks)]
  return ops, out.replace("...", ell)


def _einsum_spec(ctx) -> Spec:
  eq = ctx.attr("equation")
  if len(ctx.inputs) != 2:
    raise _unsupported(ctx, "only two-operand einsums have a rule")
  ops, out = _expand_ellipsis(eq, [t.shape.rank for t in ctx.inputs])
  d = 1 - ctx.param_index
  data_sub, param_sub = ops[d], ops[ctx.param_index]
  if any(len(set(s)) != len(s) for s in (data_sub, param_sub, out)):
    raise _unsupported(ctx, "repeated letters (diagonals)")
  batch = data_sub[0]
  if batch not in out or batch in param_sub:
    raise _unsupported(
        ctx, f"axis 0 of the data operand ('{batch}' in '{eq}') must be a "
        "batch axis that reaches the output and not index the parameter")
  return Spec(data_sub, param_sub, out, batch, d)


def split_operands(s: Spec, data, dz, batch_size, minor=False):
  """Splits a merged batch axis [B*k] of data and dz into [B, k].

  Returns (data, dz, data_sub, out_sub) with the k rows as a summed letter.
  """
  dax, oax = s.data_sub.index(s.batch), s.out_sub.index(s.batch)
  if isinstance(batch_size, int) and data.shape[dax] == batch_size:
    return data, dz, s.data_sub, s.out_sub
  r = _fresh(s.data_sub + s.param_sub + s.out_sub, 1)
  data = base.split_batch(data, batch_size, dax, minor)
  dz = base.split_batch(dz, batch_size, oax, minor)
  return (data, dz, s.data_sub.replace(s.batch, s.batch + r),
          s.out_sub.replace(s.batch, s.batch + r))


def per_example(s: Spec, data, dz, batch_size, minor=False):
  """`[B, *param_sub sizes]`: einsum of data and dz keeping the batch."""
  data, dz, data_sub, out_sub = split_operands(s, data, dz, batch_size, minor)
  dz = tf.cast(dz, data.dtype)
  return tf.einsum(f"{data_sub},{out_sub}->{s.batch}{s.param_sub}", data, dz)


def sq_norm(s: Spec, data, dz, batch_size, minor=False):
  """`[B]` squared norms, ghost form or materialised, whichever is cheaper."""
  return sq_norm_and_per_example(s, data, dz, batch_size, minor)[0]


class _Operands:
  """A contraction's data and output gradient split into `[B, k]` rows,
  with the letter sets of the ghost-versus-materialise choice."""

  def __init__(self, s: Spec, data, dz, batch_size, minor):
    data, dz, self.data_sub, self.out_sub = split_operands(
        s, data, dz, batch_size, minor)
    self.x = x = s.batch
    self.param_sub = s.param_sub
    p = set(s.param_sub)
    self.summed = "".join(c for c in self.data_sub
                          if c in self.out_sub and c not in p and c != x)
    self.pd = "".join(c for c in s.param_sub
                      if c in self.data_sub and c not in self.out_sub)
    self.po = "".join(c for c in s.param_sub
                      if c in self.out_sub and c not in self.data_sub)
    self.shared = "".join(c for c in s.param_sub
                          if c in self.data_sub and c in self.out_sub)
    self.lonely = [c for c in self.data_sub + self.out_sub if c not in p and
                   (c not in self.data_sub or c not in self.out_sub)]
    self.sizes = {}
    for sub, t in ((self.data_sub, data), (self.out_sub, dz)):
      for c, n in zip(sub, t.shape):
        self.sizes[c] = n
    dtype = norm_dtype(data.dtype)
    self.data, self.dz = tf.cast(data, dtype), tf.cast(dz, dtype)

  def prod(self, letters):
    vals = [self.sizes.get(c) for c in letters]
    return None if None in vals else int(np.prod(vals or [1]))

  def rows(self):
    """Summed rows per example: an int, or a scalar tensor if dynamic."""
    n = self.prod(self.summed)
    if n is not None:
      return n
    return tf.reduce_prod(tf.stack(
        [tf.shape(self.data)[self.data_sub.index(c)] for c in self.summed]))

  def prefers_ghost(self, rows):
    """`_prefer_ghost` for `rows` summed rows per example (an int, or a
    scalar tensor: then a boolean tensor) of this operand's shape."""
    return _prefer_ghost(rows, self.prod(self.pd), self.prod(self.po))

  def materialised(self):
    return tf.einsum(
        f"{self.data_sub},{self.out_sub}->{self.x}{self.param_sub}",
        self.data, self.dz)

  def _as_rows(self, t, sub: str):
    """`t` (letters `sub`) as `[B, R, n]` by a reshape: when its letters
    are the batch, the summed letters, then the rest, all sizes static;
    else None."""
    head = self.x + self.summed
    n = self.prod(sub[len(head):])
    rows = self.prod(self.summed)
    if not sub.startswith(head) or None in (n, rows, t.shape[0]):
      return None
    return tf.reshape(t, [t.shape[0], rows, n])

  def _gram(self, other, t, sub, u, other_sub, equation, grams):
    """`[B, ...]` Gram of this operand's `t` (letters `sub`) and `other`'s
    `u` (`other_sub`, primed), by `grams.row_gram` where both reshape to
    rows, else `tf.einsum(equation)`; shared through `grams`."""
    def build():
      a, b = self._as_rows(t, sub), other._as_rows(u, other_sub)
      if a is None or b is None or self.shared:
        return tf.einsum(equation, t, u)
      return grams_lib.row_gram(a, b if u is not t else a)
    return grams_lib.shared_product(grams, (equation, t.ref(), u.ref()),
                                    build)

  def ghost_terms(self, other, grams=None):
    """`[B]` `sum <d_r, d_r'> <dz_r, dz_r'>` over this operand's rows r and
    `other`'s rows r' (the same parameter letters); `other` is `self` for
    the ghost norm of one interface. `grams`: the backprop's store of
    shared products (`tf_pxg.rules.grams.shared_product`), or None."""
    keep = f"{self.x}{self.shared}"
    if other is self and not self.summed:  # One row: 1 x 1 Grams.
      gram_d = _sum_of_squares(self.data, self.data_sub, keep)
      gram_z = _sum_of_squares(self.dz, self.out_sub, keep)
    else:
      letters = self.data_sub + self.out_sub + self.param_sub
      primed = _fresh(letters, len(other.summed))
      prime = str.maketrans(other.summed, primed)
      keep = f"{keep}{self.summed}{primed}"
      gram_d = self._gram(
          other, self.data, self.data_sub, other.data, other.data_sub,
          f"{self.data_sub},{other.data_sub.translate(prime)}->{keep}", grams)
      gram_z = self._gram(
          other, self.dz, self.out_sub, other.dz, other.out_sub,
          f"{self.out_sub},{other.out_sub.translate(prime)}->{keep}", grams)
      if gram_d.shape != gram_z.shape:  # One side was an einsum.
        gram_d = tf.reshape(gram_d, tf.shape(gram_z))
    return tf.cast(tf.reduce_sum(
        tf.reshape(gram_d * gram_z, [tf.shape(gram_d)[0], -1]), axis=1),
                   tf.float32)


def sq_norm_and_per_example(s: Spec, data, dz, batch_size, minor=False,
                            keeps=False, grams=None):
  """(`[B]` float32 squared norms, the per-example gradient or None).

  The per-example gradient `[B, *param_sub sizes]` is returned when it was
  materialised for the norm (float64 for float64 operands, else float32),
  None when the ghost form was cheaper. When the number of summed rows is
  known only at run time (the rows per example of a dynamic batch), both
  forms are built, `tf.cond` runs the cheaper, and the gradient is not
  returned (a tensor of unknown size is never kept for the weighted sum).

  `keeps`: the caller keeps a materialised gradient for its weighted sum
  (`base.keep_per_example`), so the form is chosen for the norm and the
  weighted sum together (`_prefer_ghost`). `grams`: the backprop's store
  of products shared between interfaces (`base.shared_product`), or None.
  """
  ops = _Operands(s, data, dz, batch_size, minor)
  ghost = lambda: ops.ghost_terms(ops, grams)
  rows = ops.rows()
  form = _form(ops, rows, keeps)
  base.trace_note(sq_norm=form)
  if form == "chosen at run time":
    return tf.cond(ops.prefers_ghost(rows), ghost,
                   lambda: base.batch_sq_norm(ops.materialised())), None
  if form == "ghost":
    return ghost(), None
  g = ops.materialised()
  return base.batch_sq_norm(g), g


def chunked_sq_norm(parts: Sequence[_Operands]):
  """`[B]` float32 squared norms of the sum of several interfaces' per-example
  gradients, for one parameter used the same way in each (the chunks of an
  unrolled loop's steps, `tf_pxg.per_example.merge_uses`).

  The form is chosen for all rows together: the ghost norm is the sum of
  every pair's ghost terms (`sum_{u,v} <G_u, G_v>`, the cross pairs
  twice), so no chunk's rows need to be concatenated with another's; the
  materialised form adds the chunks' per-example gradients.
  """
  first = parts[0]
  rows = [p.rows() for p in parts]
  total = (sum(rows) if all(isinstance(r, int) for r in rows)
           else tf.add_n([tf.cast(r, tf.int32) for r in rows]))

  def ghost():
    terms = []
    for i, u in enumerate(parts):
      terms.append(u.ghost_terms(u))
      terms.extend(2.0 * u.ghost_terms(v) for v in parts[i + 1:])
    return tf.add_n(terms)

  def materialised():
    return base.batch_sq_norm(tf.add_n([p.materialised() for p in parts]))

  form = _form(first, total)
  base.trace_note(sq_norm=form, chunks=len(parts))
  if form == "chosen at run time":
    return tf.cond(first.prefers_ghost(total), ghost, materialised)
  return ghost() if form == "ghost" else materialised()


def _form(ops: _Operands, rows, keeps: bool = False) -> str:
  """"ghost", "materialised" or "chosen at run time" for `rows` summed rows
  per example of `ops`' shape (`keeps`: see `_prefer_ghost`)."""
  if ops.lonely or None in (ops.prod(ops.pd), ops.prod(ops.po)):
    return "materialised"
  if not isinstance(rows, int):
    return "chosen at run time"
  npd, npo = ops.prod(ops.pd), ops.prod(ops.po)
  return "ghost" if _prefer_ghost(rows, npd, npo, keeps) else "materialised"


def _prefer_ghost(rows: int, npd: int, npo: int, keeps: bool = False) -> bool:
  """Whether the ghost norm beats materialising, per example.

  FLOPs: the two `rows x rows` Grams cost `rows^2 (npd + npo)`, the
  `[npd, npo]` gradient `rows npd npo`. Memory: the Grams hold `2 rows^2`
  numbers, the gradient `npd npo` (kept until the clipped sum).

  With `keeps` (a materialised gradient is kept and the weighted sum taken
  from it, `base.keep_per_example`): the gradient's matmul replaces the
  weighted sum's (TF's weight gradient, `rows npd npo` per example), which
  the ghost form still runs after its Grams. Materialising then costs
  passes over `[B, npd, npo]` beyond the plain step, the ghost form its
  Grams, and the Grams are at least the matmul's FLOPs whenever the
  gradient is small enough to keep (`npd npo <= rows (npd + npo)`, the
  data and dz's size: `base.cheap_to_keep`): ghost only when it needs
  strictly fewer FLOPs (at the tie, e.g. a text encoder's attention
  projection over 128 rows of 256 -> 256, materialising is also the faster
  on CPU).

  Without: ghost when it needs fewer FLOPs, or at most 25 % more while
  holding at most half the memory: a weight shared over T = 64 LSTM steps
  with `npd = 64` inputs and `npo = 512` gate units costs 12.5 % more
  FLOPs as Grams, but its materialised gradient `[B, 64, 512]` is 8 MB at
  B = 64 against 2 MB.
  """
  ghost, materialised = rows * (npd + npo), npd * npo
  if tf.is_tensor(rows):  # Rows per example known at run time.
    return tf.logical_or(ghost < materialised, tf.logical_and(
        4 * ghost <= 5 * materialised, 4 * rows * rows <= materialised))
  if keeps:
    return ghost < materialised
  return ghost < materialised or (
      4 * ghost <= 5 * materialised and 4 * rows * rows <= materialised)


def norm_dtype(dtype) -> tf.DType:
  """The dtype `sq_norm_and_per_example` computes in for `dtype` data:
  float64 for float64, else float32."""
  return tf.float64 if dtype == tf.float64 else tf.float32


def _rows_last(t, sub: str, x: str, summed: str, last: str, sizes):
  """`t` (letters `sub`) as `[B, R, n]`: the batch letter `x`, the summed
  letters (R rows, static where their sizes are) and the one letter
  `last` (n)."""
  order = f"{x}{summed}{last}"
  if sub != order:
    t = tf.transpose(t, [sub.index(c) for c in order])
  rows = 1
  for c in summed:
    rows = None if rows is None or sizes.get(c) is None else rows * sizes[c]
  out = tf.reshape(t, tf.stack([tf.shape(t)[0], -1, tf.shape(t)[-1]]))
  out.set_shape([t.shape[0], rows, t.shape[-1]])
  return out


def _sum_of_squares(t, sub: str, keep: str):
  """`einsum(f"{sub},{sub}->{keep}", t, t)` as a reduction (no matmul).

  TF lowers that einsum to a batched matmul of 1 x n by n x 1 blocks,
  about twice as slow on CPU as squaring and summing; sums over all axes
  but the leading one take `base.row_sum_of_squares`.
  """
  if keep == sub[0]:  # Rows of the leading axis: one pass.
    return base.row_sum_of_squares(t)
  axes = [i for i, c in enumerate(sub) if c not in keep]
  r = tf.reduce_sum(tf.square(t), axes)
  order = [c for c in sub if c in keep]
  if order != list(keep):
    r = tf.transpose(r, [order.index(c) for c in keep])
  return r


class _Contraction(base.Rule):
  """Per-example/ghost-norm/weighted-sum rules for einsum-like ops."""

  mergeable = True
  chunked = True  # `chunked_sq_norm`.

  def spec(self, ctx) -> Spec:
    raise NotImplementedError

  def check(self, ctx):
    self.spec(ctx)

  def per_example(self, ctx):
    s = self.spec(ctx)
    g = per_example(s, ctx.inputs[s.data_index], ctx.dz, ctx.batch_size,
                    ctx.batch_minor)
    if s.param_keep is not None:  # Restore broadcast (size-1) axes.
      g = tf.reshape(g, tf.concat([tf.shape(g)[:1], ctx.param_shape], 0))
    return g

  def sq_norm(self, ctx):
    s = self.spec(ctx)
    norms, g = sq_norm_and_per_example(s, ctx.inputs[s.data_index], ctx.dz,
                                       ctx.batch_size, ctx.batch_minor,
                                       keeps=ctx.kept is not None,
                                       grams=ctx.grams)
    if g is not None:
      base.keep_per_example(ctx, g)
    return norms

  def chunked_sq_norm(self, ctxs):
    """`[B]` squared norms of the sum over interfaces `ctxs` (the chunks of
    one parameter's merged uses): `chunked_sq_norm`."""
    parts = []
    for ctx in ctxs:
      s = self.spec(ctx)
      parts.append(_Operands(s, ctx.inputs[s.data_index], ctx.dz,
                             ctx.batch_size, ctx.batch_minor))
    return chunked_sq_norm(parts)

  def outer_factors(self, ctx):
    """`factors.OuterFactors` of a matrix parameter's per-example gradient
    `G_b[p, q] = sum_r data[b, r, p] dz[b, r, q]` (or with data and dz
    swapped when the parameter's first axis is the output's), r over the
    summed rows; None for other parameters (per-head letters, more than
    two axes, broadcast axes)."""
    s = self.spec(ctx)
    if s.param_keep is not None or len(s.param_sub) != 2:
      return None
    ops = _Operands(s, ctx.inputs[s.data_index], ctx.dz, ctx.batch_size,
                    ctx.batch_minor)
    if ops.shared or ops.lonely or len(ops.pd) != 1 or len(ops.po) != 1:
      return None
    a = factors.Dense(_rows_last(ops.data, ops.data_sub, ops.x, ops.summed,
                                 ops.pd, ops.sizes))
    z = factors.Dense(_rows_last(ops.dz, ops.out_sub, ops.x, ops.summed,
                                 ops.po, ops.sizes))
    return (factors.OuterFactors(a, z) if s.param_sub[0] == ops.pd else
            factors.OuterFactors(z, a))

  def weighted_sum(self, ctx, c):
    """From the per-example gradients the norm materialised, if kept (a
    sum over B instead of a weight gradient over B*R rows), else TF's
    weight gradient with the smaller of data and dz scaled per example
    (`x^T diag(c) dz` either way: an LM head's `[B*T, V]` dz is not passed
    over, its `[B*T, d]` data is) and, since the product is NaN when an
    example with `c_b = 0` has an inf row in the other operand, that
    example's rows of the other selected to 0 (both exact zeros:
    `scale_examples`, `drop_examples`)."""
    s = self.spec(ctx)
    g = base.take_per_example(ctx)
    if g is not None:
      w = base.weighted_sum_of(g, c, ctx.param_dtype)
      return w if s.param_keep is None else tf.reshape(w, ctx.param_shape)
    inputs = list(ctx.inputs)
    data, dz = inputs[s.data_index], ctx.dz
    data_axis, dz_axis = s.data_sub.index(s.batch), s.out_sub.index(s.batch)
    sizes = (data.shape.num_elements(), dz.shape.num_elements())
    if None not in sizes and sizes[0] < sizes[1]:
      inputs[s.data_index] = ctx.scale_examples(data, c, data_axis)
      dz = ctx.drop_examples(dz, c, dz_axis)
    else:
      dz = ctx.scale_examples(dz, c, dz_axis)
      inputs[s.data_index] = ctx.drop_examples(data, c, data_axis)
    return ctx.tf_gradient([dz] + list(ctx.output_grads[1:]), inputs=inputs)


@register("MatMul")
class MatMulRule(_Contraction):
  """`MatMul` with any transpose attrs; the parameter may be either operand."""

  def spec(self, ctx):
    return _matmul_spec(ctx)

  def batch_axes(self, itf):
    """The examples are the rows of the matrix that holds them (`i` of
    `ij,jk->ik`, or `k` when the parameter is the left operand)."""
    ta = recording.get_attr(itf.entry, "transpose_a") or False
    tb = recording.get_attr(itf.entry, "transpose_b") or False
    if itf.param_index == 1:
      return (1 if ta else 0), 0
    return (0 if tb else 1), 1


@register("BatchMatMulV2")
@register("BatchMatMulV3")
class BatchMatMulRule(_Contraction):
  """`BatchMatMulV2/V3` with broadcasting; batch on axis 0 of the data."""

  def spec(self, ctx):
    return _batch_matmul_spec(ctx)

  def permutable(self, itf, axis):
    """A matrix parameter broadcast over the leading (batch) axes, one of
    which holds the examples."""
    return (itf.param.shape.rank == 2 and
            axis < itf.entry.outputs[0].shape.rank - 2)


@register("Einsum")
class EinsumRule(_Contraction):
  """Two-operand `Einsum`; batch is the data operand's first letter."""

  def spec(self, ctx):
    return _einsum_spec(ctx)

  def batch_axes(self, itf):
    """Axis 0 of the data operand; the output's batch letter is found from
    the equation (`_einsum_spec`)."""
    del itf
    return 0, None

  def batch_first(self, itf, axis, minor):
    """The data operand transposed to put the examples (on `axis`) first,
    and the equation rewritten to match.

    Raises:
      ValueError: the equation's ellipsis cannot be expanded (unknown
        ranks) or the op does not have two operands.
    """
    entry = itf.entry
    eq = recording.get_attr(entry, "equation")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    ranks = [t.shape.rank for t in entry.inputs]
    if len(entry.inputs) != 2 or ("." in eq and None in ranks):
      raise ValueError(
          f"{entry.describe()}: the examples are on axis {axis} of its data "
          "operand and the equation could not be rewritten; put the batch "
          "letter first.")
    subs, out = _expand_ellipsis(eq, ranks)
    d = itf.data_indices[0]
    sub = subs[d]
    subs[d] = sub[axis] + sub[:axis] + sub[axis + 1:]
    inputs = list(entry.inputs)
    perm = [axis] + [a for a in range(ranks[d]) if a != axis]
    inputs[d] = tf.transpose(inputs[d], perm)
    rewritten = Entry(entry.op_type, tuple(inputs), entry.outputs,
                      entry.attrs, entry.op, entry.scope, entry.index,
                      attr_overrides={"equation": f"{','.join(subs)}->{out}"})
    return dataclasses.replace(itf, entry=rewritten, batch_minor=minor)
