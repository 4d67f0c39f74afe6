"""A device-independent cost of a compiled step: FLOPs and bytes counted
from XLA's optimized HLO (issue 51, item 3).

CPU wall time does not carry over to TPUs and GPUs; the compiled program's
own arithmetic and memory traffic do, to first order. TensorFlow exposes
no cost analysis of a compiled function, so this module reads the text
of `tf.function(..., jit_compile=True).experimental_get_compiler_ir(
*args)(stage="optimized_hlo")` and counts:

* **FLOPs**: of every `dot` and `convolution` instruction, wherever it is
  (fusion bodies included), as XLA's own `HloCostAnalysis` counts them:
  a dot is `2 * |result| * prod(lhs contracting dims)`; a convolution is
  `2 * |result| * prod(kernel spatial dims) * kernel input features`
  (the kernel's `i` dimension of `dim_labels`, already divided by the
  feature groups; a batch-grouped convolution's output batch is already
  divided too). Windows are counted whole: a padded convolution's border
  terms count as work (an upper bound, the same convention for both
  steps compared). Elementwise work is not counted (it is memory-bound).
* **Bytes**: of the operands and results of every instruction at kernel
  level, i.e. of the computations XLA emits as kernels (the entry, while
  bodies and conditions, conditional branches, called computations), a
  fusion counting once as its operands plus its result, not its body's
  instructions (which stay in registers). Instructions that move no data
  are skipped: `parameter`, `constant`, `get-tuple-element`, `tuple`,
  `bitcast`, `after-all`, `add-dependency`, `opt-barrier`. An in-place
  update (`dynamic-update-slice`) counts its whole operand: an upper bound.

Both counts are static: an instruction inside a `while` body counts once
(`Cost.while_loops` says how many loops there are, so a reader knows when
a count is per iteration).

`python -m benchmarks.hlo_cost --models=mlp,cnn` prints, per model, the
DP step's FLOPs and bytes divided by the non-private Keras step's, both
compiled with XLA, and where the extra FLOPs go by TensorFlow op type
(the `op_type` XLA keeps in each instruction's metadata).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from typing import Dict, List, Optional, Tuple

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1,
    "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "token": 0,
}
_NO_TRAFFIC = frozenset({"parameter", "constant", "get-tuple-element",
                         "tuple", "bitcast", "after-all", "add-dependency",
                         "opt-barrier"})
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Shape:
  """An array shape (`dims` None for a tuple, whose `parts` hold its
  elements)."""
  dtype: str
  dims: Optional[Tuple[int, ...]]
  parts: Tuple["Shape", ...] = ()

  @property
  def elements(self) -> int:
    n = 1
    for d in self.dims or ():
      n *= d
    return n

  @property
  def bytes(self) -> int:
    if self.dims is None:
      return sum(p.bytes for p in self.parts)
    return self.elements * _DTYPE_BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Instruction:
  name: str
  shape: Shape
  opcode: str
  operands: List[str]
  attributes: str

  def attribute(self, key: str) -> Optional[str]:
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|[^,\s]+)", self.attributes)
    return m.group(1) if m else None

  @property
  def op_type(self) -> str:
    m = re.search(r'op_type="([^"]*)"', self.attributes)
    return m.group(1) if m else "(none)"


@dataclasses.dataclass
class Computation:
  name: str
  entry: bool
  instructions: List[Instruction]

  def shapes(self) -> Dict[str, Shape]:
    return {i.name: i.shape for i in self.instructions}


@dataclasses.dataclass
class Cost:
  """Static counts of one HLO module (module doc)."""
  flops: int = 0
  bytes: int = 0
  dots: int = 0
  convolutions: int = 0
  while_loops: int = 0
  flops_by_op_type: Dict[str, int] = dataclasses.field(
      default_factory=dict)
  bytes_by_op_type: Dict[str, int] = dataclasses.field(
      default_factory=dict)


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at `text[start]`."""
  pairs = {"(": ")", "[": "]", "{": "}"}
  stack = []
  for k in range(start, len(text)):
    c = text[k]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return k + 1
  raise ValueError(f"unbalanced brackets in HLO text: {text[start:][:80]!r}")


def _split_top(text: str) -> List[str]:
  """`text` split at commas outside brackets."""
  out, depth, cur = [], 0, []
  for c in text:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == "," and depth == 0:
      out.append("".join(cur).strip())
      cur = []
    else:
      cur.append(c)
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


