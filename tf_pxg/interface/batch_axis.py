"""Where the examples are, and the allowlist of ops that keep them apart.

A data tensor's *layout* is `(axis, minor)`: the examples are on `axis`,
alone (`[B]`) or merged with neighbouring rows — examples contiguous
(`minor=False`, a `[B, k]` merge as after reshaping `[B, T, d]` to
`[B*T, d]`, or the ragged rows of a string split) or interleaved
(`minor=True`, `[k, B]`, as after reshaping a time-major `[T, B, d]` to
`[T*B, d]`, or `SpaceToBatchND`). `None` means the examples' position is
lost. A TensorList (the scalar variant a `tf.TensorArray` is in a
`tf.function`) has the layout of its elements: the list's index is never
the batch axis (see the TensorLists section).

**The allowlist contract.** DP-SGD clips each example's gradient, which
bounds its influence only if example b's loss depends on example b alone.
So every op on the data path — from the model's inputs to the per-example
losses, before and after the first parameter — must be *known* to keep the
rows of different examples apart. `_RULES` is that allowlist: op type ->
`rule(entry, layouts) -> (output layouts, Mixing or None)`, which says where
the op puts the batch axis (through transposes, reshapes, slices, gathers,
the operand order of contractions...) and when it mixes examples (reduces,
contracts, sorts, reverses, rolls, gathers or slices along the batch axis,
pairs the examples of two operands, normalises with batch statistics).
An op type that is not on the list mixes by definition: `propagate` reports
it, and the engine (`tf_pxg.interface.refusals.check_examples_independent`) refuses
it with an error naming the op and its Keras layer. A rule that cannot
prove where the examples go (a permutation that is not static, say) reports
that too, rather than guessing. Users add their own row-wise ops with
`register_row_wise`; an op type with a per-example rule (`tf_pxg.register`)
and no entry here is row-wise by that rule's contract, and moves the batch
axis as its `Rule.layouts` says (default `elementwise`), so a rule author
states both in the rule's file.

Two neighbours use these layouts: `tf_pxg.interface.batch_copies` finds parameters
copied along the batch axis, and `tf_pxg.interface.normalise` moves the examples where
an interface's per-example rule takes them.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_pxg import registry
from tf_pxg.interface import value_shapes
from tf_pxg.tape import recording

Layout = Optional[Tuple[int, bool]]
AXIS0: Layout = (0, False)

# Kinds of mixing. A sum over the batch is what a scalar per-example target
# is (`tape.gradient(tf.reduce_sum(losses))`); every other kind is refused
# whatever the target.
REDUCES = "reduces"
MIXES = "mixes"


class Mixing(NamedTuple):
  """Why an op mixes examples: `kind` (REDUCES or MIXES) and the reason,
  a phrase that completes "<op> ..."."""
  kind: str
  why: str


Result = Tuple[List[Layout], Optional[Mixing]]
Rule = Callable[..., Result]

_RULES: Dict[str, Rule] = {}


def _rule(*op_types):
  def deco(fn):
    for t in op_types:
      _RULES[t] = fn
    return fn
  return deco


def register_row_wise(*op_types: str, rule: Optional[Rule] = None,
                      override: bool = False,
                      row_inputs: Optional[Sequence[int]] = None) -> None:
  """Adds op types to the allowlist of ops that keep examples apart.

  Args:
    *op_types: TF op types (`tf.Operation.type`), e.g. "MyActivation".
    rule: `rule(entry, layouts) -> (output layouts, Mixing or None)`, where
      `layouts` maps the index of each input that carries examples to its
      layout `(axis, minor)`; default `elementwise` (outputs keep the
      inputs' layout, binary ops broadcasting from the right). Only register
      an op whose output rows for example b depend on example b's input rows
      alone.
    override: replace an existing entry instead of raising.
    row_inputs: the indices of the inputs that may hold rows of examples
      (default: every input, as for elementwise ops). Every other input is
      an *argument* (a shape, size, axis, seed, bound...): one value shared
      by the whole batch, so data reaching it is refused (`row_inputs`).

  Raises:
    ValueError: an op type is already on the list and `override` is False.
  """
  rule = rule or elementwise
  for t in op_types:
    if t in _RULES and not override:
      raise ValueError(
          f"Op type '{t}' is already on tf_pxg's row-wise allowlist; pass "
          "override=True to tf_pxg.register_row_wise to replace its rule.")
  for t in op_types:
    _RULES[t] = rule
    if row_inputs is not None:
      ROW_INPUTS[t] = tuple(row_inputs)
    elif override:
      ROW_INPUTS.pop(t, None)


# Which inputs of an op may hold rows of examples. Every other input is an
# *argument*: a shape, size, depth, axis, permutation, seed, slice bound,
# multiple or default value, one value for the whole batch. Whatever the data
# touches is data (`tf_pxg.interface.classify`), so an argument computed from
# the data (`tf.one_hot(ids, depth=tf.reduce_max(ids) + 1)`, `x[:, :n]` with
# `n` a longest length over the batch, a seed from token ids) lets every
# example's computation depend on the others: `arguments_from_data` refuses
# it. Op type -> indices of the row inputs (a negative index counts from the
# end); an op type absent here takes rows at every input (elementwise ops,
# contractions, per-example rules).
ROW_INPUTS: Dict[str, Tuple[int, ...]] = {
    # Axis permutations, reshapes, slices, pads, tiles: the tensor alone.
    **{t: (0,) for t in (
        "Transpose", "ConjugateTranspose", "ExpandDims", "Squeeze",
        "Reshape", "StridedSlice", "Slice", "Unpack", "Tile", "Pad", "PadV2",
        "MirrorPad", "ReverseV2", "Roll", "BroadcastTo", "OneHot",
        "Bucketize", "SplitV", "SpaceToBatchND", "SpaceToBatch",
        "BatchToSpaceND", "BatchToSpace", "StringSplitV2", "TopKV2", "TopK",
        "ArgMax", "ArgMin", "Cumsum", "Cumprod", "CumulativeLogsumexp",
        "Softmax", "LogSoftmax", "RGBToHSV", "HSVToRGB", "MaxPool",
        "MaxPoolV2", "MaxPool3D", "AvgPool", "AvgPool3D",
        "ExtractImagePatches", "ExtractVolumePatches", "ResizeBilinear",
        "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea",
        "ScaleAndTranslate", "DepthToSpace", "SpaceToDepth",
        "AdjustContrastv2", "AdjustSaturation", "AdjustHue", "LRN",
        "MaxPoolWithArgmax", "MatrixInverse", "Cholesky",
        "MatrixDeterminant", "LogMatrixDeterminant", "Qr", "Svd",
        "SelfAdjointEigV2", "MatrixBandPart", "MatrixDiagPartV3",
        "MatrixDiagV3", "MatrixExponential", "MatrixLogarithm",
        "MatrixSquareRoot", "TensorListGetItem", "TensorListPopBack",
        "TensorListResize", "TensorListStack", "TensorListFromTensor",
        "FFT", "IFFT", "RFFT", "IRFFT", "FFT2D", "IFFT2D", "RFFT2D",
        "IRFFT2D", "FFT3D", "IFFT3D", "RFFT3D", "IRFFT3D",
        # The reductions (`REDUCTIONS`): input 1 holds the axes.
        "Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "All", "Any")},
    "Split": (1,),
    "ConcatV2": tuple(range(-2, -1000, -1)),  # All but the axis (last).
    "GatherV2": (0, 1), "ResourceGather": (0, 1),
    "DenseBincount": (0, 2), "Bincount": (0, 2),
    "RaggedTensorToTensor": tuple(range(1, 1000)),  # Values, partitions.
    "MatrixSetDiagV3": (0, 1),
    "Conv2DBackpropInput": (1, 2), "Conv3DBackpropInputV2": (1, 2),
    "ImageProjectiveTransformV2": (0, 1), "ImageProjectiveTransformV3": (0, 1),
    "FusedPadConv2D": (0, 2), "FusedResizeAndPadConv2D": (0, 3),
    "TensorListSetItem": (0, 2),
    "TensorListScatter": (0, 1), "TensorListScatterV2": (0, 1),
    "TensorListGather": (0, 1),
    "LookupTableFindV2": (0, 1), "LookupTableFind": (0, 1),
    # Random draws with per-element parameters: the parameters; the shape
    # and the seed are arguments.
    "RandomGamma": (1,), "RandomPoissonV2": (1,),
    "StatelessRandomGammaV2": (2,), "StatelessRandomGammaV3": (4,),
    "StatelessRandomPoisson": (2,), "StatelessRandomBinomial": (2, 3),
    "ParameterizedTruncatedNormal": (1, 2, 3, 4),
    "StatelessParameterizedTruncatedNormal": (2, 3, 4, 5),
}


def row_inputs(entry) -> Tuple[int, ...]:
  """The indices of `entry`'s inputs that may hold rows of examples
  (`ROW_INPUTS`; every input for op types it does not list)."""
  n = len(entry.inputs)
  listed = ROW_INPUTS.get(entry.op_type)
  if listed is None:
    return tuple(range(n))
  return tuple(sorted({i % n for i in listed if -n <= i < n}))


def row_wise_op_types() -> List[str]:
  """Sorted op types on the allowlist."""
  return sorted(_RULES)


def _attr(entry, name, default=None):
  try:
    v = recording.get_attr(entry, name)
  except (ValueError, KeyError, AttributeError, TypeError,
          tf.errors.InvalidArgumentError):
    return default
  return default if v is None else v


attr = _attr  # Attribute `name` of a recorded op, or `default`.


def _static(t, partial: bool = False):
  v = tf.get_static_value(t, partial=partial)
  return None if v is None else np.asarray(v)


def _rank(t) -> Optional[int]:
  return t.shape.rank


def _all(entry, layout: Layout) -> List[Layout]:
  return [layout] * len(entry.outputs)


def _agree(layouts: Sequence[Layout]) -> Layout:
  known = {l for l in layouts}
  return known.pop() if len(known) == 1 else None


def _mixes(entry, why: str, kind: str = MIXES) -> Result:
  return [None] * len(entry.outputs), Mixing(kind, why)


def _lost(entry, why: str) -> Result:
  return _mixes(entry, f"{why}, so tf_pxg cannot tell which rows belong to "
                "which example")


def _batch_slot(values, a: int) -> Optional[int]:
  """`values[a]` of a static 1-D vector, None if unknown."""
  if values is None or values.ndim != 1 or a >= values.shape[0]:
    return None
  v = values[a]
  return None if v is None else int(v)


# Elementwise -----------------------------------------------------------------


def elementwise(entry, layouts) -> Result:
  """Outputs keep the data inputs' layout (same rank), or the layout shifted
  by broadcasting, ranks aligned from the right (binary ops). The default
  rule of `register_row_wise`."""
  out_rank = _rank(entry.outputs[0]) if entry.outputs else None
  if out_rank is None:
    return _lost(entry, "has an output of unknown rank (give its inputs a "
                 "static rank, e.g. tf.TensorSpec([None, d]) in an "
                 "input_signature)")
  moved = []
  for i, lay in layouts.items():
    rank = _rank(entry.inputs[i])
    if lay is None:
      continue  # Holds no rows of examples (a reduced value, a shape).
    if rank is None:
      return _lost(entry, f"has input {i} of unknown rank")
    if rank == out_rank:
      moved.append(lay)
    elif len(entry.inputs) >= 2 and rank < out_rank:
      moved.append((lay[0] + out_rank - rank, lay[1]))
    else:
      return _lost(entry, f"changes the rank of input {i}")
  if not moved:
    return _all(entry, None), None
  lay = _agree(moved)
  if lay is None:
    return _mixes(entry, "combines data whose examples are on different "
                  "axes (it pairs rows of different examples)")
  return _all(entry, lay), None


_ELEMENTWISE_OPS = (
    # Unary math and activations.
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos",
    "Cosh", "Digamma", "Elu", "Erf", "Erfc", "Erfinv", "Exp", "Expm1",
    "Floor", "Inv", "IsFinite", "IsInf", "IsNan", "LeakyRelu", "Lgamma",
    "Log", "Log1p", "LogicalNot", "Ndtri", "Neg", "Reciprocal", "Relu",
    "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin",
    "Sinh", "Softplus", "Softsign", "Sqrt", "Square", "Tan", "Tanh",
    "Invert", "PopulationCount", "Real", "Imag", "Conj", "Angle",
    "ComplexAbs", "Complex", "BesselI0e", "BesselI1e", "Polygamma", "Zeta",
    "Betainc", "Igamma", "Igammac",
    # Identities, casts and checks.
    "Cast", "Bitcast", "Identity", "StopGradient", "PreventGradient",
    "Snapshot", "EnsureShape", "CheckNumerics", "CheckNumericsV2",
    "OnesLike", "ZerosLike", "DebugIdentity", "DebugIdentityV2",
    "DebugIdentityV3",
    # Binary (broadcasting) and ternary.
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "RealDiv", "DivNoNan",
    "FloorDiv", "FloorMod", "TruncateDiv", "TruncateMod", "Mod", "Maximum",
    "Minimum", "Pow", "SquaredDifference", "Atan2", "Xdivy", "Xlogy",
    "Xlog1py", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
    "NotEqual", "ApproximateEqual", "LogicalAnd", "LogicalOr",
    "BitwiseAnd", "BitwiseOr", "BitwiseXor", "LeftShift", "RightShift",
    "SelectV2", "ClipByValue", "AddN", "BroadcastTo", "BiasAdd",
    "BiasAddV1",
    # Per-element string and lookup ops (keys keep their shape).
    "StringLower", "StringUpper", "StaticRegexReplace", "RegexReplace",
    "StringStrip", "StringToHashBucket", "StringToHashBucketFast",
    "StringToHashBucketStrong", "StringToNumber", "AsString",
    "LookupTableFindV2", "LookupTableFind", "Bucketize",
    # Random draws with per-element parameters (e.g. a Beta draw per
    # example): each output element depends on its own parameters.
    "RandomGamma", "StatelessRandomGammaV2", "StatelessRandomGammaV3",
    "RandomPoissonV2", "StatelessRandomPoisson", "StatelessRandomBinomial",
    "ParameterizedTruncatedNormal", "StatelessParameterizedTruncatedNormal",
)
register_row_wise(*_ELEMENTWISE_OPS)


@_rule("Select")
def _select(entry, layouts):
  """`Select(cond, x, y)`: a `[N]` condition picks rows of `x`/`y`."""
  if 0 in layouts and _rank(entry.inputs[0]) == 1 and (
      _rank(entry.inputs[1]) or 0) > 1:
    rest = {i: l for i, l in layouts.items() if i}
    if layouts[0] is None or any(l is None or l[0] != 0 for l in
                                 rest.values()) or layouts[0][0] != 0:
      return _lost(entry, "selects rows by a condition whose examples are "
                   "not on the rows' axis")
    return _all(entry, _agree([layouts[0]] + list(rest.values()))), None
  return elementwise(entry, layouts)


@_rule("IdentityN")
def _identity_n(entry, layouts):
  return [layouts.get(i) if i in layouts else AXIS0
          for i in range(len(entry.outputs))], None


# Axis permutations -----------------------------------------------------------


@_rule("Transpose", "ConjugateTranspose")
def _transpose(entry, layouts):
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  perm = _static(entry.inputs[1])
  if perm is None:
    return _lost(entry, "permutes axes by a permutation that is not static")
  return _all(entry, (list(perm.ravel()).index(lay[0]), lay[1])), None


@_rule("ExpandDims")
def _expand_dims(entry, layouts):
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  dim, rank = _static(entry.inputs[1]), _rank(entry.inputs[0])
  if dim is None or rank is None:
    return _lost(entry, "inserts an axis whose position is not static")
  d = int(dim.ravel()[0]) % (rank + 1)
  return _all(entry, (lay[0] + (1 if d <= lay[0] else 0), lay[1])), None


@_rule("Squeeze")
def _squeeze(entry, layouts):
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  shape = entry.inputs[0].shape
  if shape.rank is None:
    return _lost(entry, "squeezes a tensor of unknown rank")
  dims = [d % shape.rank for d in _attr(entry, "squeeze_dims", [])]
  if not dims:
    dims = [a for a, n in enumerate(shape) if n == 1]
  if lay[0] in dims:
    return _mixes(entry, f"squeezes away the batch axis {lay[0]} (a batch "
                  "of one example stops being a batch)")
  return _all(entry, (lay[0] - sum(d < lay[0] for d in dims), lay[1])), None


def _prod(dims) -> Optional[int]:
  dims = list(dims)
  if any(d is None for d in dims):
    return None
  return int(np.prod(dims, dtype=np.int64)) if dims else 1


@_rule("Reshape")
def _reshape(entry, layouts, batch_size=None, layout_of=None):
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  src, dst = entry.inputs[0].shape, entry.outputs[0].shape
  if src.rank is None or dst.rank is None:
    return _lost(entry, "reshapes a tensor of unknown rank")
  a, minor = lay
  pre, post = _prod(src[:a]), _prod(src[a + 1:])
  if pre is None or post is None:
    return _lost(entry, "reshapes around the batch axis with sizes that are "
                 "not static")
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
      if isinstance(batch_size, int) and batch_size and (
          dst[j] % batch_size == 0):
        # Still merged: [B*k] split into [B*k/m, m] with m dividing each
        # example's k rows (Swin's windows: [B*W*s, d] -> [B*W, s, d]).
        return _all(entry, (j, minor)), None
  if a == 0 and dst.rank and _keeps_leading_dim(entry, lay, layout_of):
    return _all(entry, (0, minor)), None  # reshape(x, [tf.shape(x)[0], ...])
  return _lost(entry, f"reshapes {src} to {dst} across the batch axis {a}")


def _keeps_leading_dim(entry, lay: Layout, layout_of) -> bool:
  """Whether a graph Reshape's target shape starts with `tf.shape(t)[0]`
  of a data tensor `t` with the reshaped tensor's layout (examples on axis
  0): a dynamic batch kept on axis 0."""
  try:
    pack = entry.inputs[1].op
    if pack.type != "Pack":
      return False
    first = pack.inputs[0].op
    if first.type != "StridedSlice" or first.inputs[0].op.type != "Shape":
      return False
    t = first.inputs[0].op.inputs[0]
    if t.name != entry.inputs[0].name and (
        layout_of is None or layout_of(t) != lay):
      return False
    begin = tf.get_static_value(first.inputs[1])
    return begin is not None and int(np.ravel(begin)[0]) == 0 and bool(
        first.get_attr("shrink_axis_mask") & 1)
  except (AttributeError, ValueError, TypeError, IndexError):
    return False


# Slicing, stacking, concatenation, padding -----------------------------------


def _full_range(begin, end, stride, begin_full: bool, end_full: bool,
                size) -> Optional[bool]:
  """Whether a slice `begin:end:stride` covers an axis of `size` whole, in
  order (None: not static)."""
  if stride is None:
    return None
  if stride != 1:
    return False
  if not begin_full and begin is None:
    return None
  if not end_full and end is None:
    return None
  if not begin_full and begin not in (0,) and not (
      size is not None and begin == -size):
    return False
  if end_full:
    return True
  if size is None:
    return None
  return end >= size


@_rule("StridedSlice")
def _strided_slice(entry, layouts):
  """Maps the sparse slice spec onto the input's axes (ellipsis, new axes
  and shrunk axes included); the batch axis must be kept whole, in order."""
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  rank = _rank(entry.inputs[0])
  n = entry.inputs[1].shape[0] if entry.inputs[1].shape.rank == 1 else None
  if rank is None or n is None:
    return _lost(entry, "slices a tensor of unknown rank")
  masks = {k: int(_attr(entry, f"{k}_mask", 0)) for k in
           ("begin", "end", "ellipsis", "new_axis", "shrink_axis")}
  begin, end, strides = (_static(entry.inputs[i], partial=True)
                         for i in (1, 2, 3))
  axis, out = 0, 0
  out_of = {}  # input axis -> (output axis or None if shrunk, spec index)
  for k in range(n):
    bit = 1 << k
    if masks["ellipsis"] & bit:
      covered = rank - sum(1 for j in range(n) if j != k and not (
          masks["new_axis"] & (1 << j)))
      for _ in range(covered):
        out_of[axis] = (out, None)
        axis, out = axis + 1, out + 1
    elif masks["new_axis"] & bit:
      out += 1
    elif masks["shrink_axis"] & bit:
      out_of[axis] = (None, k)
      axis += 1
    else:
      out_of[axis] = (out, k)
      axis, out = axis + 1, out + 1
  while axis < rank:  # Axes past the spec are kept whole.
    out_of[axis] = (out, None)
    axis, out = axis + 1, out + 1
  a = lay[0]
  out_axis, k = out_of.get(a, (None, None))
  if k is not None:
    if out_axis is None:
      return _mixes(entry, f"picks one row of the batch axis {a}")
    size = entry.inputs[0].shape[a]
    whole = _full_range(_batch_slot(begin, k), _batch_slot(end, k),
                        _batch_slot(strides, k),
                        bool(masks["begin"] >> k & 1),
                        bool(masks["end"] >> k & 1), size)
    if whole is None:
      return _lost(entry, f"slices the batch axis {a} with bounds that are "
                   "not static")
    if not whole:
      return _mixes(entry, f"slices the batch axis {a} (it drops or "
                    "reorders examples)")
  return _all(entry, (out_axis, lay[1])), None


@_rule("Slice")
def _slice(entry, layouts):
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  a = lay[0]
  begin = _batch_slot(_static(entry.inputs[1], partial=True), a)
  size = _batch_slot(_static(entry.inputs[2], partial=True), a)
  dim = entry.inputs[0].shape[a]
  if begin is None or size is None:
    return _lost(entry, f"slices the batch axis {a} with bounds that are not "
                 "static")
  if begin != 0 or not (size == -1 or (dim is not None and size == dim)):
    return _mixes(entry, f"slices the batch axis {a} (it drops examples)")
  return _all(entry, lay), None


@_rule("Unpack")
def _unpack(entry, layouts):
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  rank = _rank(entry.inputs[0])
  if rank is None:
    return _lost(entry, "unstacks a tensor of unknown rank")
  axis = int(_attr(entry, "axis", 0)) % rank
  if axis == lay[0]:
    return _mixes(entry, f"unstacks the batch axis {axis} into separate "
                  "tensors (use vectorized ops over the batch instead)")
  return _all(entry, (lay[0] - (axis < lay[0]), lay[1])), None


@_rule("Pack")
def _pack(entry, layouts):
  known = [l for l in layouts.values() if l is not None]
  if not known:
    return _all(entry, None), None
  lay = _agree(known)  # Inputs without examples (constants) stack too.
  rank = _rank(entry.outputs[0])
  if lay is None or rank is None:
    return _mixes(entry, "stacks tensors whose examples are not all on the "
                  "same axis")
  axis = int(_attr(entry, "axis", 0)) % rank
  return _all(entry, (lay[0] + (axis <= lay[0]), lay[1])), None


def _along(entry, layouts, axis_index: int, tensors: Sequence[int],
           what: str):
  known = [layouts[i] for i in tensors if i in layouts]
  if all(l is None for l in known):
    return _all(entry, None), None
  lay = _agree(known)
  axis = _static(entry.inputs[axis_index])
  rank = _rank(entry.outputs[0])
  if lay is None:
    return _mixes(entry, f"{what}s tensors whose examples are on different "
                  "axes")
  if axis is None or rank is None:
    return _lost(entry, f"{what}s along an axis that is not static")
  if int(axis.ravel()[0]) % rank == lay[0]:
    return _mixes(entry, f"{what}s along the batch axis {lay[0]}")
  return _all(entry, lay), None


@_rule("ConcatV2")
def _concat(entry, layouts):
  return _along(entry, layouts, len(entry.inputs) - 1,
                range(len(entry.inputs) - 1), "concatenate")


@_rule("Split")
def _split(entry, layouts):
  return _along(entry, layouts, 0, [1], "split")


@_rule("SplitV")
def _split_v(entry, layouts):
  return _along(entry, layouts, 2, [0], "split")


def _per_axis(entry, layouts, what: str, keeps: Callable):
  """An op with a per-axis static argument (input 1): the batch axis's entry
  must leave the examples in place (`keeps(row)`)."""
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  arg = _static(entry.inputs[1], partial=True)
  a = lay[0]
  if arg is None or arg.ndim < 1 or a >= arg.shape[0] or any(
      v is None for v in np.ravel(arg[a])):
    return _lost(entry, f"{what} with arguments that are not static")
  if not keeps(np.ravel(arg[a]).astype(np.int64)):
    return _mixes(entry, f"{what} along the batch axis {a}")
  return _all(entry, lay), None


@_rule("Tile")
def _tile(entry, layouts):
  return _per_axis(entry, layouts, "repeats rows",
                   lambda m: int(m[0]) == 1)


@_rule("Pad", "PadV2", "MirrorPad")
def _pad(entry, layouts):
  return _per_axis(entry, layouts, "pads rows", lambda p: not p.any())


def _axes_arg(entry, layouts, what: str, index: int = 1):
  """An op acting along the axes listed in input `index`: the batch axis
  must not be one of them."""
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None:
    return _all(entry, None), None
  axes = _static(entry.inputs[index])
  if axes is None or rank is None:
    return _lost(entry, f"{what} along axes that are not static")
  if lay[0] in {int(x) % rank for x in np.ravel(axes)}:
    return _mixes(entry, f"{what} along the batch axis {lay[0]}")
  return _all(entry, lay), None


@_rule("ReverseV2")
def _reverse(entry, layouts):
  return _axes_arg(entry, layouts, "reverses the order of rows")


@_rule("Roll")
def _roll(entry, layouts):
  return _axes_arg(entry, layouts, "rolls rows", index=2)


# Reductions and normalisations along an axis ---------------------------------

# The one list of reductions (input 1 holds the reduced axes).
REDUCTIONS = ("Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "All",
              "Any")


@_rule(*REDUCTIONS)
def _reduction(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None:
    return _all(entry, None), None
  axes = _static(entry.inputs[1])
  if rank is None or axes is None:
    return _lost(entry, "reduces over axes that are not static")
  axes = {int(x) % rank for x in axes.ravel()} if rank else set()
  keep = _attr(entry, "keep_dims", False)
  if lay[0] in axes:
    return ([lay if keep else None] * len(entry.outputs),
            Mixing(REDUCES, f"reduces over the batch axis {lay[0]} (batch "
                   "statistics)"))
  if keep:
    return _all(entry, lay), None
  return _all(entry, (lay[0] - sum(x < lay[0] for x in axes), lay[1])), None


@_rule("Cumsum", "Cumprod", "CumulativeLogsumexp")
def _cumulative(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None:
    return _all(entry, None), None
  axis = _static(entry.inputs[1])
  if rank is None or axis is None:
    return _lost(entry, "accumulates along an axis that is not static")
  if int(axis.ravel()[0]) % rank == lay[0]:
    return _mixes(entry, f"accumulates along the batch axis {lay[0]}")
  return _all(entry, lay), None


@_rule("ArgMax", "ArgMin")
def _arg(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None:
    return _all(entry, None), None
  axis = _static(entry.inputs[1])
  if rank is None or axis is None:
    return _lost(entry, "compares along an axis that is not static")
  axis = int(axis.ravel()[0]) % rank
  if axis == lay[0]:
    return _mixes(entry, f"compares examples along the batch axis {lay[0]}")
  return _all(entry, (lay[0] - (axis < lay[0]), lay[1])), None


@_rule("Softmax", "LogSoftmax", "TopKV2", "TopK", "RGBToHSV", "HSVToRGB")
def _last_axis(entry, layouts):
  """Ops that act along the last axis: the examples must be elsewhere."""
  known = [l for l in layouts.values() if l is not None]
  if not known:
    return _all(entry, None), None
  lay, rank = _agree(known), _rank(entry.inputs[0])
  if lay is None or rank is None or 0 not in layouts:
    return _lost(entry, "acts along the last axis of data whose batch axis "
                 "is unknown")
  if rank > 0 and lay[0] == rank - 1:
    return _mixes(entry, "compares or normalises along the batch axis (its "
                  "last axis)")
  return _all(entry, lay), None


# Fourier transforms over the last 1, 2 or 3 axes (FNet mixes tokens with
# an FFT over the sequence and hidden axes of each example).
_FFT_AXES = {"FFT": 1, "IFFT": 1, "RFFT": 1, "IRFFT": 1, "FFT2D": 2,
             "IFFT2D": 2, "RFFT2D": 2, "IRFFT2D": 2, "FFT3D": 3,
             "IFFT3D": 3, "RFFT3D": 3, "IRFFT3D": 3}


@_rule(*_FFT_AXES)
def _fft(entry, layouts):
  """A transform over the last n axes: the examples must be on another."""
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None:
    return _all(entry, None), None
  if rank is None:
    return _lost(entry, "transforms a tensor of unknown rank")
  if lay[0] >= rank - _FFT_AXES[entry.op_type]:
    return _mixes(entry, f"transforms along the batch axis {lay[0]}")
  return _all(entry, lay), None


# Ops whose data format fixes the batch on axis 0 (N of NHWC/NCHW), or that
# act on each row of axis 0 alone (the loss kernels).
_BATCH_FIRST = (
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv3DBackpropInputV2", "MaxPool", "MaxPoolV2", "MaxPool3D", "AvgPool",
    "AvgPool3D", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
    "ExtractImagePatches", "ExtractVolumePatches", "ResizeBilinear",
    "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea",
    "ScaleAndTranslate", "ImageProjectiveTransformV2",
    "ImageProjectiveTransformV3", "DepthToSpace", "SpaceToDepth",
    "AdjustContrastv2", "AdjustSaturation", "AdjustHue", "LRN",
    "MaxPoolWithArgmax", "Dilation2D", "FusedPadConv2D",
    "FusedResizeAndPadConv2D", "SparseSoftmaxCrossEntropyWithLogits",
    "SoftmaxCrossEntropyWithLogits")


@_rule(*_BATCH_FIRST)
def _batch_first(entry, layouts):
  known = {i: l for i, l in layouts.items() if l is not None}
  if not known:
    return _all(entry, None), None
  bad = [i for i, l in known.items() if l[0] != 0]
  lay = _agree(list(known.values()))
  if bad or lay is None:
    i = bad[0] if bad else min(known)
    return _mixes(entry, f"takes the batch on axis 0 but the examples are "
                  f"on axis {known[i][0]} of input {i} (it would convolve, "
                  "pool or normalise across examples)")
  return _all(entry, lay), None


@_rule("SpaceToBatchND", "SpaceToBatch")
def _to_batch_minor(entry, layouts):
  lay = layouts.get(0)
  if lay is not None and lay[0] != 0:
    return _mixes(entry, "moves space into the batch axis while the examples "
                  f"are on axis {lay[0]}")
  return _all(entry, None if lay is None else (0, True)), None


@_rule("BatchToSpaceND", "BatchToSpace")
def _from_batch_minor(entry, layouts):
  lay = layouts.get(0)
  if lay is not None and lay != (0, True):
    return _mixes(entry, "moves rows of the batch axis into space, but they "
                  "were not put there by SpaceToBatchND")
  return _all(entry, None if lay is None else AXIS0), None


# Batched linear algebra: the last two axes are the matrices -------------------

_MATRIX_OPS = (
    "MatrixSolve", "MatrixInverse", "MatrixTriangularSolve", "Cholesky",
    "MatrixDeterminant", "LogMatrixDeterminant", "Qr", "Svd",
    "SelfAdjointEigV2", "MatrixBandPart", "MatrixDiagPartV3", "MatrixDiagV3",
    "MatrixSetDiagV3", "MatrixExponential", "MatrixLogarithm",
    "MatrixSquareRoot", "BatchMatrixSolve")


@_rule(*_MATRIX_OPS)
def _matrix(entry, layouts):
  """Ops on `[..., M, N]` batches of matrices (a solve per example, say):
  the examples must be on a leading (batch) axis, which they keep."""
  known = {i: l for i, l in layouts.items() if l is not None}
  if not known:
    return _all(entry, None), None
  for i, l in known.items():
    rank = _rank(entry.inputs[i])
    if rank is None or l[0] >= rank - 2:
      return _mixes(entry, f"acts on matrices whose rows or columns are the "
                    f"examples (input {i}'s batch axis {l[0]})")
  lay = _agree(list(known.values()))
  if lay is None:
    return _mixes(entry, "combines matrices whose examples are on different "
                  "axes")
  return _all(entry, lay), None


# Ragged rows of strings (Keras' TextVectorization) ---------------------------


@_rule("StringSplitV2")
def _string_split(entry, layouts):
  """`[N]` strings -> (indices `[M, 2]`, values `[M]`, dense shape `[2]`):
  each example's tokens are consecutive rows of `indices` and `values`; the
  dense shape holds no rows of examples (None)."""
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  if lay != AXIS0:
    return _lost(entry, "splits strings whose examples are not on axis 0")
  return [AXIS0, AXIS0, None], None


@_rule("RaggedTensorToTensor")
def _ragged_to_tensor(entry, layouts):
  """(shape, values, default, row partitions...) -> dense `[N, ...]`: rows
  come back to their example, as the row partition says."""
  values = layouts.get(1)
  partitions = [layouts.get(i) for i in range(3, len(entry.inputs))]
  if values is None and all(p is None for p in partitions):
    return _all(entry, None), None
  if values != AXIS0 or any(p not in (None, AXIS0) for p in partitions):
    return _lost(entry, "rebuilds a dense tensor from rows whose examples "
                 "are not on axis 0")
  return _all(entry, AXIS0), None


@_rule("DenseBincount", "Bincount")
def _bincount(entry, layouts):
  """Counts per row of a `[B, n]` input (`binary_output` or not): each
  example counts its own values; a 1-D input counts the whole batch."""
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  if _rank(entry.inputs[0]) == 2 and lay[0] == 0:
    return _all(entry, lay), None
  return _mixes(entry, "counts values over the whole batch")


# Gathers ---------------------------------------------------------------------


@_rule("GatherV2", "ResourceGather")
def _gather(entry, layouts):
  """`params` gathered by `indices` on `axis`, `batch_dims` leading axes
  shared. The examples of `params` must not be on the gathered axis (that
  moves rows across examples); those of `indices` become the output's."""
  axis = 0
  if entry.op_type == "GatherV2":
    a = _static(entry.inputs[2])
    if a is None:
      return _lost(entry, "gathers along an axis that is not static")
    axis = int(a.ravel()[0])
  batch_dims = int(_attr(entry, "batch_dims", 0))
  params, ids = layouts.get(0), layouts.get(1)
  rank_p, rank_i = _rank(entry.inputs[0]), _rank(entry.inputs[1])
  if params is None and ids is None:
    return _all(entry, None), None
  if rank_p is None or rank_i is None:
    return _lost(entry, "gathers from tensors of unknown rank")
  axis = axis % rank_p if rank_p else 0  # ResourceGather: a handle.
  if batch_dims < 0:
    batch_dims += rank_i
  if params is not None and ids is not None:
    if params == ids and params[0] < batch_dims:
      return _all(entry, params), None  # Row b gathers from row b.
    return _mixes(entry, "gathers rows chosen by one example's values from "
                  "other examples' rows (indices and params both carry "
                  "examples, not on a shared batch_dims axis)")
  if ids is not None:
    # Output: params[:axis] + indices[batch_dims:] + params[axis+1:].
    if ids[0] < batch_dims:
      return _all(entry, ids), None
    return _all(entry, (axis + ids[0] - batch_dims, ids[1])), None
  if params[0] < batch_dims:
    return _all(entry, params), None
  if params[0] == axis:
    return _mixes(entry, f"gathers along the batch axis {axis} (it moves "
                  "rows across examples: a permutation or selection of the "
                  "batch)")
  shift = 0 if params[0] < axis else rank_i - batch_dims - 1
  return _all(entry, (params[0] + shift, params[1])), None


