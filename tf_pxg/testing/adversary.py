"""A generated adversary: small models whose every op input may carry data.

Invariant 4 of the design (docs/design.md) says that whatever is derived from
an input or a label is data at *every* input of every op: a size, a depth, a
seed, a condition, a slice bound, a permutation, an index, a row partition,
and through variables and tables. This module composes small models from an
op vocabulary and feeds each such input position from one of

* `const`: a literal (independent of the examples);
* `ex`: a per-example value (a function of the example's own row: `sin(x)`,
  the token ids), where the position takes a `[B, ...]` tensor;
* `batch`: the batch axis itself, for an `axis` position (a constant that
  reduces or accumulates over the examples);
* `f.<kind>`: a float statistic of the whole batch (`f.mean`, `f.maxabs`,
  `f.row0`, `f.colmean`, `f.hmean`, `f.fromi`, `f.ymean` of the labels);
* `i.<kind>`: an integer statistic of the whole batch (`i.maxid`,
  `i.count`, `i.row0`, `i.lenmax`, `i.fromf`, `i.argmax0`, `i.uniq`,
  `i.freq`), and the same mixing written without a plain reduction over
  axis 0 (`f.flatmax`, `f.tmean`, `f.gram`, `f.softmax0`, `f.l2norm0`,
  `f.segmax`, `f.sortlast`, `f.scan`, `f.moments`).

Each model is `x -> ops -> x @ W -> ops -> 0.5 * ||h - y||^2` per example,
with `x: [B, K]` floats, `ids: [B, K]` token ids (0 is padding), `y: [B, K]`
labels and one parameter, the Dense kernel `W: [K, K]`. Every op maps the
data path `h: [B, K]` to `[B, K]`, so any composition is a valid model.

A composition is written as a string and parsed back, so a failure is its own
regression case:

    "one_hot[idx=ex,depth=i.maxid] > W > where3:1[cond=f.mean]"

(`op:variant[position=source,...]`, steps separated by ` > `, `W` the
parameter's matmul.) `generate(seed)` draws one from a
`numpy.random.RandomState(seed)`.

`check_models(compositions, modes)` judges each model in each mode (`eager`:
the tape eagerly; `function`: inside `tf.function`; `jit`: inside
`tf.function(jit_compile=True)`) the way DP training would: it must either be

* **refused**: a `ValueError` whose message names an op (`"op '"`), raised by
  `tf_pxg.GradientTape` or by the check a DP train step makes of the
  forward pass's state writes (`GradientTape.data_dependent_writes`); or
* **exact**: `per_example_gradient` on the batch D equals
  `reference_per_example_gradients` (a plain `tf.GradientTape` loop over
  single examples), and `clipped_gradient_sum` on D and on D' (D with its
  example 0 replaced by an extreme one: large values, the largest token id)
  equals the clipped sum of the reference; **and bounded**: the replace-one
  influence `||clipped_sum(D) - clipped_sum(D')||` is at most `2C`, C the clip
  norm (the median of the reference's per-example norms on D).

Anything else is a failure: `leak` (accepted, influence above 2C: DP's
sensitivity bound is broken), `inexact` (accepted, wrong per-example
gradients), `bad_refusal` (a `ValueError` naming no op) or `crash` (another
error where plain TensorFlow runs the model in that mode). A model plain
TensorFlow cannot run in a mode (a dynamic shape under XLA, a lookup table
under XLA) is `unsupported` there; one whose reference loop itself fails is
`invalid` (a generator bug).

Speed: tracing one `tf.function` per model is slow, so graph and XLA modes
trace a chunk of models in one function, each model's tape guarded on its
own (a refusal is a `ValueError` at trace time, caught for that model alone,
the others trace on); a chunk that fails when it runs (a model XLA cannot
compile) is bisected until the model that fails runs alone.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

B, K, V = 4, 6, 6          # batch, width, vocabulary (ids in [0, V))
# K != B: a constant with a dimension of the batch size may be taken for
# a batch of examples (tf_pxg refuses it, conservatively), which would hide
# every model that uses one.
MODES = ("eager", "function", "jit")
OK_STATUSES = ("refused", "exact", "unsupported")
FAIL_STATUSES = ("leak", "inexact", "bad_refusal", "crash", "invalid")

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


# Data ---------------------------------------------------------------------


EXTREME_X = np.arange(25.0, 25.0 - K, -1.0).astype(np.float32)


def make_data(seed: int):
  """(D, D'): `x, ids, y` of B ordinary examples (ids: 1 to 3 tokens in
  [1, V - 2], then padding 0), and the same batch with example 0 replaced
  by an extreme one (large x, every id V - 1, y = 20)."""
  rng = np.random.RandomState(seed)
  x = rng.standard_normal((B, K)).astype(np.float32)
  ids = np.zeros((B, K), np.int32)
  for b in range(B):
    n = rng.randint(1, K)
    ids[b, :n] = rng.randint(1, V - 1, size=n)
  y = rng.standard_normal((B, K)).astype(np.float32)
  x2, ids2, y2 = x.copy(), ids.copy(), y.copy()
  x2[0], ids2[0], y2[0] = EXTREME_X, V - 1, 20.0
  return ((tf.constant(x), tf.constant(ids), tf.constant(y)),
          (tf.constant(x2), tf.constant(ids2), tf.constant(y2)))


# Judging ------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
  composition: str
  mode: str
  status: str
  influence: float = float("nan")
  bound: float = float("nan")
  error: str = ""
  seed: int = 0
  data_seed: int = 0

  @property
  def failed(self):
    return self.status in FAIL_STATUSES

  def describe(self):
    s = (f"[{self.mode}] {self.status}: {self.composition!r} (model seed "
         f"{self.seed}, data seed {self.data_seed})")
    if self.status in ("leak", "inexact", "exact"):
      s += f" influence {self.influence:.4g} vs 2C = {self.bound:.4g}"
    if self.error:
      s += f"; {self.error}"
    return s


class _Refusal(ValueError):
  """The DP train step's refusal of a data-dependent state write."""