def parse_shape(text: str) -> Shape:
  """An HLO shape: `f32[8,3]{1,0}`, `s32[]`, `(f32[2], u32[])`, `token[]`."""
  text = text.strip()
  if text.startswith("("):
    return Shape("tuple", None, tuple(parse_shape(p)
                                      for p in _split_top(text[1:-1])))
  m = _ARRAY.match(text)
  if not m:
    raise ValueError(f"not an HLO shape: {text!r}")
  dims = tuple(int(d) for d in m.group(2).split(",") if d)
  return Shape(m.group(1), dims)


def _instruction(name: str, rest: str) -> Instruction:
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.index(" ")
    if "{" in rest[:end]:  # a layout, e.g. f32[8,3]{1,0}
      end = _balanced(rest, rest.index("{"))
  shape = parse_shape(re.sub(r"\{[^}]*\}$", "", rest[:end]))
  rest = rest[end:].strip()
  paren = rest.index("(")
  opcode = rest[:paren].strip()
  close = _balanced(rest, paren)
  operands = []
  for op in _split_top(rest[paren + 1:close - 1]):
    # Operands print as `%name` or `f32[8]{0} %name` (with their shapes).
    token = op.split()[-1] if op else ""
    if token.startswith("%"):
      operands.append(token[1:])
    elif token:
      operands.append(token)
  return Instruction(name, shape, opcode, operands, rest[close:])


def parse(hlo: str) -> List[Computation]:
  """The computations of an HLO module's text."""
  comps: List[Computation] = []
  current: Optional[Computation] = None
  for line in hlo.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)  # /*index=5*/ in tuple shapes
    if current is None:
      m = _HEADER.match(line.strip())
      if m:
        current = Computation(m.group(2), bool(m.group(1)), [])
      continue
    if line.strip() == "}":
      comps.append(current)
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      current.instructions.append(_instruction(m.group(1), m.group(2)))
  return comps


def _dims_attr(value: Optional[str]) -> List[int]:
  return [int(d) for d in re.findall(r"\d+", value or "")]


def dot_flops(inst: Instruction, lhs: Shape) -> int:
  """`2 * |result| * prod(lhs contracting dims)`."""
  width = 1
  for d in _dims_attr(inst.attribute("lhs_contracting_dims")):
    width *= lhs.dims[d]
  return 2 * inst.shape.elements * width


def convolution_flops(inst: Instruction, kernel: Shape) -> int:
  """`2 * |result| * prod(kernel spatial dims) * kernel input features`,
  from `dim_labels` (e.g. `b01f_01io->b01f`)."""
  labels = inst.attribute("dim_labels")
  if not labels:
    raise ValueError(f"convolution {inst.name} has no dim_labels")
  kernel_labels = labels.split("_")[1].split("->")[0]
  per_output = 1
  for axis, label in enumerate(kernel_labels):
    if label.isdigit() or label == "i":
      per_output *= kernel.dims[axis]
  return 2 * inst.shape.elements * per_output


def cost(hlo: str) -> Cost:
  """The static FLOP and byte counts of an optimized HLO module's text
  (module doc). Raises ValueError on text it cannot read."""
  comps = parse(hlo)
  if not comps:
    raise ValueError("no HLO computation in the text")
  fused, applied = set(), set()
  for comp in comps:
    for inst in comp.instructions:
      for key, name in _CALLED.findall(inst.attributes):
        if key == "calls" and inst.opcode == "fusion":
          fused.add(name)
        elif key == "to_apply" and inst.opcode != "call":
          applied.add(name)  # a reducer / comparator: scalar code
  out = Cost()
  flops_by = collections.Counter()
  bytes_by = collections.Counter()
  for comp in comps:
    shapes = comp.shapes()
    kernel_level = comp.name not in fused and comp.name not in applied
    for inst in comp.instructions:
      if inst.opcode == "while":
        out.while_loops += 1
      if inst.opcode == "dot":
        f = dot_flops(inst, shapes[inst.operands[0]])
        out.dots += 1
      elif inst.opcode == "convolution":
        f = convolution_flops(inst, shapes[inst.operands[1]])
        out.convolutions += 1
      else:
        f = 0
      out.flops += f
      if f:
        flops_by[inst.op_type] += f
      if kernel_level and inst.opcode not in _NO_TRAFFIC:
        b = inst.shape.bytes + sum(shapes[o].bytes for o in inst.operands
                                   if o in shapes)
        out.bytes += b
        bytes_by[_kernel_op_type(inst, comps)] += b
  out.flops_by_op_type = dict(flops_by)
  out.bytes_by_op_type = dict(bytes_by)
  return out