@_rule("GatherNd", "ResourceGatherNd")
def _gather_nd(entry, layouts):
  """`params` indexed on its first `indices.shape[-1]` axes (after
  `batch_dims`): the examples of `params` must be on a kept axis."""
  params, ids = layouts.get(0), layouts.get(1)
  if params is None and ids is None:
    return _all(entry, None), None
  rank_i = _rank(entry.inputs[1])
  depth = entry.inputs[1].shape[-1] if rank_i else None
  batch_dims = int(_attr(entry, "batch_dims", 0))
  if rank_i is None or depth is None:
    return _lost(entry, "gathers with indices of unknown shape")
  if params is not None and ids is not None:
    if params == ids and params[0] < batch_dims:
      return _all(entry, params), None
    return _mixes(entry, "gathers rows chosen by one example's values from "
                  "other examples' rows")
  if ids is not None:
    if ids[0] >= rank_i - 1:
      return _lost(entry, "reads index tuples along the batch axis")
    return _all(entry, ids), None
  if params[0] < batch_dims:
    return _all(entry, params), None
  if params[0] < batch_dims + depth:
    return _mixes(entry, f"gathers along the batch axis {params[0]} (it "
                  "moves rows across examples)")
  return _all(entry, (params[0] - batch_dims - depth + rank_i - 1,
                      params[1])), None