def _forward(model: Model, data):
  """The forward pass under `tf_pxg.GradientTape` (persistent), then the DP
  train step's refusal of a data-dependent state write."""
  from tf_pxg.gradient_tape import GradientTape  # noqa: PLC0415
  model.reset_state()
  pre = model.prestats(*data)            # before the tape records
  tape = GradientTape(persistent=True, examples=data)
  with tape:
    losses = model.losses(*data, pre=pre)
  writes = tape.data_dependent_writes(data, model.state_variables)
  if writes:
    raise _Refusal(f"{writes[0][0].describe()} writes state from the data")
  return tape, losses


def _pxg_first(model: Model, d):
  """Stage 1 on D: the forward pass and `per_example_gradient` (where the
  engine refuses a model, before any clipping)."""
  tape, losses = _forward(model, d)
  return tape, losses, tape.per_example_gradient(losses, [model.w])[0]


def _pxg_rest(model: Model, tape, losses, d2, clip):
  """Stage 2: `clipped_gradient_sum` on D (same tape) and on D'."""
  cs = tape.clipped_gradient_sum(losses, [model.w], clip)[0][0]
  tape2, losses2 = _forward(model, d2)
  cs2 = tape2.clipped_gradient_sum(losses2, [model.w], clip)[0][0]
  return cs, cs2


def _pxg_sum(model: Model, d, clip):
  """The graph and XLA modes' question: `clipped_gradient_sum` on one
  batch (asked of D and of D' by two calls of one traced function, so each
  model traces once per mode). Per-example gradients are compared eagerly;
  here a wrong one shows in the clipped sums (the clip, at the median norm,
  is active for half the examples)."""
  tape, losses = _forward(model, d)
  return tape.clipped_gradient_sum(losses, [model.w], clip)[0][0]


def _pxg(model: Model, d, d2, clip):
  """What DP training computes, under `tf_pxg.GradientTape`: per-example
  gradients and the clipped sum on D, the clipped sum on D'. Raises the
  tape's refusal, or the train step's (a data-dependent state write)."""
  tape, losses, pe = _pxg_first(model, d)
  cs, cs2 = _pxg_rest(model, tape, losses, d2, clip)
  return pe, cs, cs2


def _plain(model: Model, d):
  """Plain TensorFlow's batch gradient (does the model run in a mode?)."""
  model.reset_state()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(model.losses(*d))
  return tape.gradient(loss, model.w)


@dataclasses.dataclass
class _Reference:
  pe: np.ndarray          # [B, K, K] on D
  cs: np.ndarray          # clipped sum on D
  cs2: np.ndarray         # clipped sum on D'
  clip: float
  scale: float            # magnitude for the tolerance


