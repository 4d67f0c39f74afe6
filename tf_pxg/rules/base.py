"""What a per-example rule sees and must provide (the rule author's one import).

At an interface op (an op with a parameter-derived input and a data input),
backprop hands the rule a `Context`: the recorded op, which input is the
parameter, the gradients of the op's outputs, and the number of examples B.
Batch is axis 0 of the data operands; an operand may merge examples with
other axes as long as each example's rows are contiguous (a `[B*T, d]`
reshape of `[B, T, d]`), which `Context.split_batch` undoes.

A rule has three forms (`Rule`):

* `per_example(ctx)` -> `[B, *param.shape]`, example b's gradient;
* `sq_norm(ctx)` -> `[B]`, the squared L2 norm of each example's gradient;
* `weighted_sum(ctx, c)` -> `param.shape`, `sum_b c[b] * g_b`.

An example whose clip factor is 0 must contribute exactly 0 to
`weighted_sum`, even when its rows of the data operands, outputs or output
gradients hold inf/NaN (a non-finite example: `tf_pxg.dp.clipping`): IEEE
`0 * inf = NaN`, so scaling by `c[b] = 0` is not enough. `scale_examples`
is a select for a zero factor (exact zeros), `Context.drop_examples` sets
an example's rows of a tensor to zero, and the default `weighted_sum`
applies both to what TF's gradient function reads (`Rule.drop_inputs`,
`Rule.drop_outputs` say which). A rule overriding `weighted_sum` must do
the same for the operands it contracts.

The defaults derive `sq_norm` from `per_example` and compute `weighted_sum`
as TensorFlow's own weight gradient with each example's output gradient
scaled by `c[b]` (exactly `x^T diag(c) dz` for a MatMul), which costs the same
as the non-private weight gradient. `per_example` defaults to running the
op's TF gradient function on one example at a time under
`tf.vectorized_map`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg import native
from tf_pxg import registry
from tf_pxg import xla
from tf_pxg.backprop import gradient_functions
from tf_pxg.backprop import rule_trace
from tf_pxg.tape import recording
from tf_pxg.tape.recording import Entry


def to_dense(g):
  """Converts IndexedSlices to a dense tensor; passes tensors through."""
  if isinstance(g, tf.IndexedSlices):
    return tf.convert_to_tensor(g)
  return g


def _dim(t, axis):
  d = t.shape[axis]
  return d if d is not None else tf.shape(t)[axis]


@dataclasses.dataclass
class Context:
  """The interface op as a rule sees it.

  Attributes:
    entry: the recorded op.
    param_index: which input is the parameter (or parameter-derived tensor).
    output_grads: gradient of the (per-example) target for each op output.
    batch_size: B, the number of examples (int if static, else scalar tensor).
    data_indices: inputs that carry examples on axis 0.
    batch_minor: the data's axis 0 is `[k, B]` (example index minor, as after
      SpaceToBatchND) rather than the usual `[B, k]`.
    copy_axis: for a parameter copied along the batch axis (an op without
      data operands, `tf_pxg.rules.copies`), the output axis holding the
      examples (`[B, k]` merged); None otherwise.
    grams: the backprop's store for products that several interfaces
      share (`tf_pxg.rules.grams.shared_product`: the query, key and value
      projections of one attention layer read one data tensor), one per
      backward pass; None: share nothing.
  """
  entry: Entry
  param_index: int
  output_grads: list
  batch_size: Any
  data_indices: tuple
  batch_minor: bool = False
  # The backprop's store for `keep_per_example` / `take_per_example`
  # (`PerExampleBackprop` owns it, one per backward pass); None: keep nothing.
  kept: Optional[dict] = None
  copy_axis: Optional[int] = None
  grams: Optional[dict] = None

  @property
  def op_type(self) -> str:
    return self.entry.op_type

  @property
  def inputs(self) -> tuple:
    return self.entry.inputs

  @property
  def outputs(self) -> tuple:
    return self.entry.outputs

  @property
  def param(self):
    return self.entry.inputs[self.param_index]

  @property
  def dz(self):
    """The gradient of the first output."""
    return self.output_grads[0]

  @property
  def param_shape(self):
    """Static-or-dynamic shape of the parameter (resource handles resolved)."""
    p = self.param
    if p.dtype == tf.resource:
      return variable_shape(p)
    return p.shape if p.shape.is_fully_defined() else tf.shape(p)

  @property
  def param_dtype(self):
    p = self.param
    if p.dtype == tf.resource:
      return self.dz.dtype
    return p.dtype

  def attr(self, name: str, default=None):
    """Attr `name` of the op (bytes decoded); `default` if unset or None.

    Eager ops may carry `None` for attrs the caller left at their default.
    """
    try:
      value = recording.get_attr(self.entry, name)
    except (ValueError, KeyError):
      return default
    if isinstance(value, bytes):
      value = value.decode()
    return default if value is None else value

  def describe(self) -> str:
    return self.entry.describe()

  def split_batch(self, t, axis: int = 0):
    """Reshapes axis `axis` of size B*k into two axes [B, k]."""
    return split_batch(t, self.batch_size, axis, self.batch_minor)

  def scale_examples(self, t, c, axis: int = 0):
    """Multiplies example b's rows of `t` (batch on `axis`) by `c[b]`;
    exact zeros where `c[b] == 0`, even for inf/NaN rows."""
    return scale_examples(t, c, self.batch_size, axis, self.batch_minor)

  def drop_examples(self, t, c, axis: int = 0):
    """`t` with example b's rows (batch on `axis`) set to exactly 0 where
    `c[b] == 0` (a select: inf/NaN rows become 0 too); other rows are
    unchanged. Non-float tensors (indices) and scalars pass through."""
    return drop_examples(t, c, self.batch_size, axis, self.batch_minor)

  def dropped_io(self, c, inputs: bool = True, outputs: bool = True):
    """`(inputs, outputs)` of the op with the data operands' (`inputs`) and
    the outputs' (`outputs`) rows of examples with `c[b] == 0` set to 0,
    for `tf_gradient(..., inputs=, outputs=)`; None where not asked."""
    ins = outs = None
    if inputs:
      ins = list(self.inputs)
      for i in self.data_indices:
        ins[i] = self.drop_examples(ins[i], c)
    if outputs:  # Those with a gradient carry examples on axis 0.
      outs = [o if g is None else self.drop_examples(o, c)
              for o, g in zip(self.outputs, self.output_grads)]
    return ins, outs

  def tf_gradient(self, output_grads: Optional[Sequence[Any]] = None,
                  inputs=None, outputs=None):
    """TF's batch gradient of the op for the parameter input alone."""
    skip = [i for i in range(len(self.inputs)) if i != self.param_index]
    grads = gradient_functions.call_gradient_function(
        self.entry, self.output_grads if output_grads is None else output_grads,
        skip, inputs=inputs, outputs=outputs)
    return grads[self.param_index]