# Contractions ----------------------------------------------------------------


def contract(entry, subs: Sequence[str], out: str, layouts) -> Result:
  """Layouts for an einsum-like op `subs[0],subs[1]->out` (e.g. a
  contraction's `Rule.layouts`: `contract(entry, ["ij", "jk"], "ik",
  layouts)`): the batch letter of each data operand must reach the output,
  the same letter for all."""
  found = set()
  for i, lay in layouts.items():
    if lay is None:
      continue  # Holds no rows of examples.
    if i >= len(subs) or lay[0] >= len(subs[i]):
      return _lost(entry, f"contracts operand {i} with subscripts that do "
                   "not match its rank")
    letter = subs[i][lay[0]]
    if letter not in out:
      return _mixes(entry, f"contracts the batch axis {lay[0]} of operand "
                    f"{i} (a sum over examples)")
    found.add((out.index(letter), lay[1]))
  if not found:
    return _all(entry, None), None
  if len(found) != 1:
    return _mixes(entry, "pairs the examples of one operand with those of "
                  "another (an outer product over the batch)")
  return _all(entry, found.pop()), None


@_rule("MatMul")
def _matmul(entry, layouts):
  a = "ji" if _attr(entry, "transpose_a", False) else "ij"
  b = "kj" if _attr(entry, "transpose_b", False) else "jk"
  return contract(entry, [a, b], "ik", layouts)


