"""Value-dependent shapes: ops whose output's shape is set by input *values*.

Most ops give an output whose shape is set by their inputs' *shapes*: a
batch of B examples gives B rows, whatever the values. Some set it by
input *values*: `tf.where(cond)` and `tf.boolean_mask` keep as many rows
as the condition selects, `tf.unique` as many as there are distinct
values, `tf.zeros([n])` as many as `n` says. When those values carry
examples, the output's shape is a function of every example's values, so
its shape, size (and, were it ever unknown, rank) is *data*: read back by
`tf.shape` / `tf.size` it is a count over the whole batch, and used to
scale or reshape the others' rows it lets one example move every other
example's loss (`n = tf.shape(tf.where(x > 50))[0]`; `x * (1 + min(n,
1))`). `tf_pxg.interface.classify.Classifier` propagates the property from the ops
listed here, through every op with such an input whose output shape is
not static, and makes the shape ops that read it data on the batch-axis
check (a MIXES of the whole batch). Shapes that depend only on the
batch size (`tf.shape(x)[0]`, `reshape(x, [-1, d])`, a padded batch) stay
constants.

VALUE_SHAPED: op type -> the inputs whose values set the output's shape
(the op's outputs have a value-dependent shape when one of those inputs
carries examples). A new op of that kind is one line here; if it is not
row-wise, also list it in `_VALUE_SELECTORS` so that the refusal says why
(`tf_pxg.interface.batch_axis.propagate` refuses those).
"""

from __future__ import annotations

from typing import Dict, Tuple

# ONE_ROW_PER_EXAMPLE: ops that give back one row per example on axis 0
# whatever their inputs' value-dependent shapes (a ragged batch padded to a
# dense `[B, T]`): where every other dimension of such an output is static,
# its shape varies with the batch size alone, so the property stops there
# (Keras' TextVectorization with `output_sequence_length`).
ONE_ROW_PER_EXAMPLE = frozenset({"RaggedTensorToTensor"})

VALUE_SHAPED: Dict[str, Tuple[int, ...]] = {
    # Select, filter or group elements by their values.
    "Where": (0,),
    "Unique": (0,), "UniqueV2": (0,), "UniqueWithCounts": (0,),
    "UniqueWithCountsV2": (0,),
    "DynamicPartition": (1,),
    "ListDiff": (0, 1),
    "NonMaxSuppression": (0, 1), "NonMaxSuppressionV2": (0, 1, 3),
    "NonMaxSuppressionV3": (0, 1, 3, 4), "NonMaxSuppressionV4": (0, 1, 3, 4),
    "NonMaxSuppressionV5": (0, 1, 3, 4, 5),
    "NonMaxSuppressionWithOverlaps": (0, 1, 3, 4),
    "SegmentSum": (1,), "SegmentMean": (1,), "SegmentMax": (1,),
    "SegmentMin": (1,), "SegmentProd": (1,),
    "SparseSegmentSum": (1, 2), "SparseSegmentMean": (1, 2),
    "SparseSegmentSqrtN": (1, 2),
    "SparseSegmentSumWithNumSegments": (1,),
    "SparseSegmentMeanWithNumSegments": (1,),
    "SparseSegmentSqrtNWithNumSegments": (1,),
    "SparseFillEmptyRows": (0,), "SparseReshape": (2,),
    "DenseToSparseSetOperation": (0, 1), "DenseToDenseSetOperation": (0, 1),
    "RaggedRange": (0, 1, 2), "RaggedGather": (0, 1, 2),
    "StringSplit": (0,), "StringSplitV2": (0,), "StringNGrams": (0, 1),
    "UnicodeDecode": (0,), "UnicodeDecodeWithOffsets": (0,),
    "RaggedTensorToSparse": (0,),
    # Shape, size, count or length given by a value.
    "Fill": (0,), "Empty": (0,), "Range": (0, 1, 2), "Reshape": (1,),
    "Tile": (1,), "Slice": (1, 2), "StridedSlice": (1, 2, 3),
    "Pad": (1,), "PadV2": (1,), "MirrorPad": (1,), "BroadcastTo": (1,),
    "OneHot": (1,), "SplitV": (1,), "ResizeBilinear": (1,),
    "ResizeNearestNeighbor": (1,), "ResizeBicubic": (1,), "ResizeArea": (1,),
    "ScaleAndTranslate": (1,), "ScatterNd": (2,), "SparseToDense": (1,),
    "RaggedTensorToTensor": (0,), "TensorListReserve": (0, 1),
    "EmptyTensorList": (0, 1), "TensorListResize": (1,),
    "RandomUniform": (0,), "RandomStandardNormal": (0,),
    "TruncatedNormal": (0,), "RandomUniformInt": (0,),
    "StatelessRandomUniformV2": (0,), "StatelessRandomNormalV2": (0,),
    "StatelessTruncatedNormalV2": (0,), "StatelessRandomUniformIntV2": (0,),
    "StatelessRandomUniform": (0,), "StatelessRandomNormal": (0,),
    "StatelessTruncatedNormal": (0,),
}

# Ops that read a shape: their outputs are data when their input's shape is
# value-dependent (`TensorListElementShape`, `VariableShape` excepted: an
# element shape and a variable's shape do not count examples).
SHAPE_READS = ("Shape", "ShapeN", "Size", "Rank", "TensorListLength")


def value_shape_inputs(op_type: str) -> Tuple[int, ...]:
  """Inputs of an `op_type` op whose values set its output's shape."""
  return VALUE_SHAPED.get(op_type, ())


# The ops above that are not row-wise: they choose which elements, of which
# examples, make up their output (a selection, a dedup, a partition or
# segment over the flattened batch, a set difference). They are off the
# allowlist; `propagate` refuses them with `_value_selector`'s reason.
_VALUE_SELECTORS = (
    "Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2",
    "DynamicPartition", "ListDiff", "NonMaxSuppression",
    "NonMaxSuppressionV2", "NonMaxSuppressionV3", "NonMaxSuppressionV4",
    "NonMaxSuppressionV5", "NonMaxSuppressionWithOverlaps", "SegmentSum",
    "SegmentMean", "SegmentMax", "SegmentMin", "SegmentProd",
    "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
    "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
    "SparseSegmentSqrtNWithNumSegments", "SparseFillEmptyRows",
    "DenseToSparseSetOperation", "DenseToDenseSetOperation", "RaggedRange",
    "RaggedGather", "StringSplit", "StringNGrams", "UnicodeDecode",
    "UnicodeDecodeWithOffsets", "RaggedTensorToSparse")


def is_value_selector(op_type: str) -> bool:
  """Whether `op_type` keeps elements chosen by their values (not row-wise:
  `_VALUE_SELECTORS`)."""
  return op_type in _VALUE_SELECTORS


#: What the two refusals of a value-dependent shape say (a shape read of
#: one, `value_shape_why`; a value selector, `_value_selector`), in their
#: messages: `tf_pxg.testing.check_example_independence` reports a refusal
#: that says either as a forward-pass exit.
VALUE_SHAPE_PHRASES = ("shape depends on the values of the examples",
                       "elements chosen by their values")


def value_shape_why(creator_describe: str) -> str:
  """The reason a shape read of a value-dependent shape mixes examples."""
  return (f"reads the shape of a tensor whose {VALUE_SHAPE_PHRASES[0]} "
          f"({creator_describe} made it): that shape is a "
          "count over the whole batch, so using it lets one example change "
          "every other example's computation")