def variable_shape(handle):
  return _compat.variable_shape(handle)


def split_batch(t, batch_size, axis: int = 0, minor: bool = False):
  """`[..., B*k, ...]` -> `[..., B, k, ...]` at `axis`.

  Examples are contiguous (`minor=False`, a reshape of `[B, k]`) or, after
  SpaceToBatchND, interleaved (`minor=True`, a reshape of `[k, B]`).
  """
  axis = axis % t.shape.rank
  shape = [_dim(t, i) for i in range(t.shape.rank)]
  n = shape[axis]
  if isinstance(n, int) and isinstance(batch_size, int):
    if batch_size == 0 or n % batch_size:
      raise ValueError(
          f"An operand with {n} rows on its batch axis {axis} cannot be split "
          f"into {batch_size} examples. The batch must be axis 0 of the data "
          "(possibly merged with following axes); check the batch axis of "
          "your inputs and that the target has one entry per example.")
  k = n // batch_size
  pair = [k, batch_size] if minor else [batch_size, k]
  new_shape = shape[:axis] + pair + shape[axis + 1:]
  if all(isinstance(s, int) for s in new_shape):
    out = tf.reshape(t, new_shape)
  else:
    out = tf.reshape(t, tf.stack([tf.cast(s, tf.int32) for s in new_shape]))
  if minor:
    perm = list(range(out.shape.rank))
    perm[axis], perm[axis + 1] = perm[axis + 1], perm[axis]
    out = tf.transpose(out, perm)
  return out