@_rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(entry, layouts):
  rx, ry = _rank(entry.inputs[0]), _rank(entry.inputs[1])
  if rx is None or ry is None:
    return _lost(entry, "multiplies matrices of unknown rank")
  ro = max(rx, ry)
  letters = "abcdefgh"[:ro - 2]
  x = letters[ro - rx:] + ("ji" if _attr(entry, "adj_x", False) else "ij")
  y = letters[ro - ry:] + ("kj" if _attr(entry, "adj_y", False) else "jk")
  return contract(entry, [x, y], letters + "ik", layouts)


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
    return _lost(entry, "has an equation whose ellipsis cannot be expanded")
  return contract(entry, parsed[0], parsed[1], layouts)


# TensorLists: a tf.TensorArray in a tf.function -------------------------------
#
# A TensorList is a scalar variant holding a list of tensors (the elements).
# Its layout is the layout of its *elements*: `(a, minor)` when each element
# holds the rows of every example on its axis a (the `[B, H, N]` output of
# one time step, written at index t). The list's index is never a batch
# axis. A list reserved or made empty from shapes alone holds no examples
# (a CONST, so it has no layout); the list's length and element shape are
# shapes (`tf_pxg.interface.classify`'s shape ops), not data.


def _list_write(entry, layouts, list_index: int, item_index: int,
                item_shift: int = 0) -> Result:
  """A list with an item written into it (`TensorListSetItem`,
  `TensorListPushBack`; `TensorListScatterIntoExistingList`, whose tensor
  holds the new elements on axis 0, `item_shift=1`): the list's elements
  and the item must hold the examples on the same axis."""
  lay_list, lay_item = layouts.get(list_index), layouts.get(item_index)
  if lay_item is not None and item_shift:
    if lay_item[0] < item_shift:
      return _mixes(entry, "scatters the batch axis 0 of a tensor into the "
                    "list's elements (each element would hold one example)")
    lay_item = (lay_item[0] - item_shift, lay_item[1])
  known = [l for l in (lay_list, lay_item) if l is not None]
  if not known:
    return _all(entry, None), None
  if len(set(known)) > 1:
    return _mixes(entry, f"writes an element whose examples are on axis "
                  f"{lay_item[0]} into a list whose elements hold them on "
                  f"axis {lay_list[0]} (stacking or reading the list would "
                  "pair rows of different examples)")
  return _all(entry, known[0]), None