def _clipped(pe: np.ndarray, losses: np.ndarray, clip: float) -> np.ndarray:
  flat = pe.reshape(pe.shape[0], -1).astype(np.float64)
  norms = np.sqrt(np.sum(flat * flat, axis=1))
  finite = np.isfinite(norms) & np.isfinite(losses)
  with np.errstate(all="ignore"):
    c = np.where(finite, np.minimum(1.0, clip / np.maximum(norms, 1e-30)),
                 0.0)
  flat = np.where(finite[:, None], flat, 0.0)
  return (c[:, None] * flat).sum(0).reshape(pe.shape[1:])


def _single(model: Model, data, b: int):
  """Example b alone (a batch of one) under a plain `tf.GradientTape`: its
  loss and the gradient of its loss with respect to W (zeros if
  unconnected)."""
  model.reset_state()
  with tf.GradientTape() as tape:
    loss = model.losses(*(t[b:b + 1] for t in data))
  g = tape.gradient(loss, model.w)
  g = tf.zeros_like(model.w) if g is None else tf.convert_to_tensor(g)
  return g.numpy(), float(loss.numpy()[0])


def reference(model: Model, d, d2) -> _Reference:
  """The plain `tf.GradientTape` loop over single examples (as
  `tf_pxg.testing.reference_per_example_gradients`, which also returns each
  example's loss here), on D and on D'. D' differs from D in example 0
  only, and each example runs alone, so D' needs one more run."""
  runs = [_single(model, d, b) for b in range(B)]
  pe = np.stack([g for g, _ in runs])
  losses = np.array([l for _, l in runs])
  g0, l0 = _single(model, d2, 0)
  pe2, losses2 = pe.copy(), losses.copy()
  pe2[0], losses2[0] = g0, l0
  norms = np.sqrt(np.sum(pe.reshape(B, -1).astype(np.float64) ** 2, 1))
  finite = norms[np.isfinite(norms)]
  clip = float(np.median(finite)) if finite.size else 1.0
  clip = max(clip, 1e-3)
  scale = max(float(np.max(np.abs(pe[np.isfinite(pe)]), initial=0.0)),
              clip)
  return _Reference(pe, _clipped(pe, losses, clip), _clipped(pe2, losses2,
                                                             clip),
                    clip, scale)


RTOL = {"eager": 1e-4, "function": 1e-4, "jit": 1e-3}


def _judge(comp: str, mode: str, ref: _Reference, pe, cs, cs2, **kw):
  rtol = RTOL[mode]
  if pe is None:                       # graph and XLA: clipped sums only
    pe = ref.pe
  pe, cs, cs2 = (np.asarray(a, np.float64) for a in (pe, cs, cs2))
  bound = 2.0 * ref.clip
  influence = float(np.linalg.norm((cs - cs2).ravel()))
  tol_pe = rtol * max(ref.scale, 1e-12) + 64 * 1.2e-7 * ref.scale
  tol_cs = rtol * B * ref.clip + 64 * 1.2e-7 * B * ref.scale
  same_finite = np.array_equal(np.isfinite(pe), np.isfinite(ref.pe))
  with np.errstate(invalid="ignore"):
    exact = (same_finite and
             np.all(np.abs(np.nan_to_num(pe - ref.pe)) <= tol_pe) and
             np.all(np.abs(cs - ref.cs) <= tol_cs) and
             np.all(np.abs(cs2 - ref.cs2) <= tol_cs))
  leak = not math.isfinite(influence) or influence > bound * (1 + rtol) + (
      tol_cs)
  status = "leak" if leak else "exact" if exact else "inexact"
  err = ""
  if status == "inexact":
    err = (f"max |pe - ref| {np.nanmax(np.abs(pe - ref.pe)):.3g} "
           f"(tol {tol_pe:.2g}), |cs - ref| "
           f"{np.max(np.abs(cs - ref.cs)):.3g}, |cs' - ref'| "
           f"{np.max(np.abs(cs2 - ref.cs2)):.3g} (tol {tol_cs:.2g})")
  return Outcome(comp, mode, status, influence, bound, err, **kw)