def scale_examples(t, c, batch_size, axis: int = 0, minor: bool = False):
  """Multiplies the rows of each example of `t` (batch on `axis`) by `c[b]`.

  Where `c[b] == 0` the rows are exactly 0 even if they hold inf/NaN (a
  select, not a multiply: `0 * inf = NaN`), so a non-finite example with
  clip factor 0 contributes nothing. With the examples on axis 0,
  contiguous, the native op `TfPxgScaleRows` where it serves
  (float32/float64 on CPU outside XLA, same zero rule), else TF's
  broadcasting `multiply_no_nan` (one fused op under XLA).
  """
  axis = axis % t.shape.rank
  c = tf.cast(c, t.dtype)
  if axis == 0 and not minor and native.serves(t, (tf.float32, tf.float64)):
    return native.library().tf_pxg_scale_rows(t, c)  # Rows: one pass.
  shape = [1] * (t.shape.rank + 1)
  if isinstance(batch_size, int) and t.shape[axis] == batch_size:
    return tf.math.multiply_no_nan(
        t, tf.reshape(c, shape[1:axis + 1] + [batch_size] + shape[axis + 2:]))
  shape[axis + (1 if minor else 0)] = -1
  s = split_batch(t, batch_size, axis) if not minor else tf.reshape(
      t, tf.concat([tf.shape(t)[:axis], [-1, batch_size],
                    tf.shape(t)[axis + 1:]], 0))
  return tf.reshape(tf.math.multiply_no_nan(s, tf.reshape(c, shape)),
                    tf.shape(t))


def drop_examples(t, c, batch_size, axis: int = 0, minor: bool = False):
  """`t` with example b's rows (batch on `axis`) exactly 0 where `c[b] ==
  0`, unchanged elsewhere: `scale_examples` by the 0/1 mask `c != 0`.
  Tensors that are not floating point, or scalars, pass through.

  Outside XLA the pass over `t` runs only when some `c[b]` is 0 (a
  conditional on the `[B]` factors; either branch gives the same values);
  under XLA, where a conditional copies the tensors it passes, always (a
  select XLA fuses)."""
  if t is None or not t.dtype.is_floating or not t.shape.rank:
    return t
  nonzero = tf.not_equal(c, tf.zeros_like(c))

  def drop():
    return scale_examples(t, tf.cast(nonzero, t.dtype), batch_size, axis,
                          minor)

  if xla.in_xla_context():
    return drop()
  return tf.cond(tf.reduce_all(nonzero), lambda: tf.identity(t), drop)