def _kernel_op_type(inst: Instruction, comps: List[Computation]) -> str:
  """The TF op type a kernel-level instruction stands for: its own
  metadata's, or a fusion's root's."""
  if inst.opcode != "fusion" or 'op_type="' in inst.attributes:
    return inst.op_type
  called = dict(_CALLED.findall(inst.attributes)).get("calls")
  for comp in comps:
    if comp.name == called and comp.instructions:
      return comp.instructions[-1].op_type
  return "(fusion)"


def step_hlo(model, x, y) -> str:
  """The optimized HLO of `model.train_step((x, y))` compiled with XLA (the
  program Keras' `jit_compile=True` step runs on one batch)."""
  import tensorflow as tf  # noqa: PLC0415
  fn = tf.function(model.train_step, jit_compile=True)
  data = (tf.constant(x), tf.constant(y))
  return fn.experimental_get_compiler_ir(data)(stage="optimized_hlo")


def compare(name: str, batch_size: int = 0, size: str = "full",
            seq_len: int = 0) -> dict:
  """DP / Keras ratios of the XLA step's static FLOPs and bytes for
  `benchmarks.models` model `name`, with the extra FLOPs by TF op type."""
  import keras  # noqa: PLC0415

  from benchmarks import models  # noqa: PLC0415
  from benchmarks import modes  # noqa: PLC0415
  import tf_pxg.keras as pxk  # noqa: PLC0415
  b = batch_size or models.SPECS[name].batch
  x, y = models.batch(name, b, seq_len, size=size)
  costs = {}
  for mode in ("keras_xla", "pxg_xla"):
    model = models.build(keras, name, seq_len, size)
    if mode == "pxg_xla":
      model = pxk.make_private(model, l2_norm_clip=modes.L2_NORM_CLIP,
                               noise_multiplier=modes.NOISE_MULTIPLIER)
    model.compile(keras.optimizers.SGD(modes.LEARNING_RATE),
                  keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=True)
    costs[mode] = cost(step_hlo(model, x, y))
  base, dp = costs["keras_xla"], costs["pxg_xla"]
  extra = {k: v - base.flops_by_op_type.get(k, 0)
           for k, v in dp.flops_by_op_type.items()}
  return {
      "model": name, "batch": b, "size": size,
      "keras": dataclasses.asdict(base) | {"flops_by_op_type": None,
                                           "bytes_by_op_type": None},
      "dp": dataclasses.asdict(dp) | {"flops_by_op_type": None,
                                      "bytes_by_op_type": None},
      "flops_ratio": dp.flops / base.flops if base.flops else None,
      "bytes_ratio": dp.bytes / base.bytes if base.bytes else None,
      "extra_flops_by_op_type": dict(sorted(
          ((k, v) for k, v in extra.items() if v), key=lambda kv: -kv[1])),
      "extra_bytes_by_op_type": dict(sorted(
          ((k, v - base.bytes_by_op_type.get(k, 0))
           for k, v in dp.bytes_by_op_type.items()
           if v - base.bytes_by_op_type.get(k, 0)),
          key=lambda kv: -kv[1])[:8]),
  }


def main(argv):
  del argv
  rows = []
  for name in _MODELS.value:
    row = compare(name, _BATCH.value, _SIZE.value)
    rows.append(row)
    print(f"{name:12s} B={row['batch']:4d}  FLOPs DP/Keras "
          f"{row['flops_ratio']:.3f}  bytes DP/Keras {row['bytes_ratio']:.3f}"
          f"  (Keras {row['keras']['flops'] / 1e9:.3f} GFLOP, "
          f"{row['keras']['bytes'] / 1e6:.1f} MB)", flush=True)
    top = list(row["extra_flops_by_op_type"].items())[:4]
    print("    extra FLOPs by op type: " + ", ".join(
        f"{k} {v / max(row['keras']['flops'], 1):+.3f}" for k, v in top))
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(rows, fh, indent=1)


if __name__ == "__main__":
  from absl import app
  from absl import flags
  _MODELS = flags.DEFINE_list(
      "models", ["mlp", "cnn", "embed", "transformer", "wrn_gn"],
      "benchmarks.models names.")
  _BATCH = flags.DEFINE_integer("batch_size", 0, "0: the model's default.")
  _SIZE = flags.DEFINE_enum("size", "full", ["full", "small", "tiny"],
                            "Model size.")
  _JSON = flags.DEFINE_string("json", "", "Write the rows to this file.")
  app.run(main)