@_rule("TensorListSetItem")
def _list_set_item(entry, layouts):
  """(list, index, item) -> list; the index is not data."""
  return _list_write(entry, layouts, 0, 2)


@_rule("TensorListPushBack")
def _list_push_back(entry, layouts):
  """(list, tensor) -> list."""
  return _list_write(entry, layouts, 0, 1)


@_rule("TensorListScatterIntoExistingList")
def _list_scatter_into(entry, layouts):
  """(list, tensor `[n, *element]`, indices) -> list."""
  if layouts.get(2) is not None:
    return _lost(entry, "scatters a tensor to list indices that carry "
                 "examples")
  return _list_write(entry, layouts, 0, 1, item_shift=1)


@_rule("TensorListGetItem", "TensorListPopBack", "TensorListResize")
def _list_read(entry, layouts):
  """An element read from a list (`GetItem`: (list, index, element shape)
  -> item; `PopBack`: (list, element shape) -> (list, item)), or the list
  resized: every output has the elements' layout."""
  return _all(entry, layouts.get(0)), None


@_rule("TensorListStack", "TensorListGather")
def _list_stack(entry, layouts):
  """Elements stacked on a new axis 0 (`Stack`: all of them; `Gather`:
  those at `indices`, which must not be chosen by the examples' values):
  the examples move one axis up."""
  if layouts.get(1) is not None and entry.op_type == "TensorListGather":
    return _lost(entry, "gathers list elements at indices that carry "
                 "examples")
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  return _all(entry, (lay[0] + 1, lay[1])), None


