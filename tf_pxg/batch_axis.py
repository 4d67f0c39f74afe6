"""Where the examples are: the batch axis of every data tensor.

A data tensor's *layout* is `(axis, minor)`: the examples are on `axis`,
alone (`[B]`) or merged with neighbouring rows — examples contiguous
(`minor=False`, a `[B, k]` merge as after reshaping `[B, T, d]` to
`[B*T, d]`) or interleaved (`minor=True`, `[k, B]`, as after reshaping a
time-major `[T, B, d]` to `[T*B, d]`, or `SpaceToBatchND`). `None` means
unknown; the engine then keeps its default (examples on axis 0).

`propagate(entry, layouts)` maps the layouts of an op's data inputs to those
of its outputs, through transposes, reshapes, expand/squeeze, slices,
stack/unstack, concatenation, reductions over other axes, gathers and the
operand order of contractions (MatMul, BatchMatMul, Einsum). It also says
when the op *mixes* examples: it reduces, contracts, normalises or
convolves along the batch axis. Ops without a rule keep the layout when
their output has the input's rank, else the layout becomes unknown.

Rules are one function per op family in `_RULES` (keyed by op type), each
`rule(entry, layouts) -> (output layouts, why-it-mixes or None)`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_pxg.backprop import gradient_functions

Layout = Optional[Tuple[int, bool]]
AXIS0: Layout = (0, False)
Result = Tuple[List[Layout], Optional[str]]

_RULES: Dict[str, Callable] = {}


def _rule(*op_types):
  def deco(fn):
    for t in op_types:
      _RULES[t] = fn
    return fn
  return deco


def _attr(entry, name, default=None):
  try:
    v = gradient_functions.get_attr(entry, name)
  except (ValueError, KeyError, AttributeError, TypeError):
    return default
  return default if v is None else v


def _static(t):
  v = tf.get_static_value(t)
  return None if v is None else np.asarray(v)


def _rank(t) -> Optional[int]:
  return t.shape.rank


def _all(entry, layout: Layout) -> List[Layout]:
  return [layout] * len(entry.outputs)


def _data(layouts: Dict[int, Layout]) -> List[Tuple[int, Layout]]:
  return sorted(layouts.items())


def _agree(layouts: Sequence[Layout]) -> Layout:
  known = {l for l in layouts}
  return known.pop() if len(known) == 1 else None


def _mixes(entry, why: str) -> Result:
  return [None] * len(entry.outputs), why


# Axis permutations -----------------------------------------------------------


@_rule("Transpose", "ConjugateTranspose")
def _transpose(entry, layouts):
  (i, lay), = _data(layouts)[:1]
  perm = _static(entry.inputs[1])
  if i != 0 or lay is None or perm is None:
    return _all(entry, None), None
  return _all(entry, (list(perm.ravel()).index(lay[0]), lay[1])), None


@_rule("ExpandDims")
def _expand_dims(entry, layouts):
  lay = layouts.get(0)
  dim, rank = _static(entry.inputs[1]), _rank(entry.inputs[0])
  if lay is None or dim is None or rank is None:
    return _all(entry, None), None
  d = int(dim.ravel()[0]) % (rank + 1)
  return _all(entry, (lay[0] + (1 if d <= lay[0] else 0), lay[1])), None


@_rule("Squeeze")
def _squeeze(entry, layouts):
  lay = layouts.get(0)
  shape = entry.inputs[0].shape
  if lay is None or shape.rank is None:
    return _all(entry, None), None
  dims = [d % shape.rank for d in _attr(entry, "squeeze_dims", [])]
  if not dims:
    dims = [a for a, n in enumerate(shape) if n == 1]
  if lay[0] in dims:
    return _all(entry, None), None
  return _all(entry, (lay[0] - sum(d < lay[0] for d in dims), lay[1])), None


def _prod(dims) -> Optional[int]:
  dims = list(dims)
  if any(d is None for d in dims):
    return None
  return int(np.prod(dims, dtype=np.int64)) if dims else 1


@_rule("Reshape")
def _reshape(entry, layouts, batch_size=None):
  lay = layouts.get(0)
  src, dst = entry.inputs[0].shape, entry.outputs[0].shape
  if lay is None or src.rank is None or dst.rank is None:
    return _all(entry, None), None
  a, minor = lay
  pre, post = _prod(src[:a]), _prod(src[a + 1:])
  if pre is None or post is None:
    return _all(entry, None), None
  for j in range(dst.rank):
    dpre, dpost = _prod(dst[:j]), _prod(dst[j + 1:])
    if dpre is None or dpost is None:
      continue
    if dpre == pre and dpost == post:
      return _all(entry, (j, minor)), None
    if dpre == pre and dpost < post and post % dpost == 0 and not minor:
      return _all(entry, (j, False)), None  # [B, k] merged.
    if dpre < pre and pre % dpre == 0 and dpost == post and not minor:
      return _all(entry, (j, True)), None  # [k, B] merged.
    # A merged axis split again: the examples are the axis j that leaves the
    # same product on the side of the other rows (total sizes are equal).
    if ((minor and dpost == post and dpre > pre and dpre % pre == 0) or
        (not minor and dpre == pre and dpost > post and dpost % post == 0)):
      if dst[j] is None or dst[j] == batch_size:
        return _all(entry, (j, False)), None
  return _all(entry, None), None


# Slicing, stacking, concatenation --------------------------------------------


@_rule("StridedSlice")
def _strided_slice(entry, layouts):
  lay = layouts.get(0)
  if lay is None or _attr(entry, "ellipsis_mask", 0) or _attr(
      entry, "new_axis_mask", 0):
    return _all(entry, None), None
  shrink = int(_attr(entry, "shrink_axis_mask", 0))
  a = lay[0]
  if shrink >> a & 1:
    return _all(entry, None), None
  return _all(entry, (a - bin(shrink & ((1 << a) - 1)).count("1"),
                      lay[1])), None


@_rule("Unpack")
def _unpack(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None or rank is None:
    return _all(entry, None), None
  axis = int(_attr(entry, "axis", 0)) % rank
  if axis == lay[0]:
    return _all(entry, None), None
  return _all(entry, (lay[0] - (axis < lay[0]), lay[1])), None


@_rule("Pack")
def _pack(entry, layouts):
  lay = _agree(list(layouts.values()))
  rank = _rank(entry.outputs[0])
  if lay is None or rank is None or len(layouts) != len(entry.inputs):
    return _all(entry, None), None
  axis = int(_attr(entry, "axis", 0)) % rank
  return _all(entry, (lay[0] + (axis <= lay[0]), lay[1])), None


def _along(entry, layouts, axis_index: int, tensors: Sequence[int]):
  lay = _agree([layouts[i] for i in tensors if i in layouts])
  axis = _static(entry.inputs[axis_index])
  rank = _rank(entry.outputs[0])
  if lay is None or axis is None or rank is None:
    return _all(entry, None), None
  if int(axis.ravel()[0]) % rank == lay[0]:
    return _all(entry, None), None
  return _all(entry, lay), None


@_rule("ConcatV2")
def _concat(entry, layouts):
  return _along(entry, layouts, len(entry.inputs) - 1,
                range(len(entry.inputs) - 1))


@_rule("Split")
def _split(entry, layouts):
  return _along(entry, layouts, 0, [1])


@_rule("SplitV")
def _split_v(entry, layouts):
  return _along(entry, layouts, 2, [0])


# Reductions and normalisations along an axis ---------------------------------

_REDUCTIONS = ("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "All",
               "Any")


@_rule(*_REDUCTIONS)
def _reduction(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  axes = _static(entry.inputs[1])
  if lay is None or rank is None or axes is None:
    return _all(entry, None), None
  axes = {int(x) % rank for x in axes.ravel()} if rank else set()
  keep = _attr(entry, "keep_dims", False)
  if lay[0] in axes:
    return ([lay if keep else None] * len(entry.outputs),
            f"reduces over the batch axis {lay[0]} (batch statistics)")
  if keep:
    return _all(entry, lay), None
  return _all(entry, (lay[0] - sum(x < lay[0] for x in axes), lay[1])), None


@_rule("Cumsum", "Cumprod", "CumulativeLogsumexp")
def _cumulative(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  axis = _static(entry.inputs[1])
  if lay is None or rank is None or axis is None:
    return _all(entry, None), None
  if int(axis.ravel()[0]) % rank == lay[0]:
    return _mixes(entry, f"accumulates along the batch axis {lay[0]}")
  return _all(entry, lay), None


@_rule("ArgMax", "ArgMin")
def _arg(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  axis = _static(entry.inputs[1])
  if lay is None or rank is None or axis is None:
    return _all(entry, None), None
  axis = int(axis.ravel()[0]) % rank
  if axis == lay[0]:
    return _mixes(entry, f"compares examples along the batch axis {lay[0]}")
  return _all(entry, (lay[0] - (axis < lay[0]), lay[1])), None


@_rule("Softmax", "LogSoftmax")
def _softmax(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is not None and rank and rank > 1 and lay[0] == rank - 1:
    return _mixes(entry, "normalises along the batch axis")
  return _all(entry, lay), None


# Ops whose data format fixes the batch on axis 0 (N of NHWC/NCHW).
_BATCH_FIRST = (
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv3DBackpropInputV2", "MaxPool", "MaxPoolV2", "MaxPool3D", "AvgPool",
    "AvgPool3D", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "ExtractImagePatches", "ExtractVolumePatches", "ResizeBilinear",
    "ResizeNearestNeighbor")


@_rule(*_BATCH_FIRST)
def _batch_first(entry, layouts):
  i = 2 if entry.op_type.startswith(("Conv2DBackpropInput",
                                     "Conv3DBackpropInput")) else 0
  lay = layouts.get(i)
  if lay is not None and lay[0] != 0:
    return _mixes(entry, f"takes the batch on axis 0 but the examples are "
                  f"on axis {lay[0]} (it would convolve or pool across "
                  "examples)")
  return _all(entry, lay), None


@_rule("SpaceToBatchND", "SpaceToBatch")
def _to_batch_minor(entry, layouts):
  lay = layouts.get(0)
  return _all(entry, None if lay is None else (0, True)), None


@_rule("BatchToSpaceND", "BatchToSpace")
def _from_batch_minor(entry, layouts):
  lay = layouts.get(0)
  return _all(entry, None if lay is None else AXIS0), None


# Gathers ---------------------------------------------------------------------


@_rule("GatherV2", "ResourceGather")
def _gather(entry, layouts):
  axis = 0
  if entry.op_type == "GatherV2":
    a = _static(entry.inputs[2])
    if a is None:
      return _all(entry, None), None
    axis = int(a.ravel()[0])
  if _attr(entry, "batch_dims", 0):
    return _all(entry, None), None
  params, ids = layouts.get(0), layouts.get(1)
  if ids is not None and params is None:
    return _all(entry, (axis + ids[0], ids[1])), None
  if params is not None and ids is None and 1 not in layouts:
    rank_ids = _rank(entry.inputs[1])
    if rank_ids is None or params[0] == axis:
      return _all(entry, None), None
    shift = 0 if params[0] < axis else rank_ids - 1
    return _all(entry, (params[0] + shift, params[1])), None
  return _all(entry, None), None


# Contractions ----------------------------------------------------------------


def _contract(entry, subs: Sequence[str], out: str, layouts) -> Result:
  """Layouts for an einsum-like op `subs[0],subs[1]->out`."""
  found = set()
  for i, lay in layouts.items():
    if lay is None:
      return _all(entry, None), None
    if i >= len(subs) or lay[0] >= len(subs[i]):
      return _all(entry, None), None
    letter = subs[i][lay[0]]
    if letter not in out:
      return _mixes(entry, f"contracts the batch axis {lay[0]} of operand "
                    f"{i} (a sum over examples)")
    found.add((out.index(letter), lay[1]))
  if len(found) != 1:
    return _mixes(entry, "pairs the examples of one operand with those of "
                  "another (an outer product over the batch)")
  return _all(entry, found.pop()), None


@_rule("MatMul")
def _matmul(entry, layouts):
  a = "ji" if _attr(entry, "transpose_a", False) else "ij"
  b = "kj" if _attr(entry, "transpose_b", False) else "jk"
  return _contract(entry, [a, b], "ik", layouts)


@_rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(entry, layouts):
  rx, ry = _rank(entry.inputs[0]), _rank(entry.inputs[1])
  if rx is None or ry is None:
    return _all(entry, None), None
  ro = max(rx, ry)
  letters = "abcdefgh"[:ro - 2]
  x = letters[ro - rx:] + ("ji" if _attr(entry, "adj_x", False) else "ij")
  y = letters[ro - ry:] + ("kj" if _attr(entry, "adj_y", False) else "jk")
  return _contract(entry, [x, y], letters + "ik", layouts)


def einsum_subscripts(equation: str, ranks: Sequence[Optional[int]]):
  """(operand subscripts, output subscript) with ellipses expanded."""
  lhs, out = equation.replace(" ", "").split("->")
  ops = lhs.split(",")
  if "." not in equation:
    return ops, out
  if any(r is None for r in ranks):
    return None
  free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
  n = max(r - len(s.replace("...", "")) for s, r in zip(ops, ranks)
          if "..." in s)
  ell = "".join(free[:n])
  ops = [s.replace("...", ell[n - (r - len(s.replace("...", ""))):])
         for s, r in zip(ops, ranks)]
  return ops, out.replace("...", ell)


@_rule("Einsum")
def _einsum(entry, layouts):
  eq = _attr(entry, "equation")
  if isinstance(eq, bytes):
    eq = eq.decode()
  parsed = einsum_subscripts(eq or "", [_rank(t) for t in entry.inputs])
  if not eq or parsed is None:
    return _all(entry, None), None
  return _contract(entry, parsed[0], parsed[1], layouts)


# Default ---------------------------------------------------------------------


@_rule("OneHot")
def _one_hot(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None or rank is None:
    return _all(entry, None), None
  axis = int(_attr(entry, "axis", -1))
  axis = rank if axis == -1 else axis
  return _all(entry, (lay[0] + (axis <= lay[0]), lay[1])), None


def _default(entry, layouts) -> Result:
  """Same layout where the output has the input's rank; binary elementwise
  ops broadcast (ranks aligned from the right); anything else: unknown."""
  out_rank = _rank(entry.outputs[0]) if entry.outputs else None
  if out_rank is None:
    return _all(entry, None), None
  moved = []
  for i, lay in layouts.items():
    rank = _rank(entry.inputs[i])
    if lay is None or rank is None:
      return _all(entry, None), None
    if rank == out_rank:
      moved.append(lay)
    elif len(entry.inputs) >= 2 and rank < out_rank:
      moved.append((lay[0] + out_rank - rank, lay[1]))
    else:
      return _all(entry, None), None
  return _all(entry, _agree(moved)), None


def propagate(entry, layouts: Dict[int, Layout],
              batch_size: Optional[int] = None) -> Result:
  """Layouts of `entry`'s outputs from those of its data inputs.

  Args:
    entry: a recorded op.
    layouts: input index -> layout, for the inputs that carry examples.
    batch_size: B if static (tells a split of merged rows from other splits).

  Returns:
    (one layout per output, None or the reason the op mixes examples).
  """
  rule = _RULES.get(entry.op_type)
  if rule is _reshape:
    return rule(entry, layouts, batch_size)
  if rule is not None:
    return rule(entry, layouts)
  return _default(entry, layouts)