def _error_outcome(comp, mode, err, model, d, **kw) -> Outcome:
  """A refusal, or an error that plain TensorFlow shares (unsupported), or a
  crash."""
  msg = f"{type(err).__name__}: {err}".splitlines()[0][:300]
  if isinstance(err, ValueError) and not isinstance(
      err, tf.errors.OpError):
    return Outcome(comp, mode, "refused" if "op '" in str(err) else
                   "bad_refusal", error=msg, **kw)
  try:
    _plain(model, d)
  except Exception as plain:  # noqa: BLE001  (the model itself is broken)
    return Outcome(comp, mode, "invalid", error=(
        f"plain TensorFlow fails eagerly too: {type(plain).__name__}: "
        f"{plain}").splitlines()[0][:300], **kw)
  if mode != "eager":
    try:
      tf.function(_plain_fn(model), jit_compile=(mode == "jit"),
                  autograph=False)(*d)
    except Exception:  # noqa: BLE001  (plain TF cannot run it in this mode)
      return Outcome(comp, mode, "unsupported", error=msg, **kw)
  return Outcome(comp, mode, "crash", error=msg + " | " + "".join(
      traceback.format_exception_only(type(err), err))[-300:], **kw)


def _plain_fn(model):
  def fn(x, ids, y):
    return _plain(model, (x, ids, y))
  return fn


@dataclasses.dataclass
class _Case:
  index: int
  comp: str
  model: Model
  seed: int
  data_seed: int
  ref: Optional[_Reference] = None
  ref_error: Optional[str] = None

  @property
  def kw(self):
    return dict(seed=self.seed, data_seed=self.data_seed)

  def take_reference(self, d, d2) -> None:
    """Computes the single-example reference, or keeps why it failed."""
    try:
      self.ref = reference(self.model, d, d2)
    except Exception as err:  # noqa: BLE001  (a generator bug)
      self.ref_error = f"{type(err).__name__}: {err}".splitlines()[0][:300]


class _Chunk:
  """A chunk of models traced in one `tf.function` (graph or XLA): each
  model's tapes in a function of its own, called from the chunk's, so a
  model refused while its function traces leaves no op in the chunk's
  graph and the others trace on. The clip norms are an input: the
  reference (which gives them) is computed only for the models some mode
  accepted."""

  def __init__(self, cases: List[_Case], mode: str, d, d2):
    self.cases, self.mode, self.d, self.d2 = cases, mode, d, d2
    self.trace_errors: Dict[int, Exception] = {}
    self.run_error: Optional[Exception] = None
    self.concrete = None
    spec = [tf.TensorSpec(t.shape, t.dtype) for t in (*d, *d2)] + [
        tf.TensorSpec([len(cases)], tf.float32)]
    try:
      self.concrete = tf.function(
          self._fn, jit_compile=(mode == "jit"),
          autograph=False).get_concrete_function(*spec)
    except Exception as err:  # noqa: BLE001  (the chunk itself)
      self.run_error = err

  def _fn(self, x, ids, y, x2, ids2, y2, clips):
    out = {}
    def model_fn(model):
      return tf.function(lambda x, ids, y, clip: _pxg_sum(
          model, (x, ids, y), clip), autograph=False)

    for i, c in enumerate(self.cases):
      inner = model_fn(c.model)
      try:  # One trace; D and D' are two calls of it.
        out[str(i)] = (inner(x, ids, y, clips[i]),
                       inner(x2, ids2, y2, clips[i]))
      except Exception as err:  # noqa: BLE001
        self.trace_errors[i] = err
    return out

  def accepted(self, i: int) -> bool:
    return self.run_error is None and i not in self.trace_errors

  def outcomes(self) -> List[Outcome]:
    mode, d, d2 = self.mode, self.d, self.d2
    results = None
    if self.run_error is None:
      clips = tf.constant([c.ref.clip if c.ref else 1.0 for c in self.cases],
                          tf.float32)
      try:
        results = self.concrete(*d, *d2, clips)
      except Exception as err:  # noqa: BLE001  (when it runs: bisect)
        self.run_error = err
    if results is None:
      if len(self.cases) == 1:
        c = self.cases[0]
        return [_error_outcome(c.comp, mode, self.run_error, c.model, d,
                               **c.kw)]
      half = len(self.cases) // 2
      return (_Chunk(self.cases[:half], mode, d, d2).outcomes() +
              _Chunk(self.cases[half:], mode, d, d2).outcomes())
    out = []
    for i, c in enumerate(self.cases):
      if i in self.trace_errors:
        out.append(_error_outcome(c.comp, mode, self.trace_errors[i],
                                  c.model, d, **c.kw))
      elif c.ref is None:
        out.append(Outcome(c.comp, mode, "invalid", error=c.ref_error,
                           **c.kw))
      else:
        cs, cs2 = (t.numpy() for t in results[str(i)])
        out.append(_judge(c.comp, mode, c.ref, None, cs, cs2, **c.kw))
    return out