@_rule("TensorListFromTensor", "TensorListScatter", "TensorListScatterV2")
def _list_from_tensor(entry, layouts):
  """A list made of a tensor's rows on axis 0 (`FromTensor`, a
  `TensorArray.unstack`; `Scatter`: at `indices`): each element is a row,
  so the examples move one axis down. Refused when they are on axis 0 —
  every example would be its own list element."""
  if layouts.get(1) is not None and entry.op_type != "TensorListFromTensor":
    return _lost(entry, "scatters a tensor to list indices that carry "
                 "examples")
  lay = layouts.get(0)
  if lay is None:
    return _all(entry, None), None
  if lay[0] == 0:
    return _mixes(entry, "makes the batch axis 0 of a tensor the list's "
                  "index (each list element would hold one example, as "
                  "TensorArray.unstack of a batch-major tensor does)")
  return _all(entry, (lay[0] - 1, lay[1])), None


def _value_selector(entry, layouts):
  """The refusal of value selectors (`value_shapes.is_value_selector`; not on the allowlist:
  `propagate` reports them with this reason)."""
  del layouts  # Whatever the layout: the kept rows are chosen by value.
  return _mixes(entry, f"keeps, dedups or groups {value_shapes.VALUE_SHAPE_PHRASES[1]} "
                "across the whole batch (its output's shape, read "
                "with tf.shape or tf.size, is a count over every example's "
                "values, and its rows are not one example's)")


