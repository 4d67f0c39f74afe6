"""The generated adversary's models: sources, op vocabulary, compositions.

The vocabulary half of `tf_pxg.testing.adversary` (whose docstring says
what the adversary checks and how). Each op input position is fed from a
source: `const`, `ex` (a per-example value), `batch` (the batch axis, for
an `axis` position), `f.<kind>` / `i.<kind>` (a float / integer statistic
of the whole batch), or the same computed before the tape (`pf.`, `pi.`)
or assigned to a variable before it (`pvf.`, `pvi.`). A `Composition` is
the string form of a model (`generate(seed)` draws one); `Model` builds
and runs it on `x: [B, K]`, `ids: [B, K]`, `y: [B, K]` with one parameter,
the Dense kernel `W: [K, K]`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

B, K, V = 4, 6, 6          # batch, width, vocabulary (ids in [0, V))

# K != B: a constant with a dimension of the batch size may be taken for
# a batch of examples (tf_pxg refuses it, conservatively), which would hide
# every model that uses one.

F_KINDS = ("mean", "maxabs", "row0", "colmean", "hmean", "fromi", "ymean",
           "flatmax", "tmean", "gram", "softmax0", "l2norm0", "segmax",
           "sortlast", "scan", "moments")
I_KINDS = ("maxid", "count", "row0", "lenmax", "fromf", "argmax0", "uniq",
           "freq")
# Per kind, a threshold between its value on ordinary data and on the
# extreme example's batch (so a condition on it flips when one example is
# replaced).
_F_THRESHOLD = {"mean": 1.0, "maxabs": 10.0, "row0": 10.0, "colmean": 3.0,
                "hmean": 0.0, "fromi": 4.5, "ymean": 1.0, "flatmax": 10.0,
                "tmean": 3.0, "gram": 20.0, "softmax0": 3.9, "l2norm0": 3.9,
                "segmax": 10.0, "sortlast": 10.0, "scan": 4.0,
                "moments": 20.0}
_I_THRESHOLD = {"maxid": 4, "count": 0, "row0": 4, "lenmax": K - 1,
                "fromf": 4, "argmax0": K * (B - 1) - 1, "uniq": 4, "freq": 0}

_RNG_CONST = np.random.RandomState(1234)
_CONST_MATRIX = (_RNG_CONST.standard_normal((K, K)) * 0.5).astype(np.float32)
_CONST_MATRIX2 = (_RNG_CONST.standard_normal((2 * K, K)) * 0.5).astype(
    np.float32)
_CONST_IDS = np.array([1, 3, 0, 2, 5, 4], np.int32)
_CONST_ROW = np.array([0.3, -0.2, 0.5, 0.1, -0.4, 0.2], np.float32)
_CONST_PERM = np.array([2, 0, 3, 1, 5, 4], np.int32)
_CONST_MASK = np.array([True, False, True, True, False, True])


# The op input's sources -------------------------------------------------------


class _Ctx:
  """What an op can read: the raw inputs and the current data path `h`."""

  def __init__(self, x, ids, w, y=None, pre=None):
    self.x, self.ids, self.w, self.y = x, ids, w, y
    self.h = None
    self.pre = pre

  # Batch statistics (mix the examples by construction).
  def fstat(self, kind):
    x = self.x
    if kind == "mean":
      return tf.reduce_mean(x)
    if kind == "maxabs":
      return tf.reduce_max(tf.abs(x))
    if kind == "row0":
      return x[0, 0]
    if kind == "colmean":
      return tf.reduce_mean(x, axis=0)          # [K]
    if kind == "hmean":
      return tf.reduce_mean(self.h, axis=0)     # [K], depends on W
    if kind == "fromi":
      return tf.cast(tf.reduce_max(self.ids), tf.float32)
    if kind == "ymean":                         # from the labels
      return tf.reduce_mean(self.y)
    # The same mixing, written without a plain reduction over axis 0.
    if kind == "flatmax":                       # the batch flattened away
      return tf.reduce_max(tf.reshape(x, [-1]))
    if kind == "tmean":                         # the batch moved to axis 1
      return tf.reduce_mean(tf.transpose(x), axis=1)
    if kind == "gram":                          # contracted by an einsum
      return tf.linalg.trace(tf.einsum("bi,bj->ij", x, x)) / 16.0
    if kind == "softmax0":                      # [B, K], normalised over B
      return 4.0 * tf.nn.softmax(x, axis=0)
    if kind == "l2norm0":                       # [B, K], normalised over B
      return 4.0 * tf.math.l2_normalize(x, axis=0)
    if kind == "segmax":                        # one segment: the batch
      return tf.math.segment_max(x, tf.zeros_like(x[:, 0], tf.int32))[0]
    if kind == "sortlast":                      # sorted over the batch
      return tf.sort(x, axis=0)[-1]
    if kind == "scan":                          # [B, K], carried over B
      return tf.scan(lambda a, r: a + r, x) / 4.0
    if kind == "moments":                       # the batch variance
      return tf.nn.moments(x, axes=[0])[1]
    raise ValueError(f"unknown float statistic {kind!r}")

  def istat(self, kind):
    ids, x = self.ids, self.x
    if kind == "maxid":
      return tf.reduce_max(ids)
    if kind == "count":
      return tf.cast(tf.math.count_nonzero(x > 3.0) +
                     tf.math.count_nonzero(ids >= V - 1), tf.int32)
    if kind == "row0":
      return ids[0, 0]
    if kind == "lenmax":
      return tf.cast(tf.reduce_max(tf.math.count_nonzero(ids, axis=1)),
                     tf.int32)
    if kind == "fromf":
      return tf.cast(tf.floor(tf.reduce_max(x)), tf.int32)
    if kind == "argmax0":                       # which examples hold a max
      return K * (B - 1) - tf.cast(tf.reduce_sum(tf.argmax(x, axis=0)),
                                   tf.int32)
    if kind == "uniq":                          # distinct ids in the batch
      return tf.size(tf.unique(tf.reshape(ids, [-1])).y)
    if kind == "freq":                          # an id's count in the batch
      return tf.math.bincount(ids, minlength=V, maxlength=V)[V - 1]
    raise ValueError(f"unknown integer statistic {kind!r}")

  def stat(self, src):
    """The statistic a source names: `f.<kind>` / `i.<kind>` computed
    here, on the tape; `pf.<kind>` / `pi.<kind>` computed before the tape
    started (`Model.prestats`)."""
    fam, kind = src.split(".")
    if fam.startswith("p") and self.pre is not None:
      value = self.pre[src]
      return (value.read_value() if isinstance(value, tf.Variable)
              else value)
    return self.fstat(kind) if fam.endswith("f") else self.istat(kind)

  def flag(self, src):
    """A scalar bool statistic that flips on the extreme example."""
    fam, kind = src.split(".")
    if fam.endswith("f"):
      return tf.reduce_max(self.stat(src)) > _F_THRESHOLD[kind]
    return self.stat(src) > _I_THRESHOLD[kind]

  # Typed values for a position.
  def fscalar(self, src, const):
    if src == "const":
      return tf.constant(const, tf.float32)
    if src.split(".")[0].endswith("i"):
      return tf.cast(self.stat(src), tf.float32)
    return tf.reduce_mean(self.stat(src))

  def frow(self, src, const=0.5):
    """Broadcastable to `[B, K]`."""
    if src == "ex":
      return tf.sin(self.x)
    if src == "const":
      return tf.constant(const, tf.float32) * _CONST_ROW
    if src.split(".")[0].endswith("i"):
      return tf.cast(self.stat(src), tf.float32)
    return self.stat(src)

  def iscalar(self, src, lo, span, const):
    """A scalar int32 in [lo, lo + span)."""
    if src == "const":
      return tf.constant(const, tf.int32)
    # The statistic's flag (calibrated to flip when one example is replaced
    # by the extreme one): a value computed from the statistic that differs
    # between the two batches, whatever the statistic's own values (a
    # modulus of them can coincide). Raw statistics feed one_hot's depth,
    # the slice end and sequence_mask's maxlen directly.
    del span
    return lo + tf.cast(self.flag(src), tf.int32)

  def iex(self, src, n):
    """`[B, K]` int32 in [0, n): per-example ids, a constant pattern, or a
    statistic broadcast to every row."""
    if src == "ex":
      return tf.math.floormod(self.ids, n)
    like = tf.zeros_like(self.ids)
    if src == "const":
      return like + tf.math.floormod(tf.constant(_CONST_IDS), n)
    return like + self.iscalar(src, 0, n, 0)

  def cond(self, src, shape_bk=True):
    """A bool condition: `[B, K]` per example (`ex`, `const`) when
    `shape_bk`, else a scalar."""
    if src == "ex":
      return self.x > 0.0
    if src == "const":
      c = tf.constant(_CONST_MASK)
      if shape_bk:
        return tf.broadcast_to(c, tf.shape(self.x))
      return tf.constant(True)
    return self.flag(src)


# Statistics computed before the tape starts (eagerly, a tensor the tape
# never saw made; in a graph, ops of the same function before the tape).
PRE_STATS = ("pf.mean", "pf.maxabs", "pf.row0", "pf.colmean", "pi.maxid",
             "pi.count", "pi.row0", "pi.lenmax",
             # assigned to a variable before the tape, read inside it
             "pvf.mean", "pvf.colmean", "pvi.maxid", "pvi.count")
_STATS = (tuple(f"f.{k}" for k in F_KINDS) +
          tuple(f"i.{k}" for k in I_KINDS) + PRE_STATS)
# Position kinds: which sources a position accepts.
ALL = ("const", "ex") + _STATS          # a tensor that may be [B, ...]
SCALAR = ("const",) + _STATS            # a scalar: no per-example value
AXIS = ("const", "batch") + tuple(f"i.{k}" for k in I_KINDS) + tuple(
    s for s in PRE_STATS if s.startswith("pi."))


def is_stat(src: str) -> bool:
  """Whether a source is a batch statistic (on the tape or before it)."""
  return src.split(".")[0] in ("f", "i", "pf", "pi", "pvf", "pvi")


@dataclasses.dataclass(frozen=True)
class OpSpec:
  name: str
  positions: Dict[str, Tuple[str, ...]]
  variants: int
  apply: Callable            # apply(h, ctx, feeds, variant, resources)
  build: Optional[Callable] = None   # build(index) -> resources (eagerly)
  doc: str = ""


VOCABULARY: Dict[str, OpSpec] = {}


def _op(name, positions, variants=1, build=None):
  def deco(fn):
    VOCABULARY[name] = OpSpec(name, dict(positions), variants, fn, build,
                              (fn.__doc__ or "").strip())
    return fn
  return deco


# The vocabulary -----------------------------------------------------------


_UNARY = (tf.tanh, tf.sin, lambda h: 0.25 * tf.square(h), tf.nn.softplus,
          tf.abs, lambda h: 2.0 * tf.sigmoid(h), tf.nn.relu)


@_op("unary", {}, variants=len(_UNARY))
def _unary(h, ctx, f, v, r):
  """Elementwise math: tanh, sin, square, softplus, abs, sigmoid, relu."""
  return _UNARY[v](h)


@_op("binary", {"y": ALL}, variants=5)
def _binary(h, ctx, f, v, r):
  """h (+, *, -, max, / (1 + y^2)) y."""
  y = ctx.frow(f["y"])
  if v == 0:
    return h + y
  if v == 1:
    return h * y
  if v == 2:
    return h - 0.5 * y
  if v == 3:
    return tf.maximum(h, y)
  return h / (1.0 + tf.square(y))


@_op("matmul", {"m": ALL}, variants=2)
def _matmul(h, ctx, f, v, r):
  """h @ M (matmul or einsum); M constant, per example (`ex`: I + an outer
  product of the example's own row), or I + a batch statistic."""
  src = f["m"]
  eye = tf.eye(K)
  if src == "ex":
    s = tf.sin(ctx.x)
    m = eye + 0.3 * tf.einsum("bi,bj->bij", s, tf.cos(ctx.x))
    return tf.einsum("bk,bkj->bj", h, m)
  if src == "const":
    m = tf.constant(_CONST_MATRIX)
  else:
    stat = ctx.frow(src)
    if stat.shape.rank == 2:
      stat = tf.reduce_mean(stat, axis=0)
    m = eye + 0.3 * stat * tf.ones([K, K]) if stat.shape.rank == 0 else (
        eye + 0.3 * tf.einsum("i,j->ij", stat, stat))
  return tf.matmul(h, m) if v == 0 else tf.einsum("bk,kj->bj", h, m)


@_op("reshape_transpose", {"perm": SCALAR, "shape": SCALAR})
def _reshape_transpose(h, ctx, f, v, r):
  """Reshape `[B, K] -> [B, 2, K/2]`, transpose the last two axes by a
  permutation (a flag picks `[0, 2, 1]` or `[0, 1, 2]`), reshape back; the
  shape's middle dimension may be computed (2, or `2 + 0 * stat`)."""
  mid = tf.constant(2) if f["shape"] == "const" else (
      2 + 0 * ctx.iscalar(f["shape"], 0, 3, 0))
  r3 = tf.reshape(h, tf.stack([-1, mid, K // 2]))
  if f["perm"] == "const":
    perm = tf.constant([0, 2, 1])
  else:
    s = tf.cast(ctx.flag(f["perm"]), tf.int32)
    perm = tf.stack([0, 1 + s, 2 - s])
  return tf.reshape(tf.transpose(r3, perm), tf.shape(h))


@_op("gather", {"idx": ALL}, variants=2)
def _gather(h, ctx, f, v, r):
  """Gather along the features: a constant permutation, per-example ids
  (`batch_dims=1`), or shifted by a statistic; variant 1 gathers rows of
  the batch shifted by the statistic (`(range(B) + s) % B`) or, fed `ex`,
  the row each example's first id names."""
  src = f["idx"]
  if src == "ex" and v == 1:
    # Each example picks a row of the batch by its own first id.
    n = tf.shape(h)[0]
    return tf.gather(h, tf.math.floormod(ctx.ids[:, 0], n), axis=0)
  if src == "ex":
    return tf.gather(h, ctx.iex("ex", K), axis=1, batch_dims=1)
  if src == "const":
    return tf.gather(h, tf.constant(_CONST_PERM), axis=1)
  s = ctx.iscalar(src, 0, K, 0)
  if v == 1:
    n = tf.shape(h)[0]
    return tf.gather(h, tf.math.floormod(tf.range(n) + s, n), axis=0)
  return tf.gather(h, tf.math.floormod(tf.range(K) + s, K), axis=1)


@_op("embed", {"ids": ALL})
def _embed(h, ctx, f, v, r):
  """The kernel W used as an embedding table too: `h + mean_k W[ids]`."""
  idx = ctx.iex(f["ids"], K)
  return h + 0.5 * tf.reduce_mean(tf.gather(ctx.w, idx), axis=1)


@_op("one_hot", {"idx": ALL, "depth": SCALAR})
def _one_hot(h, ctx, f, v, r):
  """`h * logsumexp(2 * one_hot(idx, depth), -1)`: the depth counts."""
  depth = ctx.iscalar(f["depth"], 2, V, V) if f["depth"] != "const" else (
      tf.constant(V))
  if f["depth"] in ("i.maxid", "pi.maxid"):
    depth = ctx.stat(f["depth"]) + 1      # the one-hot
  oh = tf.one_hot(ctx.iex(f["idx"], V), depth)
  return h * 0.5 * tf.reduce_logsumexp(2.0 * oh, axis=-1)


@_op("sequence_mask", {"lengths": ALL, "maxlen": SCALAR})
def _sequence_mask(h, ctx, f, v, r):
  """`h * (1 + mean(sequence_mask(lengths, maxlen)))`: the padded length
  (a batch's longest sequence, say) sets each row's fraction."""
  src = f["lengths"]
  n = tf.shape(h)[0]
  if src == "ex":
    lengths = tf.math.count_nonzero(ctx.ids, axis=1, dtype=tf.int32)
  elif src == "const":
    lengths = tf.fill([n], 2)
  else:
    lengths = tf.fill([n], ctx.iscalar(src, 1, 3, 2))
  maxlen = (tf.constant(K) if f["maxlen"] == "const" else
            ctx.iscalar(f["maxlen"], 2, 3, K))
  if f["maxlen"] in ("i.lenmax", "pi.lenmax"):
    maxlen = ctx.stat(f["maxlen"])
  m = tf.cast(tf.sequence_mask(lengths, maxlen), tf.float32)
  return h * (1.0 + tf.reduce_mean(m, axis=1, keepdims=True))


@_op("range", {"n": SCALAR})
def _range(h, ctx, f, v, r):
  """`h + 0.1 * sum(range(n))`."""
  n = ctx.iscalar(f["n"], 1, 3, 3)
  return h + 0.1 * tf.reduce_sum(tf.cast(tf.range(n), tf.float32))


@_op("roll", {"shift": SCALAR, "axis": AXIS})
def _roll(h, ctx, f, v, r):
  """`roll(h, shift, axis)`: the features (const), the batch (batch), or
  an axis a statistic picks."""
  shift = ctx.iscalar(f["shift"], 1, 3, 1)
  src = f["axis"]
  axis = 1 if src == "const" else 0 if src == "batch" else (
      ctx.iscalar(src, 0, 2, 1))
  return tf.roll(h, shift, axis)


@_op("bincount", {"idx": ALL, "size": SCALAR})
def _bincount(h, ctx, f, v, r):
  """`h + logsumexp(bincount(idx, width n, per row))`: the width counts."""
  n = ctx.iscalar(f["size"], V, 3, V)
  counts = tf.math.bincount(ctx.iex(f["idx"], V), minlength=n, maxlength=n,
                            axis=-1, dtype=tf.float32)
  return h + 0.5 * tf.reduce_logsumexp(counts, axis=1, keepdims=True)


@_op("slice", {"begin": SCALAR, "end": SCALAR}, variants=2)
def _slice(h, ctx, f, v, r):
  """`h + sum(h[:, begin:end])` (variant 1: `h[:, :end]` padded back to K,
  the batch trimmed to its longest sequence)."""
  begin = ctx.iscalar(f["begin"], 0, 2, 0)
  end = ctx.iscalar(f["end"], 2, K - 1, 3)
  if f["end"] in ("i.lenmax", "pi.lenmax"):
    end = ctx.stat(f["end"])
  if v == 1:
    t = h[:, :end]
    t = tf.pad(t, tf.stack([[0, 0], [0, K - tf.shape(t)[1]]]))
    return tf.reshape(t, tf.shape(h)) + 0.1 * h
  return h + 0.5 * tf.reduce_sum(h[:, begin:end], axis=1, keepdims=True)


@_op("tile", {"multiples": SCALAR})
def _tile(h, ctx, f, v, r):
  """`h + sum(tile(h[:, :2], [1, m]))`."""
  m = ctx.iscalar(f["multiples"], 1, 3, 2)
  t = tf.tile(h[:, :2], tf.stack([1, m]))
  return h + 0.25 * tf.reduce_sum(t, axis=1, keepdims=True)


@_op("broadcast_to", {"shape": SCALAR})
def _broadcast_to(h, ctx, f, v, r):
  """`sum(broadcast_to(h[..., None], [B, K, n]), -1) / 2`."""
  n = ctx.iscalar(f["shape"], 1, 3, 2)
  t = tf.broadcast_to(h[:, :, None], tf.stack([tf.shape(h)[0], K, n]))
  return 0.5 * tf.reduce_sum(t, axis=-1)


@_op("pad", {"paddings": SCALAR, "value": SCALAR})
def _pad(h, ctx, f, v, r):
  """`h + logsumexp(pad(h, [[0, 0], [p, 1]], constant_values=c))`."""
  p = ctx.iscalar(f["paddings"], 0, 3, 1)
  c = ctx.fscalar(f["value"], 0.0)
  t = tf.pad(h, tf.stack([[0, 0], tf.stack([p, 1])]), constant_values=c)
  return h + 0.5 * tf.reduce_logsumexp(t, axis=1, keepdims=True)


@_op("concat", {"y": ALL})
def _concat(h, ctx, f, v, r):
  """`concat([h, y], axis=1) @ M2` (y broadcast to `[B, K]`)."""
  y = tf.broadcast_to(ctx.frow(f["y"]), tf.shape(h))
  return tf.matmul(tf.concat([h, y], axis=1), tf.constant(_CONST_MATRIX2))


@_op("reduce", {"axis": AXIS}, variants=3)
def _reduce(h, ctx, f, v, r):
  """`h - reduce_(mean, max, logsumexp)(h, axis, keepdims)`: over the
  features (const), the batch (batch), or an axis a statistic picks."""
  src = f["axis"]
  axis = 1 if src == "const" else 0 if src == "batch" else (
      ctx.iscalar(src, 0, 2, 1))
  red = (tf.reduce_mean, tf.reduce_max, tf.reduce_logsumexp)[v]
  return h - 0.5 * red(h, axis=axis, keepdims=True)


@_op("where1", {"cond": ALL}, variants=3)
def _where1(h, ctx, f, v, r):
  """`tf.where(cond)` (coordinates): 0 scatters ones back as a mask, 1 uses
  the count of true elements, 2 gathers and scatters the selected values."""
  src = f["cond"]
  if is_stat(src):
    cond = ctx.x > ctx.fscalar(src, 0.0) * 0.1
  else:
    cond = ctx.cond(src)
  coords = tf.where(cond)
  shape = tf.shape(h, out_type=tf.int64)
  if v == 0:
    m = tf.scatter_nd(coords, tf.ones(tf.shape(coords)[:1]), shape)
    return h * (1.0 + m)
  if v == 1:
    n = tf.shape(coords)[0]
    return h * (1.0 + tf.cast(tf.minimum(n, 1), tf.float32))
  return h + tf.scatter_nd(coords, tf.gather_nd(h, coords), shape)


@_op("where3", {"cond": ALL}, variants=2)
def _where3(h, ctx, f, v, r):
  """`tf.where(cond, h, -h / 2 + 1)` (variant 1: `tf.where(cond, h, 0)`)."""
  cond = ctx.cond(f["cond"])
  other = -0.5 * h + 1.0 if v == 0 else tf.zeros_like(h)
  return tf.where(cond, h, other)


@_op("cumsum", {"axis": AXIS}, variants=3)
def _cumsum(h, ctx, f, v, r):
  """`cumsum(h, axis)` (exclusive, reverse by variant)."""
  src = f["axis"]
  axis = 1 if src == "const" else 0 if src == "batch" else (
      ctx.iscalar(src, 0, 2, 1))
  return 0.5 * tf.cumsum(h, axis=axis, exclusive=(v == 1), reverse=(v == 2))


@_op("sort", {"k": SCALAR}, variants=3)
def _sort(h, ctx, f, v, r):
  """0: sort the features; 1: `h + sum(top_k(h, k).values)`; 2: argsort
  the features and gather them (`batch_dims=1`)."""
  if v == 0:
    return tf.sort(h, axis=1, direction="DESCENDING")
  if v == 2:
    order = tf.argsort(h, axis=1)
    return tf.gather(h, order, axis=1, batch_dims=1)
  k = ctx.iscalar(f["k"], 1, K, 2)
  return h + 0.5 * tf.reduce_sum(tf.math.top_k(h, k).values, axis=1,
                                 keepdims=True)


@_op("random", {"seed": SCALAR, "lo": SCALAR}, variants=2)
def _random(h, ctx, f, v, r):
  """`h * (1 + u)`, u `[K]` stateless uniform (integers / 1000, or / 10)
  from a seed, plus a lower bound (the same noise for every example)."""
  if f["seed"] == "const":
    seed = tf.constant([1, 2])
  else:
    seed = tf.stack([ctx.iscalar(f["seed"], 0, 1000, 0), 7])
  lo = ctx.fscalar(f["lo"], 0.0)
  # Integer draws: XLA's float samplers (uniform and normal) are not
  # TensorFlow's kernels bit for bit, its integer draws are.
  n = 1000 if v == 0 else 10
  u = lo + tf.cast(tf.random.stateless_uniform(
      [K], seed, minval=0, maxval=n, dtype=tf.int32), tf.float32) / n
  return h * (1.0 + u)


@_op("cond", {"pred": SCALAR})
def _cond(h, ctx, f, v, r):
  """`tf.cond(pred, 2 tanh(h), sin(h) - h / 2)`."""
  pred = ctx.cond(f["pred"], shape_bk=False)
  return tf.cond(pred, lambda: 2.0 * tf.tanh(h),
                 lambda: tf.sin(h) - 0.5 * h)


@_op("while_loop", {"n": SCALAR, "step": ALL})
def _while_loop(h, ctx, f, v, r):
  """n iterations of `h <- tanh(h) * 1.5 + a`."""
  n = ctx.iscalar(f["n"], 1, 3, 2)
  a = ctx.frow(f["step"], 0.1)

  def body(i, t):
    return i + 1, tf.tanh(t) * 1.5 + a

  _, out = tf.while_loop(lambda i, t: i < n, body, (tf.constant(0), h))
  return out


@_op("tensor_array", {"shift": SCALAR})
def _tensor_array(h, ctx, f, v, r):
  """Rows written to a `tf.TensorArray` in a loop over the batch, row b at
  index `(b + shift) % B`, then stacked: shift 0 keeps each example's row
  (const), a statistic's flag moves rows across the batch."""
  n = tf.shape(h)[0]
  shift = (tf.constant(0) if f["shift"] == "const" else
           ctx.iscalar(f["shift"], 0, 2, 0))
  ta = tf.TensorArray(tf.float32, size=n, element_shape=[K])

  def body(b, ta):
    return b + 1, ta.write(tf.math.floormod(b + shift, n), h[b])

  _, ta = tf.while_loop(lambda b, ta: b < n, body, (tf.constant(0), ta))
  return ta.stack()


@_op("map_fn", {"c": SCALAR})
def _map_fn(h, ctx, f, v, r):
  """`tf.map_fn(lambda row: tanh(row) * c, h)`: a loop over the examples,
  each row on its own (c a constant or a statistic)."""
  c = ctx.fscalar(f["c"], 1.5)
  return tf.map_fn(lambda row: tf.tanh(row) * c, h)


def _build_state(index):
  return {"row": tf.Variable(tf.zeros([K]), trainable=False,
                             name=f"adversary_state_{index}"),
          "rows": tf.Variable(tf.zeros([B, K]), trainable=False,
                              shape=tf.TensorShape([None, K]),
                              name=f"adversary_rows_{index}")}


@_op("assign", {"value": ALL, "pred": SCALAR}, variants=2, build=_build_state)
def _assign(h, ctx, f, v, r):
  """A variable assigned in the forward pass and read back: `h + v`
  (variant 1: the assignment inside a `tf.cond` branch on `pred`)."""
  src = f["value"]
  var = r["rows"] if src == "ex" else r["row"]
  value = tf.sin(ctx.x) if src == "ex" else ctx.frow(src, 0.4)
  if src != "ex":
    if value.shape.rank == 2:
      value = tf.reduce_mean(value, axis=0)
    value = tf.broadcast_to(value, [K])

  def write():
    var.assign(value)
    return tf.constant(1.0)

  if v == 1:
    tf.cond(ctx.cond(f["pred"], shape_bk=False), write,
            lambda: tf.constant(0.0))
  else:
    write()
  return h + 0.5 * var.read_value()


def _build_tables(index):
  return {"mutable": tf.lookup.experimental.MutableHashTable(
              tf.int64, tf.float32, default_value=0.0,
              name=f"adversary_table_{index}"),
          "dense": tf.lookup.experimental.DenseHashTable(
              tf.int64, tf.float32, default_value=0.0, empty_key=-1,
              deleted_key=-2, name=f"adversary_dense_{index}")}


@_op("table", {"keys": ALL, "values": ALL}, variants=4, build=_build_tables)
def _table(h, ctx, f, v, r):
  """A hash table (Mutable for variants 0/1, Dense for 2/3) filled in the
  forward pass and read back: `h * (1 + lookup(keys))`. Odd variants make
  the keys unique per row (`keys + 100 * row`)."""
  table = r["mutable"] if v < 2 else r["dense"]
  keys = tf.cast(ctx.iex(f["keys"], V), tf.int64)
  if v % 2 == 1:
    keys += 100 * tf.range(tf.shape(keys, out_type=tf.int64)[0])[:, None]
  values = tf.broadcast_to(ctx.frow(f["values"], 0.3), tf.shape(h))
  flat = tf.reshape(keys, [-1])
  table.insert(flat, tf.reshape(values, [-1]))
  return h * (1.0 + tf.reshape(table.lookup(flat), tf.shape(h)))


@_op("ragged", {"lengths": ALL})
def _ragged(h, ctx, f, v, r):
  """`h + sum over a ragged row`: rows `from_row_lengths` of the flat h,
  aligned with the examples (`const`), per-example lengths (`ex`, masked
  from the example's own row), or shifted across an example boundary
  when a statistic says so (sequence packing)."""
  src = f["lengths"]
  n = tf.shape(h)[0]
  if src == "ex":
    lengths = 1 + tf.math.floormod(ctx.ids[:, 0], K)
    rt = tf.RaggedTensor.from_tensor(h, lengths=lengths)
  else:
    lengths = tf.fill([n], K)
    if src != "const":
      s = tf.cast(ctx.flag(src), tf.int32) * tf.cast(n > 1, tf.int32)
      row = tf.range(n)
      lengths += s * (tf.cast(row == 1, tf.int32) - tf.cast(row == 0,
                                                           tf.int32))
    rt = tf.RaggedTensor.from_row_lengths(tf.reshape(h, [-1]), lengths)
  return h + 0.5 * tf.reduce_sum(rt, axis=1)[:, None]


# Compositions -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
  op: str
  variant: int = 0
  feeds: Tuple[Tuple[str, str], ...] = ()

  def __str__(self):
    s = self.op if not self.variant else f"{self.op}:{self.variant}"
    if self.feeds:
      s += "[" + ",".join(f"{p}={src}" for p, src in self.feeds) + "]"
    return s


PARAM = Step("W")
_STEP_RE = re.compile(r"^(\w+)(?::(\d+))?(?:\[(.*)\])?$")


@dataclasses.dataclass(frozen=True)
class Composition:
  steps: Tuple[Step, ...]

  def __str__(self):
    return " > ".join(str(s) for s in self.steps)

  @staticmethod
  def parse(text: str) -> "Composition":
    steps = []
    for part in text.split(">"):
      m = _STEP_RE.match(part.strip())
      if not m:
        raise ValueError(f"cannot parse step {part!r}")
      op, variant, feeds = m.group(1), int(m.group(2) or 0), m.group(3)
      if op == "W":
        steps.append(PARAM)
        continue
      spec = VOCABULARY[op]
      given = dict(kv.split("=") for kv in feeds.split(",")) if feeds else {}
      for p, src in given.items():
        if p not in spec.positions or src not in spec.positions[p]:
          raise ValueError(f"{op}: position {p!r} does not take {src!r}")
      full = tuple((p, given.get(p, "const")) for p in spec.positions)
      steps.append(Step(op, variant, full))
    if steps.count(PARAM) != 1:
      raise ValueError(f"{text!r}: exactly one 'W' step is needed")
    return Composition(tuple(steps))

  def fed(self):
    """(op, position, source) of every non-constant feed."""
    return [(s.op, p, src) for s in self.steps for p, src in s.feeds
            if src != "const"]


def generate(seed: int, max_ops: int = 3, p_stat: float = 0.45,
             ops: Optional[Sequence[str]] = None) -> Composition:
  """A composition drawn from `numpy.random.RandomState(seed)`: 1 to
  `max_ops` ops around the parameter, each position fed by a statistic
  with probability `p_stat`, else by a per-example value or a constant."""
  rng = np.random.RandomState(seed)
  names = sorted(ops or VOCABULARY)
  n = rng.randint(1, max_ops + 1)
  steps = []
  for _ in range(n):
    spec = VOCABULARY[names[rng.randint(len(names))]]
    feeds = []
    for p, allowed in spec.positions.items():
      stats = [s for s in allowed if s not in ("const", "ex")]
      plain = [s for s in allowed if s in ("const", "ex")]
      if stats and rng.rand() < p_stat:
        src = stats[rng.randint(len(stats))]
      else:
        src = plain[rng.randint(len(plain))]
      feeds.append((p, src))
    steps.append(Step(spec.name, int(rng.randint(spec.variants)),
                      tuple(feeds)))
  steps.insert(rng.randint(n + 1), PARAM)
  return Composition(tuple(steps))


class Model:
  """A composition made concrete: its kernel W and any state it uses."""

  def __init__(self, composition: Composition, seed: int = 0):
    if isinstance(composition, str):
      composition = Composition.parse(composition)
    self.composition = composition
    rng = np.random.RandomState(seed)
    self.w = tf.Variable((rng.standard_normal((K, K)) * 0.5).astype(
        np.float32), name="kernel")
    self.pre_vars = {
        src: tf.Variable(tf.zeros([K] if kind == "colmean" else [],
                                  tf.float32 if fam == "pvf" else tf.int32),
                         trainable=False, name=f"adversary_pre_{kind}")
        for s in composition.steps for _, src in s.feeds
        for fam, _, kind in [src.partition(".")] if fam in ("pvf", "pvi")}
    self.resources = [VOCABULARY[s.op].build(i)
                      if s is not PARAM and VOCABULARY[s.op].build else None
                      for i, s in enumerate(composition.steps)]

  @property
  def state_variables(self):
    return [v for r in self.resources if r for v in r.values()
            if isinstance(v, tf.Variable)]

  def reset_state(self):
    """Zeros the variables the forward pass writes, so each run starts from
    the same state (what one run writes is then read back in that run
    alone: the channel under test is within the step)."""
    for v in self.state_variables:
      v.assign(tf.zeros_like(v))

  def prestats(self, x, ids, y=None):
    """The statistics the composition reads from before the tape (its
    `pf.` / `pi.` sources), computed from the batch now."""
    ctx = _Ctx(x, ids, self.w, tf.zeros_like(x) if y is None else y)
    ctx.h = x
    wanted = {src for s in self.composition.steps for _, src in s.feeds
              if src.split(".")[0].startswith("p")}
    pre = {}
    for src in sorted(wanted):
      fam, kind = src.split(".")
      value = (ctx.fstat if fam.endswith("f") else ctx.istat)(kind)
      if fam.startswith("pv"):          # laundered through a variable
        self.pre_vars[src].assign(value)
        value = self.pre_vars[src]
      pre[src] = value
    return pre

  def __call__(self, x, ids, y=None, pre=None):
    y = tf.zeros_like(x) if y is None else y
    ctx = _Ctx(x, ids, self.w, y,
               self.prestats(x, ids, y) if pre is None else pre)
    h = x
    for step, res in zip(self.composition.steps, self.resources):
      ctx.h = h
      if step is PARAM:
        h = tf.matmul(h, self.w)
      else:
        spec = VOCABULARY[step.op]
        h = spec.apply(h, ctx, dict(step.feeds), step.variant, res)
    return h

  def losses(self, x, ids, y, pre=None):
    h = self(x, ids, y, pre)
    return 0.5 * tf.reduce_sum(tf.square(h - y), axis=1)