def check_models(compositions: Sequence, modes: Sequence[str] = MODES,
                 data_seed: int = 0, chunk: int = 25,
                 seeds: Optional[Sequence[int]] = None) -> List[Outcome]:
  """Judges each composition (a `Composition` or its string) in each mode;
  one `Outcome` per (model, mode), in the order of `compositions` and then
  `modes`. `seeds` are the models' kernel seeds (default 0).

  Order of work (each model still runs in every mode): eagerly up to
  `per_example_gradient` (a refusal comes before any clipping; the
  persistent tape is kept), then each graph/XLA chunk is traced; the
  reference runs only for the models some mode accepted, and only those
  go on (eagerly, on the kept tape) or are called (the traced chunks) with
  their clip norm."""
  d, d2 = make_data(data_seed)
  cases = []
  for j, comp in enumerate(compositions):
    seed = seeds[j] if seeds is not None else 0
    cases.append(_Case(j, str(comp), Model(Composition.parse(str(comp)),
                                           seed), seed, data_seed))
  eager_errors: Dict[int, Exception] = {}
  eager_first = {}
  if "eager" in modes:
    with _timed("eager"):
      for c in cases:
        try:
          eager_first[c.index] = _pxg_first(c.model, d)
        except Exception as err:  # noqa: BLE001
          eager_errors[c.index] = err
  chunks = {}
  for m in modes:
    if m != "eager":
      with _timed(f"trace {m}"):
        chunks[m] = [_Chunk(cases[s:s + chunk], m, d, d2)
                     for s in range(0, len(cases), chunk)]
  with _timed("reference"):
    for k, c in enumerate(cases):
      wanted = c.index in eager_first or any(
          ch[k // chunk].accepted(k % chunk) for ch in chunks.values())
      if wanted:
        c.take_reference(d, d2)
  outcomes = {}
  with _timed("eager"):
    for c in cases:
      if "eager" not in modes:
        break
      if c.index in eager_errors:
        outcomes[(c.index, "eager")] = _error_outcome(
            c.comp, "eager", eager_errors[c.index], c.model, d, **c.kw)
      elif c.ref is None:
        outcomes[(c.index, "eager")] = Outcome(c.comp, "eager", "invalid",
                                               error=c.ref_error, **c.kw)
      else:
        outcomes[(c.index, "eager")] = _run_eager(
            c, eager_first.pop(c.index), d2)
  for m, chs in chunks.items():
    with _timed(f"run {m}"):
      for ch in chs:
        for c, o in zip(ch.cases, ch.outcomes()):
          outcomes[(c.index, m)] = o
  return [outcomes[(j, m)] for j in range(len(compositions)) for m in modes]


# CPU seconds (`time.process_time`) spent per phase, summed over calls.
TIMINGS: Dict[str, float] = {}


class _timed:
  def __init__(self, name):
    self.name = name

  def __enter__(self):
    self.t0 = time.process_time()

  def __exit__(self, *exc):
    TIMINGS[self.name] = TIMINGS.get(self.name, 0.0) + (
        time.process_time() - self.t0)


def _run_eager(case: _Case, first, d2) -> Outcome:
  tape, losses, pe = first
  try:
    cs, cs2 = _pxg_rest(case.model, tape, losses, d2, case.ref.clip)
  except Exception as err:  # noqa: BLE001
    return _error_outcome(case.comp, "eager", err, case.model, d2, **case.kw)
  return _judge(case.comp, "eager", case.ref, pe.numpy(), cs.numpy(),
                cs2.numpy(), **case.kw)


def _unguarded(model: Model, d, d2, clip):
  """What an engine that trusted every op would compute: each example's
  row of the batch Jacobian (cross-example terms included) and the sums
  clipped with those rows, by plain TensorFlow."""
  def rows(data):
    model.reset_state()
    with tf.GradientTape(persistent=True) as tape:
      losses = model.losses(*data)
    jac = tape.jacobian(losses, model.w, experimental_use_pfor=False)
    return (tf.zeros([B, K, K]) if jac is None else jac).numpy(), (
        losses.numpy())
  pe, losses = rows(d)
  pe2, losses2 = rows(d2)
  return pe, _clipped(pe, losses, clip), _clipped(pe2, losses2, clip)


def unguarded(compositions: Sequence, data_seed: int = 0,
              seeds: Optional[Sequence[int]] = None) -> List[Outcome]:
  """The generator's teeth: each composition judged as if the engine had
  accepted it and followed the batch (the mode is reported as
  "unguarded"). A composition that mixes examples comes out `leak` or
  `inexact` here; one that keeps them apart comes out `exact`."""
  d, d2 = make_data(data_seed)
  out = []
  for j, comp in enumerate(compositions):
    seed = seeds[j] if seeds is not None else 0
    model = Model(Composition.parse(str(comp)), seed)
    kw = dict(seed=seed, data_seed=data_seed)
    try:
      ref = reference(model, d, d2)
      pe, cs, cs2 = _unguarded(model, d, d2, ref.clip)
    except Exception as err:  # noqa: BLE001
      out.append(Outcome(str(comp), "unguarded", "invalid",
                         error=f"{type(err).__name__}: {err}"[:300], **kw))
      continue
    o = _judge(str(comp), "eager", ref, pe, cs, cs2, **kw)
    o.mode = "unguarded"
    out.append(o)
  return out


def summarize(outcomes: Sequence[Outcome]) -> Dict[str, Dict[str, int]]:
  """Counts per mode and status."""
  table: Dict[str, Dict[str, int]] = {}
  for o in outcomes:
    row = table.setdefault(o.mode, {})
    row[o.status] = row.get(o.status, 0) + 1
  return table


def minimize(outcome: Outcome, budget: int = 40) -> Composition:
  """A smaller composition that fails the same way in the same mode:
  drops steps and turns feeds to `const` (then variants to 0) while the
  status stays."""
  comp = Composition.parse(outcome.composition)

  def fails(c):
    o = check_models([c], [outcome.mode], data_seed=outcome.data_seed,
                     seeds=[outcome.seed])[0]
    return o.status == outcome.status

  changed = True
  while changed and budget > 0:
    changed = False
    candidates = []
    for i, s in enumerate(comp.steps):
      if s is not PARAM:
        candidates.append(Composition(comp.steps[:i] + comp.steps[i + 1:]))
    for i, s in enumerate(comp.steps):
      for k, (p, src) in enumerate(s.feeds):
        if src != "const":
          feeds = s.feeds[:k] + ((p, "const"),) + s.feeds[k + 1:]
          candidates.append(Composition(
              comp.steps[:i] + (Step(s.op, s.variant, feeds),) +
              comp.steps[i + 1:]))
      if s is not PARAM and s.variant:
        candidates.append(Composition(
            comp.steps[:i] + (Step(s.op, 0, s.feeds),) + comp.steps[i + 1:]))
    for c in candidates:
      budget -= 1
      if fails(c):
        comp, changed = c, True
        break
      if budget <= 0:
        break
  return comp


def search(n: int, start: int = 0, modes: Sequence[str] = MODES,
           chunk: int = 25, data_seeds: int = 4, **gen_kw):
  """Generates and judges models `start .. start + n - 1` (the model seed
  is the composition's seed; data seeds cycle over `data_seeds`). Returns
  (outcomes, seconds)."""
  t0 = time.time()
  outcomes = []
  by_data: Dict[int, List[int]] = {}
  for s in range(start, start + n):
    by_data.setdefault(s % data_seeds, []).append(s)
  for ds, seeds in sorted(by_data.items()):
    comps = [generate(s, **gen_kw) for s in seeds]
    outcomes += check_models(comps, modes, data_seed=ds, chunk=chunk,
                             seeds=seeds)
  return outcomes, time.time() - t0


if __name__ == "__main__":
  import argparse
  import json
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("-n", type=int, default=200)
  parser.add_argument("--start", type=int, default=0)
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--minimize", action="store_true")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  outs, secs = search(args.n, args.start, args.modes.split(","))
  print(json.dumps(summarize(outs), indent=1), f"{secs:.1f} s")
  for o in outs:
    if o.failed:
      line = o.describe()
      if args.minimize:
        line += f"\n    minimal: {minimize(o)!s}"
      print(line)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump([dataclasses.asdict(o) for o in outs], fh)