def map_example_chunks(fn: Callable, tensors: Sequence[Any], batch_size,
                       chunk: int, signature):
  """`fn` over consecutive chunks of at most `chunk` examples, one at a time.

  Bounds what `fn` holds alive to one chunk's worth (e.g. a convolution's
  patch tensors for per-example norms): the chunks run in a `tf.map_fn`
  with `parallel_iterations=1`, so inside a graph the executor never runs two
  chunks at once. Works eagerly, in `tf.function` and under XLA, for a static
  or dynamic batch.

  The B examples are cut into n = ceil(B / chunk) chunks of one size
  c = ceil(B / n) (static when B is); when n*c > B the last chunk is moved
  back to end at example B, and its first n*c - B results (examples the
  previous chunk already gave) are dropped. If B <= chunk (static), `fn`
  runs once on the whole batch, with no loop.

  Args:
    fn: `fn(parts, n)` with `parts` the `tensors` cut to the same n
      consecutive examples and `n` that count (int, or scalar int32 tensor
      for a dynamic batch); returns a nest of tensors with one row per
      example on axis 0 (`[n, ...]`).
    tensors: tensors with the examples on axis 0, each example's rows
      contiguous (`[B*k, ...]` with k rows per example, k >= 1 per tensor).
      Not for batch-minor (interleaved) rows.
    batch_size: B, an int or a scalar int32 tensor.
    chunk: the most examples in one chunk, >= 1.
    signature: `fn`'s output structure as `tf.map_fn`'s
      `fn_output_signature` (dtypes or `tf.TensorSpec`s).

  Returns:
    `fn`'s outputs for the whole batch, each `[B, ...]`.

  Raises:
    ValueError: if `chunk` < 1.
  """
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1 example, got {chunk}")
  tensors = list(tensors)
  if isinstance(batch_size, int):
    if batch_size <= chunk:
      return fn(tensors, batch_size)
    n = -(-batch_size // chunk)
    c = -(-batch_size // n)
  else:
    b = tf.cast(batch_size, tf.int32)
    n = tf.maximum((b + chunk - 1) // chunk, 1)
    c = (b + n - 1) // n
  rows = [_rows_per_example(t, batch_size) for t in tensors]

  def one(start):
    parts = [_row_slice(t, start * k, c * k) for t, k in zip(tensors, rows)]
    return fn(parts, c)

  starts = tf.minimum(tf.range(n) * c, tf.cast(batch_size, tf.int32) - c)
  out = tf.map_fn(one, starts, fn_output_signature=signature,
                  parallel_iterations=1)
  return tf.nest.map_structure(
      lambda r: _drop_overlap(r, batch_size, n, c), out)


def _rows_per_example(t, batch_size):
  """k, the rows of `t` (axis 0) per example: an int if static."""
  rows = t.shape[0]
  if isinstance(rows, int) and isinstance(batch_size, int):
    return rows // batch_size
  return tf.shape(t)[0] // tf.maximum(tf.cast(batch_size, tf.int32), 1)


def _row_slice(t, begin, size):
  """Rows `[begin, begin + size)` of `t` (static size keeps static shape)."""
  rest = [0] * (t.shape.rank - 1)
  sizes = [size] + [-1] * len(rest)
  out = tf.slice(t, tf.stack([begin] + rest),
                 sizes if isinstance(size, int) else tf.stack(sizes))
  out.set_shape([size if isinstance(size, int) else None, *t.shape[1:]])
  return out


def _drop_overlap(r, batch_size, n, c):
  """`[n, c, ...]` chunk results -> `[B, ...]`, without the rows the
  shifted last chunk repeats."""
  if isinstance(n, int) and r.shape[2:].is_fully_defined():
    flat = tf.reshape(r, [n * c, *r.shape[2:]])
  else:
    flat = tf.reshape(r, tf.concat([[n * c], tf.shape(r)[2:]], 0))
  if isinstance(batch_size, int) and n * c == batch_size:
    return flat
  last = batch_size - (n - 1) * c
  return tf.concat([flat[:(n - 1) * c], flat[n * c - last:]], 0)


def row_sum_of_squares(t):
  """`[N, ...]` -> `[N]`: each row's sum of squares, in `t`'s dtype.

  The native op `TfPxgRowSumOfSquares` (one pass, vectorised, threaded)
  where it serves (`native.serves`: float32/float64 on CPU outside XLA),
  else TF's Square and Sum (which XLA fuses into one pass).
  """
  if native.serves(t, (tf.float32, tf.float64)):
    return native.library().tf_pxg_row_sum_of_squares(t)
  return tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), axis=1)


def batch_sq_norm(g):
  """`[B, ...]` -> `[B]` float32 squared norms."""
  if g.dtype == tf.float64:
    return tf.cast(row_sum_of_squares(g), tf.float32)
  return row_sum_of_squares(tf.cast(g, tf.float32))


def trace_note(**details) -> None:
  """Annotates the current rule call's record, e.g. `sq_norm="ghost"`
  (for `tf_pxg.testing.trace_rules`; the backprop owns the records:
  `tf_pxg.backprop.rule_trace`)."""
  rule_trace.note(**details)


# Per-example gradients a rule's `sq_norm` materialised, kept for the
# `weighted_sum` of the same interface in `ctx.kept` (the backprop's, one
# per backward pass): entry -> {param_index: (output gradients, g)}.
# Book-keeping clipping asks for the norms first and the weighted sums
# after; `sum_b c_b g_b` from a kept `[B, ...]` g costs B*|param|, while the
# weighted sum by TF's weight gradient costs what the non-private step's
# weight gradient does, B*R*|param| for R rows per example (a sequence, the
# positions of a convolution).


def cheap_to_keep(ctx: Context, shape) -> bool:
  """Whether holding a per-example gradient of `shape` (`[B, ...]`, a
  `tf.TensorShape` or list; None for unknown sizes) is cheap: its size is
  static and no larger than the interface's data operands and output
  gradient, which backprop holds anyway."""
  sizes = [tf.TensorShape(shape).num_elements()] + [
      t.shape.num_elements() for t in
      [ctx.dz] + [ctx.inputs[i] for i in ctx.data_indices]]
  return None not in sizes and sizes[0] <= sum(sizes[1:])


def keep_per_example(ctx: Context, g, payload=None) -> bool:
  """Keeps `g`, the interface's per-example gradient `[B, ...]` in any axis
  order (or `payload`, something holding it), for `take_per_example`, if
  `cheap_to_keep`. Returns whether it was kept."""
  if ctx.kept is None or not cheap_to_keep(ctx, g.shape):
    return False
  ctx.kept.setdefault(ctx.entry, {})[ctx.param_index] = (
      tuple(ctx.output_grads), g if payload is None else payload)
  return True


def take_per_example(ctx: Context):
  """What `keep_per_example` kept for this interface and these very
  output gradients (a persistent tape may ask about another target), or
  None. One use: it is released when taken."""
  slot = ctx.kept.get(ctx.entry) if ctx.kept is not None else None
  item = slot.pop(ctx.param_index, None) if slot else None
  if item is None:
    return None
  grads, g = item
  if len(grads) != len(ctx.output_grads) or any(
      a is not b for a, b in zip(grads, ctx.output_grads)):
    return None
  return g


def weighted_sum_of(g, c, dtype):
  """`sum_b c[b] g[b]` of a `[B, ...]` tensor, in `dtype`; a row with
  `c[b] == 0` adds exactly 0 even if it holds inf/NaN (`scale_examples`)."""
  trace_note(weighted_sum="from per-example")
  b = g.shape[0] if g.shape[0] is not None else tf.shape(g)[0]
  scaled = scale_examples(g, tf.cast(c, g.dtype), b)
  return tf.cast(tf.reduce_sum(scaled, axis=0), dtype)


def check_param_shared(ctx: Context, broadcasting: bool = False) -> None:
  """Raises if the parameter operand has rows on the batch axis.

  A parameter operand of the output's rank whose axis 0 has the output's
  (static) number of rows on the batch axis, more than one, gives each
  example its own rows: a rule that treats it as one shared tensor (the
  elementwise rules, the vectorized fallback) would pair example b with the
  whole of it. For an elementwise op with broadcasting (`broadcasting`),
  any axis 0 of more than one row is aligned with the batch axis. A parameter copied along the batch axis by `tf.broadcast_to`
  or `tf.tile` (`tf.repeat`) is followed (`tf_pxg.rules.copies`) when its
  copy count is the batch size; this is the case it was not.

  Raises:
    ValueError: naming the op, its layer and what to do.
  """
  p, out = ctx.param, ctx.outputs[0] if ctx.outputs else None
  if out is None or p.shape.rank is None or p.shape.rank != out.shape.rank:
    return
  rows = p.shape[0] if p.shape.rank else None
  if rows is None or rows == 1 or (rows != out.shape[0] and
                                   not broadcasting):
    return
  raise ValueError(
      f"{ctx.describe()} consumes a parameter-derived operand of shape "
      f"{p.shape} whose axis 0 lines up with the batch axis of its output "
      f"({rows} rows), so each example would use other rows of the "
      "parameter, and tf_pxg could not trace them to a copy of a shared "
      "parameter along the batch axis (tf.broadcast_to, tf.tile or "
      "tf.repeat of a weight B times, with B the static batch size of a [B] "
      "per-example target or tf.shape(x)[0] of the data). Copy the weight "
      "that way, or let the op broadcast it (give it a size-1 axis 0).")


def vectorized_per_example(ctx: Context):
  """Per-example gradient by running TF's gradient function per example.

  Every data input, output and output gradient is split into `[B, k, ...]`
  and `tf.vectorized_map` runs the op's gradient function on each example's
  `[k, ...]` slice. This is exact for any op whose output rows of example b
  depend only on example b's input rows.
  """
  trace_note(per_example="vectorized")
  data = list(ctx.data_indices)
  outs = [i for i, o in enumerate(ctx.outputs)
          if o.shape.rank and ctx.output_grads[i] is not None]
  elems = ([ctx.split_batch(ctx.inputs[i]) for i in data] +
           [ctx.split_batch(ctx.outputs[i]) for i in outs] +
           [ctx.split_batch(ctx.output_grads[i]) for i in outs])

  def one(args):
    ins, rest = args[:len(data)], args[len(data):]
    new_outs, new_grads = rest[:len(outs)], rest[len(outs):]
    inputs = list(ctx.inputs)
    for i, x in zip(data, ins):
      inputs[i] = x
    outputs = list(ctx.outputs)
    grads = list(ctx.output_grads)
    for i, o, g in zip(outs, new_outs, new_grads):
      outputs[i], grads[i] = o, g
    return to_dense(ctx.tf_gradient(grads, inputs=inputs, outputs=outputs))

  return tf.vectorized_map(one, elems, fallback_to_while_loop=True)


class Rule:
  """Base class of per-example rules. Override `per_example` at least.

  `drop_inputs` / `drop_outputs`: whether the default `weighted_sum` sets
  the rows of examples with clip factor 0 to zero in the data operands /
  outputs before TF's gradient function reads them (needed when that
  function reads them: `x^T dz` with an inf row of `x` and a zero row of
  `dz` is NaN). A rule whose gradient reads neither turns them off (in a
  `tf.function` the unused selects are pruned anyway; eagerly they cost a
  pass).

  What the engine must know about the op, beside the three forms, is here
  too, with defaults, so that adding an op touches its rule's file alone:

  * `layouts`: how the op moves the batch axis (`tf_pxg.interface.batch_axis`'s rule
    signature `layouts(entry, layouts) -> (output layouts, Mixing)`), used
    when the op type is not on the row-wise allowlist; None (default): the
    op is elementwise (`tf_pxg.interface.batch_axis.elementwise`). Only for ops whose
    output rows of example b depend on example b's input rows alone.
  * `batch_axes(itf)`: where the rule takes the examples, `(axis of the data
    operands, axis of the outputs or None)`; default `(0, 0)`.
  * `permutable(itf, axis)`: whether moving the batch axis `axis` of the
    data operands and outputs to 0 gives the same op on permuted tensors
    (the engine then does so, `tf_pxg.interface.normalise`); default False (the op
    must see the examples where `batch_axes` says).
  * `broadcasts_param`: the parameter is broadcast against the data
    (elementwise ops), so a size-1 parameter axis moves with the batch axis
    (a reshape of the parameter); default False.
  * `batch_first(itf, axis, minor)`: an op-specific rewrite that puts the
    examples of the data operand first (an Einsum's equation), or None.
  * `mergeable`: the rule acts row by row on its data, with no input that
    encodes the batch size, so the uses of one parameter by this op (the T
    steps of a loop) may be merged into one interface of `[B*K]` rows
    (`tf_pxg.per_example.merge_uses`); default False.
  * `chunked`: merged uses may be split into chunks of steps, because the
    rule adds up per-chunk results without concatenating the chunks' rows
    (a `chunked_sq_norm`, or per-example gradients the size of the
    parameter); default False.

  Two optional forms, None (default) where the rule has none, a method
  where it has (the engine tests `is not None`, and reads no member this
  class does not declare: `tests/test_registry_and_targets.py`):

  * `chunked_sq_norm(ctxs)`: `[B]` squared norms of the sum of one
    parameter's per-example gradients over the chunks `ctxs` of its merged
    uses, without materialising them (contractions: ghost terms of every
    pair of chunks); without it the engine adds the chunks' per-example
    gradients.
  * `outer_factors(ctx)`: the `tf_pxg.rules.factors.OuterFactors` of a
    matrix parameter's per-example gradient (sums of outer products), or
    None for that instance; with it, the uses of a tied parameter (an
    embedding and its LM head) get their cross terms from factors.
  """

  drop_inputs = True
  drop_outputs = True

  layouts: Optional[Callable] = None
  broadcasts_param = False
  mergeable = False
  chunked = False
  chunked_sq_norm: Optional[Callable] = None
  outer_factors: Optional[Callable] = None

  def batch_axes(self, itf) -> tuple:
    """`(data axis, output axis or None)` where this rule expects the
    examples of interface `itf` (a `tf_pxg.interface.classify.Interface`); None for
    the output: the rule finds it itself."""
    del itf
    return 0, 0

  def permutable(self, itf, axis: int) -> bool:
    """Whether interface `itf` stays the same op with the batch axis `axis`
    of its data operands and outputs moved to 0 (ranks are static)."""
    del itf, axis
    return False

  def batch_first(self, itf, axis: int, minor: bool):
    """`itf` rewritten with the examples of its data operand (on `axis`)
    first, or None where the rule has no such rewrite."""
    del itf, axis, minor
    return None

  def per_example(self, ctx: Context):
    """`[B, *param.shape]`: example b's gradient of the target's entry b."""
    return vectorized_per_example(ctx)

  def sq_norm(self, ctx: Context):
    """`[B]` float32: squared L2 norm of each example's gradient, from
    `per_example`; the per-example gradient is kept for `weighted_sum` if
    `cheap_to_keep` (biases, scales: `[B, |p|]` against the `[B, ...]`
    output gradient)."""
    trace_note(sq_norm="materialised")
    g = self.per_example(ctx)
    keep_per_example(ctx, g, _Materialised(g))
    return batch_sq_norm(g)

  def weighted_sum(self, ctx: Context, c):
    """`param.shape`: sum_b c[b] g_b. From the per-example gradient
    `sq_norm` kept, if any (one pass over `[B, |p|]` instead of scaling the
    output gradient and running TF's gradient over it); else via TF's
    gradient with scaled dz (and, per `drop_inputs`/`drop_outputs`, the
    rows of examples with `c[b] == 0` zeroed in what the gradient function
    reads, so that such an example adds exactly 0 even when non-finite)."""
    kept = take_per_example(ctx)
    if isinstance(kept, _Materialised):
      return weighted_sum_of(kept.g, c, ctx.param_dtype)
    axis = ctx.copy_axis or 0  # Where the outputs hold the examples.
    grads = [None if g is None or not g.shape.rank else
             ctx.scale_examples(g, c, axis) for g in ctx.output_grads]
    inputs, outputs = ctx.dropped_io(c, self.drop_inputs, self.drop_outputs)
    return ctx.tf_gradient(grads, inputs=inputs, outputs=outputs)

  def check(self, ctx: Context) -> None:
    """Raises ValueError if this op instance has no per-example gradient."""


@dataclasses.dataclass(frozen=True)
class _Materialised:
  """What the default `Rule.sq_norm` keeps: the per-example gradient
  `[B, *param.shape]` (a rule with its own `sq_norm` keeps its own kind)."""
  g: Any


class _FunctionRule(Rule):

  def __init__(self, fn: Callable):
    self._fn = fn

  def per_example(self, ctx):
    return self._fn(ctx)


def as_rule(rule_like) -> Rule:
  if isinstance(rule_like, Rule):
    return rule_like
  if inspect.isclass(rule_like) and issubclass(rule_like, Rule):
    return rule_like()
  if callable(rule_like):
    return _FunctionRule(rule_like)
  raise TypeError(f"Cannot register {rule_like!r} as a per-example rule: "
                  "expected a Rule subclass, instance, or function(ctx).")


def register(op_type: str, rule=None, *, override: bool = False):
  """Registers a per-example rule for TF op type `op_type` (`tf_pxg.register`).

  The one register idiom of every plug point (docs/extending.md): a call,
  `tf_pxg.register("MyOp", MyOpRule)`, or a decorator on a `Rule` subclass
  (instantiated with no arguments), a `Rule` instance, or a plain function
  `per_example(ctx)` (wrapped so `sq_norm` and `weighted_sum` take the
  defaults):

      @tf_pxg.register("MyOp")
      class MyOpRule(tf_pxg.rules.base.Rule):
        def per_example(self, ctx):
          ...

  Args:
    op_type: the op's type as in `tf.Operation.type`, e.g. "MatMul".
    rule: the rule (class, instance or function); None: return a decorator.
    override: replace an existing rule instead of raising (keyword only).

  Returns:
    `rule` as given (the call form), or the decorator (which returns its
    argument).

  Raises:
    ValueError: `op_type` is not a non-empty string, or already has a rule
      and `override` is False.
    TypeError: `rule` is not a Rule subclass, instance or function.
  """
  if not isinstance(op_type, str) or not op_type:
    raise ValueError(f"tf_pxg.register: the op type must be a non-empty "
                     f"string such as 'MatMul'; got {op_type!r}.")

  def decorator(rule_like):
    registry.add(op_type, as_rule(rule_like), override)
    return rule_like
  return decorator if rule is None else decorator(rule)
