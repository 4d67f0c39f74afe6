"""The one table: what tf_pxg knows of every TensorFlow op type.

Whatever the data touches is data (`tf_pxg.interface.classify`), so every op
the data reaches must be *known* to keep the rows of different examples
apart, or it is refused by name. This module reads that knowledge, which
lives with each op's rule (`tf_pxg.interface.batch_axis` for row-wise ops,
`tf_pxg.registry` for per-example rules, `tf_pxg.tape.side_effects` for
resources), as one table over the op types TensorFlow registers
(`tf.raw_ops`):

* `row-wise`: on the allowlist; a rule says where the batch axis goes and
  which inputs hold rows (`batch_axis.ROW_INPUTS`): data at any other input
  (an argument) is refused;
* `per-example rule`: a registered per-example rule (row-wise by its
  contract);
* `mixing`: refused whenever data reaches it (it selects, dedups or groups
  elements by value across the batch, or normalises with batch statistics);
* `shape read`: a constant where the shape depends on the batch size alone,
  data (refused) where it depends on the examples' values;
* `resource read`: reads a variable, table or TensorArray without changing
  it;
* `state write`: refused when a value it writes depends on the data;
* `function call`: a loop, branch or call whose body tf_pxg checks for
  writes, and which is refused on the data path where its body is not
  recorded op by op;
* `source`: makes a tensor from no data (a literal, a placeholder, a
  variable handle);
* `refused (unknown)`: every other op type; refused, naming it, when data
  reaches any of its inputs (`tf_pxg.register_row_wise` adds one).

`python -m tf_pxg.per_example.op_table` prints the table's summary as
docs/coverage.md's "Op table" section shows it.
"""

from __future__ import annotations

import collections
from typing import Dict, List

import tensorflow as tf

from tf_pxg import registry
from tf_pxg import rules  # noqa: F401  (registers the built-in rules)
from tf_pxg.interface import batch_axis
from tf_pxg.interface import value_shapes
from tf_pxg.tape import control_flow
from tf_pxg.tape import side_effects

ROW_WISE = "row-wise"
RULE = "per-example rule"
MIXING = "mixing"
SHAPE_READ = "shape read"
RESOURCE_READ = "resource read"
WRITE = "state write"
CALL = "function call"
SOURCE = "source"
UNKNOWN = "refused (unknown)"

CLASSES = (ROW_WISE, RULE, MIXING, SHAPE_READ, RESOURCE_READ, WRITE, CALL,
           SOURCE, UNKNOWN)

_MIXING = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3",
           "BatchNormWithGlobalNormalization")
_SOURCES = ("Const", "Placeholder", "PlaceholderWithDefault", "VarHandleOp",
            "HashTableV2", "MutableHashTableV2",
            "MutableHashTableOfTensorsV2", "MutableDenseHashTableV2",
            "AnonymousHashTable", "AnonymousMutableHashTable",
            "AnonymousMutableHashTableOfTensors",
            "AnonymousMutableDenseHashTable", "EmptyTensorList",
            "TensorListReserve")


def op_types() -> List[str]:
  """The op types TensorFlow registers (those `tf.raw_ops` exposes)."""
  return sorted(n for n in dir(tf.raw_ops) if not n.startswith("_"))


def classify(op_type: str) -> str:
  """The class of `op_type` (one of `CLASSES`)."""
  if op_type in _MIXING or value_shapes.is_value_selector(op_type):
    return MIXING
  if registry.lookup(op_type) is not None:
    return RULE
  if op_type in batch_axis.row_wise_op_types():
    return ROW_WISE
  if op_type in value_shapes.SHAPE_READS or op_type in ("VariableShape",
                                                      "TensorListLength"):
    return SHAPE_READ
  if op_type in side_effects.PURE_RESOURCE_READS:
    return RESOURCE_READ
  if op_type in control_flow.OPAQUE_OPS:
    return CALL
  if op_type in _SOURCES:
    return SOURCE
  if side_effects.writes_by_name(op_type):
    return WRITE
  return UNKNOWN


def table() -> Dict[str, str]:
  """Op type -> class, for every registered op type."""
  return {t: classify(t) for t in op_types()}


def coverage() -> Dict[str, int]:
  """How many registered op types fall in each class, and in all."""
  counts = collections.Counter(table().values())
  out = {c: counts.get(c, 0) for c in CLASSES}
  out["registered"] = sum(counts.values())
  return out


def summary() -> str:
  """The coverage as a Markdown table (docs/coverage.md, "Op table")."""
  cov = coverage()
  known = cov["registered"] - cov[UNKNOWN]
  lines = ["| class | op types |", "|---|---|"]
  lines += [f"| {c} | {cov[c]} |" for c in CLASSES]
  lines.append(f"| **all registered** (`tf.raw_ops`) | {cov['registered']} |")
  lines.append("")
  lines.append(f"{known} of {cov['registered']} registered op types are "
               f"classified ({100.0 * known / cov['registered']:.1f} %); the "
               f"other {cov[UNKNOWN]} are refused by name when the data "
               "reaches them.")
  return "\n".join(lines)


if __name__ == "__main__":
  print(f"TensorFlow {tf.__version__}\n")
  print(summary())