# Other ops --------------------------------------------------------------------


@_rule("OneHot")
def _one_hot(entry, layouts):
  lay, rank = layouts.get(0), _rank(entry.inputs[0])
  if lay is None:
    return _all(entry, None), None
  if rank is None:
    return _lost(entry, "one-hot encodes a tensor of unknown rank")
  axis = int(_attr(entry, "axis", -1))
  axis = rank if axis == -1 else axis
  return _all(entry, (lay[0] + (axis <= lay[0]), lay[1])), None


def propagate(entry, layouts: Dict[int, Layout],
              batch_size: Optional[int] = None,
              layout_of: Optional[Callable] = None) -> Result:
  """Layouts of `entry`'s outputs from those of its data inputs.

  Args:
    entry: a recorded op.
    layouts: input index -> layout, for the inputs that carry examples.
    batch_size: B if static (tells a split of merged rows from other splits).
    layout_of: tensor -> its layout, or None where it holds no examples
      (a reshape to `[tf.shape(t)[0], -1]` with a dynamic batch).

  Returns:
    (one layout per output, None or the `Mixing` that says why the op
    mixes examples — or may: an op type off the allowlist, or a rule that
    cannot follow the batch axis).
  """
  rule = _RULES.get(entry.op_type)
  if rule is _reshape:
    return rule(entry, layouts, batch_size, layout_of)
  if rule is not None:
    return rule(entry, layouts)
  per_example_rule = registry.lookup(entry.op_type)
  if per_example_rule is not None:  # Row-wise by a per-example rule's contract.
    return (per_example_rule.layouts or elementwise)(entry, layouts)
  if value_shapes.is_value_selector(entry.op_type):
    return _value_selector(entry, layouts)
  return _mixes(entry, "is not on tf_pxg's allowlist of ops known to keep "
                "the rows of different examples apart, so it may mix them")
