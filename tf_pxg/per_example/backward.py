"""The per-example engine: one backward pass to the interface, then rules.

`PerExampleBackprop` answers the tape's three per-example questions:

1. phase 1 backpropagates the target down to the interface entries
   (`tf_pxg.interface.classify`), computing data gradients with TF's gradient
   functions and skipping the parameter inputs. Before it, every op on the
   data path, from the inputs to the target, is checked against the
   allowlist of ops that keep examples apart (`tf_pxg.interface.batch_axis`), so a
   per-example result is never computed for examples that mix. Each
   interface is then put in the form its rule expects: examples first
   (`tf_pxg.interface.normalise.normalise_batch_axis`, for data whose batch axis
   was tracked elsewhere), and the uses of one parameter
   value by one kind of op (the T steps of an unrolled loop, a layer called
   twice) merged into one interface (`tf_pxg.per_example.merge_uses`);
2. each interface's rule (`tf_pxg.registry`) gives per-example gradients,
   squared norms or clip-weighted sums for its PARAM input;
3. phase 2 carries those through the PARAM-only region (casts, reshapes,
   `W + A @ B`) to the sources: weighted sums with ordinary gradient
   functions, per-example gradients with batched ones.

Norms take a rule's `sq_norm` shortcut (ghost norms, Goodfellow's trick)
when a source reaches exactly one (possibly merged) interface through
norm-preserving ops;
a matrix source with several uses of its own (a tied embedding's lookup and
LM head) takes each use's `sq_norm` plus the cross terms between the uses
from their outer-product factors (`tf_pxg.rules.factors`) where that is
cheaper than materialising; otherwise the source's per-example gradient is
materialised and summed over its uses first (a tied weight's norm is the
norm of the sum, not the sum of norms).
"""

from __future__ import annotations

import collections
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_pxg.interface import batch_copies
from tf_pxg.tape import control_flow
from tf_pxg.tape import recording
from tf_pxg.per_example import merge_uses
from tf_pxg.interface import normalise
from tf_pxg import registry
from tf_pxg.backprop import gradient_functions
from tf_pxg.backprop import rule_trace
from tf_pxg.backprop.imperative_grad import imperative_grad
from tf_pxg.interface.classify import (DATA, PARAM, Classifier, Interface,
                              data_path)
from tf_pxg.interface.refusals import (check_examples_independent,
                              check_no_data_writes, check_no_host_reads)
from tf_pxg.interface import pre_tape
from tf_pxg.rules import base
from tf_pxg.rules import factors
from tf_pxg.tape.recording import Entry, Recorder, tensor_id

# Ops through which a per-example gradient keeps its norm (phase 2 shortcut).
# A slice's gradient puts each entry in a distinct place among zeros
# (a position table's first T rows, `table[:T]`).
_NORM_PRESERVING = ("ReadVariableOp", "Identity", "Cast", "Reshape",
                    "ExpandDims", "Squeeze", "Transpose", "StridedSlice",
                    "Slice")


class _VectorizedFallback(base.Rule):
  """Unregistered ops: TF's gradient under tf.vectorized_map, per example."""


_FALLBACK = _VectorizedFallback()


class PerExampleBackprop:
  """One per-example backward pass over a recorder's entries.

  Args:
    recorder: the tape's recorder.
    target: a `[B]` per-example target, or a scalar that is a sum over examples.
    source_ids: one tensor id per source (None for an unwatched source).
    output_gradients: optional gradient of the target (defaults to ones).
    source_names: one name per source, for error messages.
  """

  def __init__(self, recorder: Recorder, target, source_ids: Sequence[Optional[int]],
               output_gradients=None, source_names: Optional[Sequence[str]] = None):
    self._recorder = recorder
    # What rules' sq_norm kept for their weighted_sum (`base.keep_per_example`).
    self._kept: dict = {}
    # Products several interfaces share (`base.shared_product`).
    self._grams: dict = {}
    self._source_names = dict(zip(source_ids, source_names or ()))
    self._producer = recorder.producer
    self._source_ids = list(source_ids)
    self.vector_target = target.shape.rank is None or target.shape.rank > 0
    if target.shape.rank and target.shape.rank > 1:
      raise ValueError(
          f"A per-example target must have shape [B] (one value per example) "
          f"or be a scalar sum over examples; got shape {target.shape}. "
          "Reduce the non-batch axes of your loss first, e.g. "
          "tf.reduce_sum(losses, axis=range(1, rank)).")
    if self.vector_target:
      static_b = target.shape[0]
      self.batch_size = static_b if static_b is not None else tf.shape(target)[0]
    else:
      self.batch_size = None
    known = [s for s in self._source_ids if s is not None]
    self._classifier = Classifier(
        recorder, known,
        self.batch_size if isinstance(self.batch_size, int) else None)
    if output_gradients is None:
      output_gradients = tf.ones_like(target)
    self._origin_cache = {}
    self.interfaces = merge_uses.merge(
        self._phase_one(tensor_id(target), output_gradients),
        merge_uses.ValueKeys(self._producer, self._classifier, known),
        lambda itf: self._context(itf).batch_size)
    self._uses = collections.defaultdict(list)
    for itf in self.interfaces:
      self._uses[itf.param_id].append(itf)

  # Phase 1 ------------------------------------------------------------------

  def _phase_one(self, target_id: int, output_gradient) -> List[Interface]:
    classifier = self._classifier
    param_ids = classifier.param_ids()
    found: List[Interface] = []

    def backward(entry, out_grads, skip):
      if not classifier.is_interface(entry):
        if recording.custom_gradient_name(entry) is not None:
          return self._checked_custom_gradient(entry, out_grads, skip)
        return gradient_functions.call_gradient_function(entry, out_grads, skip)
      params = classifier.param_inputs(entry)
      self._check_visible(entry)
      data = classifier.data_inputs(entry)
      minor = classifier.is_batch_minor(entry)
      for i in params:
        found.append(Interface(entry, i, list(out_grads), data, minor))
      skip = sorted(set(skip) | set(params))
      if len(skip) == len(entry.inputs):
        return [None] * len(entry.inputs)
      return gradient_functions.call_gradient_function(entry, out_grads, skip)

    if classifier.status.get(target_id) == PARAM:
      raise ValueError(
          "The target depends on the parameters but on no input that carries "
          "examples, so it has no per-example gradients. Pass the batch as a "
          "tf.function argument (captured eager tensors become constants) and "
          "the target as a [B] vector of per-example values.")
    path = data_path(self._recorder, target_id, classifier)
    for entry in path:  # Loops and calls the tape cannot see into first.
      self._check_visible(entry)
    check_examples_independent(path, classifier, self.vector_target)
    check_no_data_writes(self._recorder, classifier)
    check_no_host_reads(self._recorder, classifier)
    pre_tape.check_no_pre_tape_values(
        self._recorder.entries, classifier.status, self._recorder.examples,
        self._recorder.start_uid)
    imperative_grad(self._producer, {target_id: [output_gradient]}, param_ids,
                    backward)
    for itf in found:  # The rule says where it takes the examples.
      itf.rule = registry.lookup(itf.entry.op_type) or _FALLBACK
    found = [normalise.normalise_batch_axis(itf, classifier.layout)
             for itf in found]
    for itf in found:
      try:
        itf.rule.check(self._context(itf))
      except NotImplementedError:  # This instance is outside the rule's scope.
        itf.rule = _FALLBACK
      if itf.rule is _FALLBACK:  # It splits the data, not the parameter.
        base.check_param_shared(self._context(itf))
    return found

  def _checked_custom_gradient(self, entry: Entry, out_grads, skip) -> list:
    """Runs a `tf.custom_gradient` on the data path (no parameter input)
    and checks that its gradient keeps examples apart, as the forward ops
    are checked: its ops are recorded, each output gradient standing for
    the rows of its output, and every op from them to the gradients of the
    data inputs must be on the allowlist and leave each input's gradient on
    the input's batch axis. A TF gradient function is row-wise wherever its
    op is; a custom one is arbitrary Python (`dy * mean(x, axis=0)`)."""
    sub = Recorder()
    sub.start()
    try:
      grads = gradient_functions.call_gradient_function(entry, out_grads, skip)
    finally:
      sub.stop()
    bridges = [Entry("Identity", (o,), (g,), (), None, entry.scope)
               for o, g in zip(entry.outputs, out_grads) if g is not None]
    checked = bridges + _as_checked(sub.entries, self._rows_of_examples)
    combined = _Recording(list(self._recorder.entries) + checked)
    classifier = Classifier(
        combined, [s for s in self._source_ids if s is not None],
        self.batch_size if isinstance(self.batch_size, int) else None)
    own = {id(e) for e in checked}
    for i in self._classifier.data_inputs(entry):
      g = grads[i]
      if g is None:
        continue
      gid = tensor_id(g)
      path = [e for e in data_path(combined, gid, classifier) if id(e) in own]
      try:
        check_examples_independent(path, classifier, self.vector_target)
      except ValueError as e:
        loop = any(p.op_type in control_flow.LOOP_OPS for p in path)
        raise ValueError(
            f"The gradient of {entry.describe()} does not keep examples "
            f"apart: {e} A custom gradient is run on the whole batch, so "
            "tf_pxg checks its ops as it checks the forward's; compute it "
            "from each example's own rows."
            + (" Its graph loop (a while_loop inside a tf.function) is not "
               "recorded op by op, so it cannot be shown to keep each "
               "example's rows: ask this per-example question eagerly, "
               "where each of the loop's ops is checked, or write the "
               "gradient without a graph loop." if loop else "")) from e
      want = self._classifier.layout(entry.input_ids[i])
      got = (classifier.layout(gid) if classifier.status.get(gid) == DATA
             else want)
      if self.batch_size != 1 and got != want:
        raise ValueError(
            f"The gradient of {entry.describe()} for its input {i} holds "
            f"the examples on axis {got and got[0]}, not on the input's "
            f"axis {want and want[0]}, so tf_pxg cannot tell each example's "
            "gradient (no per-example gradient, no DP guarantee). Return "
            "each input's gradient in the input's layout.")
    return grads

  def _rows_of_examples(self, t) -> bool:
    """Whether `t` is data holding examples on its batch axis (more than
    one row there, unless the batch is one example)."""
    tid = tensor_id(t)
    layout = self._classifier.layout(tid)
    if self._classifier.status.get(tid) != DATA or layout is None:
      return False
    rank = t.shape.rank
    if rank is None or layout[0] >= rank:
      return False
    dim = t.shape[layout[0]]
    return dim is None or dim > 1 or self.batch_size == 1

  def _check_visible(self, entry: Entry) -> None:
    """Raises for a loop or call whose body the tape did not record, or a
    `tf.custom_gradient` function, that uses a parameter, naming the
    function and the variables."""
    params = self._classifier.param_inputs(entry)
    if params and recording.custom_gradient_name(entry) is not None:
      raise control_flow.custom_gradient_error(entry, self._names(
          entry.input_ids[i] for i in params))
    if (params and control_flow.is_opaque(entry) and
        registry.lookup(entry.op_type) is None):
      raise control_flow.opaque_op_error(entry, self._names(
          entry.input_ids[i] for i in params))

  def _names(self, param_ids) -> list:
    """Names of the sources the PARAM tensors `param_ids` come from."""
    names = []
    for pid in param_ids:
      for s in sorted(self._origins(pid)[0]):
        name = self._source_names.get(s, f"source {s}")
        if name not in names:
          names.append(name)
    return names

  def _context(self, itf: Interface) -> base.Context:
    b = self.batch_size
    if b is None and itf.copy_axis is not None:  # A copied parameter.
      b = batch_copies.copy_batch_size(itf.entry, itf.copy_axis)
    if b is None:  # Scalar target: each data operand's axis 0 is the batch.
      if not itf.data_indices:
        raise ValueError(
            f"{itf.entry.describe()} consumes a parameter but no input that "
            "carries examples on axis 0 was found, so its per-example "
            "gradient is undefined. Pass a [B] per-example target.")
      d = itf.entry.inputs[itf.data_indices[0]]
      b = d.shape[0] if d.shape[0] is not None else tf.shape(d)[0]
    return base.Context(itf.entry, itf.param_index, itf.output_grads, b,
                        itf.data_indices, itf.batch_minor, self._kept,
                        itf.copy_axis, self._grams)

  # Rules --------------------------------------------------------------------

  def _apply(self, itf: Interface, form: str, *args):
    rule = itf.rule
    ctx = self._context(itf)
    rule_trace.call(itf.entry.op_type, rule, form)
    try:
      return _reshape_back(itf, form, getattr(rule, form)(ctx, *args))
    except (ValueError, TypeError, NotImplementedError, LookupError,
            tf.errors.InvalidArgumentError) as e:
      if rule is not _FALLBACK:
        raise
      # A plain NotImplementedError: tf.function's AutoGraph re-raises that
      # type with its message, but turns subclasses into StagingError.
      raise NotImplementedError(
          f"{itf.entry.describe()} consumes a parameter and has no "
          f"per-example rule; the vectorized fallback failed ({e}). Register "
          f"one:\n\n  @tf_pxg.register('{itf.entry.op_type}')\n"
          "  class MyRule(tf_pxg.rules.base.Rule):\n"
          "    def per_example(self, ctx):  # -> [B, *ctx.param.shape]\n"
          "      ...\n\nOp types with rules: "
          f"{', '.join(registry.registered_op_types())}.") from e

  # Phase 2 ------------------------------------------------------------------

  def _param_backprop(self, initial: Dict[int, List[Any]], batched: bool):
    stop = {s for s in self._source_ids if s is not None}
    if batched:
      backward = _batched_backward
      zeros = lambda t: tf.zeros(tf.concat([[self._batch_for_zeros()],
                                            tf.shape(t)], 0), t.dtype)
    else:
      backward = lambda e, g, skip: gradient_functions.call_gradient_function(
          e, g, skip)
      zeros = None
    return imperative_grad(self._producer, initial, stop, backward, zeros)

  def _batch_for_zeros(self):
    if self.batch_size is not None:
      return self.batch_size
    return self._context(self.interfaces[0]).batch_size

  def _gather(self, results: Dict[int, Any]) -> list:
    return [None if s is None else results.get(s) for s in self._source_ids]

  def per_example_gradients(self, source_subset: Optional[set] = None) -> list:
    """`[B, *source.shape]` per source (None where not connected)."""
    initial = collections.defaultdict(list)
    reaching = (None if source_subset is None else
                {pid for pid in self._uses
                 if self._origins(pid)[0] & source_subset})
    for itf in self.interfaces:
      if reaching is None or itf.param_id in reaching:
        initial[itf.param_id].append(self._apply(itf, "per_example"))
    results = self._param_backprop(initial, batched=True)
    return [None if g is None else base.to_dense(g)
            for g in self._gather(results)]

  def _origins(self, pid: int):
    """(sources reached from PARAM tensor `pid`, reached via norm-preserving ops only)."""
    if pid not in self._origin_cache:
      self._origin_cache[pid] = self._walk_to_sources(pid)
    return self._origin_cache[pid]

  def _walk_to_sources(self, pid: int):
    sources = {s for s in self._source_ids if s is not None}
    stack, seen, found, simple = [pid], set(), set(), True
    while stack:
      t = stack.pop()
      if t in seen:
        continue
      seen.add(t)
      if t in sources:
        found.add(t)
        continue
      entry = self._producer.get(t)
      if entry is None:
        continue
      params = self._classifier.param_inputs(entry)
      if entry.op_type not in _NORM_PRESERVING or len(params) != 1:
        simple = False
      stack.extend(entry.input_ids[i] for i in params)
    return found, simple

  def sq_norms(self):
    """`[B]` float32 squared global norms over all sources."""
    total = [term for _, term in self._sq_norm_terms()]
    if not total:
      return tf.zeros([self._batch_for_zeros()], tf.float32)
    return tf.add_n(total)

  def group_sq_norms(self, group_of: Dict[int, int], num_groups: int):
    """`[G, B]` float32: row g the squared per-example norms over the
    sources of group g (`group_of` maps a source's tensor id to its group
    in `range(num_groups)`), in the one backward pass of `sq_norms`.

    Every term `sq_norms` adds up is one source's (a ghost norm, a merged
    use's chunked norm, a tied matrix's uses with their cross terms, or a
    materialised per-example gradient: a parameter tensor that reaches
    several sources is materialised per source there), so the groups'
    norms are sums of the same terms, no extra materialisation; a group
    no term reaches has norms 0."""
    rows = [[] for _ in range(num_groups)]
    for source, term in self._sq_norm_terms():
      rows[group_of[source]].append(term)
    zeros = None
    out = []
    for terms in rows:
      if terms:
        out.append(tf.add_n(terms))
      else:
        if zeros is None:
          zeros = tf.zeros([self._batch_for_zeros()], tf.float32)
        out.append(zeros)
    return tf.stack(out)

  def _sq_norm_terms(self) -> list:
    """`(source id, [B] float32 squared norms)` terms whose sum over all
    is the squared global norm; each term is one source's."""
    uses_per_source = collections.Counter()
    for pid in self._uses:
      for s in self._origins(pid)[0]:
        uses_per_source[s] += len(self._uses[pid])
    total = []
    materialize = set()
    shared = collections.defaultdict(list)  # source -> its unmerged uses
    for pid, itfs in self._uses.items():
      found, simple = self._origins(pid)
      alone = (simple and len(found) == 1 and
               uses_per_source[next(iter(found))] == len(itfs))
      if alone and len(itfs) == 1:
        total.append((next(iter(found)),
                      tf.cast(self._apply(itfs[0], "sq_norm"), tf.float32)))
      elif alone and _one_chunk_set(itfs):
        total.append((next(iter(found)), self._chunked_sq_norm(itfs)))
      elif (simple and len(found) == 1 and
            all(itf.chunk_set is None for itf in itfs)):
        shared[next(iter(found))].extend(itfs)
      else:
        materialize |= found
    for s, itfs in shared.items():
      norms = None
      if s not in materialize and uses_per_source[s] == len(itfs):
        norms = self._shared_sq_norm(s, itfs)
      if norms is None:
        materialize.add(s)
      else:
        total.append((s, norms))
    if materialize:
      for s, g in zip(self._source_ids,
                      self.per_example_gradients(materialize)):
        if g is not None:
          total.append((s, base.batch_sq_norm(g)))
    return total

  def _chunked_sq_norm(self, itfs: List[Interface]):
    """`[B]` squared norms of one parameter's per-example gradient, the sum
    over the chunks `itfs` of its merged uses: the rule's `chunked_sq_norm`
    where it has one (contractions: ghost terms of every pair of chunks),
    else the norm of the sum of the chunks' per-example gradients."""
    rule = itfs[0].rule
    if rule.chunked_sq_norm is not None:
      rule_trace.call(itfs[0].entry.op_type, rule, "chunked_sq_norm")
      return rule.chunked_sq_norm([self._context(itf) for itf in itfs])
    return base.batch_sq_norm(tf.add_n(
        [base.to_dense(self._apply(itf, "per_example")) for itf in itfs]))

  def _shared_sq_norm(self, source: int, itfs: List[Interface]):
    """`[B]` squared norms of the sum of a 2-D parameter's per-example
    gradients over its uses `itfs` (each use one interface of its own: a
    tied embedding's lookup and LM head), or None where that cannot be
    done without materialising: `sum_u ||G^u_b||^2` (each rule's `sq_norm`)
    `+ 2 sum_{u<v} <G^u_b, G^v_b>` (`tf_pxg.rules.factors.inner`, from
    outer-product factors, so no `[B, V, d]` gradient), when every use's
    rule has `outer_factors`, reaches `source` through reads, casts and
    2-D transposes, and the cross terms cost fewer multiply-adds than
    materialising the uses' gradients."""
    found = []
    for itf in itfs:
      swap = self._factor_orientation(itf.param_id, source)
      if (swap is None or itf.original_param_shape is not None or
          itf.copy_axis is not None or
          itf.rule.outer_factors is None):
        return None
      found.append((itf, swap))
    terms, parts = [], []
    for itf, swap in found:
      rule_trace.call(itf.entry.op_type, itf.rule, "outer_factors")
      f = itf.rule.outer_factors(self._context(itf))
      if f is None:
        return None
      parts.append(f.transposed() if swap else f)
    shape = [p.left.size for p in parts[:1]] + [p.right.size
                                                   for p in parts[:1]]
    rows = [p.rows for p in parts]
    costs = [factors.inner_cost(u, v) for i, u in enumerate(parts)
             for v in parts[i + 1:]]
    if None in rows + costs + shape:
      return None
    if sum(costs) >= sum(rows) * shape[0] * shape[1]:
      return None  # Materialising the uses' gradients is cheaper.
    for itf, _ in found:
      terms.append(tf.cast(self._apply(itf, "sq_norm"), tf.float32))
    for i, u in enumerate(parts):
      terms.extend(2.0 * factors.inner(u, v) for v in parts[i + 1:])
    return tf.add_n(terms)

  def _factor_orientation(self, pid: int, source: int) -> Optional[bool]:
    """Whether the PARAM tensor `pid` is the 2-D `source` transposed
    (True) or as it is (False), through reads, identities, casts and 2-D
    transposes; None for any other path."""
    swap = False
    while pid != source:
      entry = self._producer.get(pid)
      if entry is None or self._classifier.param_inputs(entry) != [0]:
        return None
      if entry.op_type == "Transpose":
        perm = tf.get_static_value(entry.inputs[1])
        if perm is None or list(perm) != [1, 0]:
          return None
        swap = not swap
      elif entry.op_type not in ("ReadVariableOp", "Identity", "Cast"):
        return None
      pid = entry.input_ids[0]
    return swap

  def weighted_sums(self, c) -> list:
    """`sum_b c[b] g_b` per source, the shape of the source.

    The parameter-only region takes the weighted sum through ordinary
    gradient functions, which are linear in the output gradient. A
    `tf.custom_gradient` there need not be (a gradient clipped inside it):
    the sources behind one get `sum_b c[b] g_b` of their materialised
    per-example gradients instead, each example through the custom
    gradient on its own."""
    initial = collections.defaultdict(list)
    for itf in self.interfaces:
      initial[itf.param_id].append(self._apply(itf, "weighted_sum", c))
    sums = self._gather(self._param_backprop(initial, batched=False))
    behind = self._behind_custom_gradients()
    if behind:
      for k, g in enumerate(self.per_example_gradients(behind)):
        if self._source_ids[k] in behind and g is not None:
          sums[k] = base.weighted_sum_of(g, c, g.dtype)
    return sums

  def group_weighted_sums(self, factors: Sequence[Any],
                          group_of: Dict[int, int]) -> list:
    """`sum_b factors[g][b] g_b` per source s of group `g = group_of[s]`
    (`factors` one `[B]` vector per group), the shape of the source.

    Each interface whose parameter tensor reaches the sources of one group
    takes its weighted sum with that group's factors, carried through the
    parameter-only region as in `weighted_sums`. A parameter tensor that
    reaches sources of several groups (`W = A + B`, A and B in different
    groups) cannot be weighted once for all of them: its sources (and the
    sources behind a `tf.custom_gradient`, as in `weighted_sums`) get
    `sum_b factors[g][b] g_b` of their materialised per-example gradients.
    """
    initial = collections.defaultdict(list)
    mixed = set()
    for itf in self.interfaces:
      found = self._origins(itf.param_id)[0]
      groups = {group_of[s] for s in found}
      if len(groups) > 1:
        mixed |= found
      elif groups:
        initial[itf.param_id].append(
            self._apply(itf, "weighted_sum", factors[groups.pop()]))
    sums = self._gather(self._param_backprop(initial, batched=False))
    exact = self._behind_custom_gradients() | mixed
    if exact:
      for k, g in enumerate(self.per_example_gradients(exact)):
        s = self._source_ids[k]
        if s in exact and g is not None:
          sums[k] = base.weighted_sum_of(g, factors[group_of[s]], g.dtype)
    return sums

  def _behind_custom_gradients(self) -> set:
    """The sources that some interface reaches through a
    `tf.custom_gradient` in the parameter-only region."""
    behind, seen = set(), set()
    stack = list(self._uses)
    while stack:
      t = stack.pop()
      entry = self._producer.get(t)
      if t in seen or entry is None:
        continue
      seen.add(t)
      params = [entry.input_ids[i]
                for i in self._classifier.param_inputs(entry)]
      if recording.custom_gradient_name(entry) is not None:
        for pid in params:
          behind |= self._origins(pid)[0]
      stack.extend(params)
    return behind


def _as_checked(entries: List[Entry], rows_of_examples) -> list:
  """`entries` as the custom-gradient check reads them: TF's idiom for the
  gradient of a broadcast operand,
  `Reshape(Sum(g, BroadcastGradientArgs(Shape(t), Shape(u))[k]),
  Shape(t))` (axes known only at run time), folded into one elementwise
  entry of `g` and `t`, when `t` holds examples on its batch axis and has
  the rank of `g`: the sum then runs over the axes where `t` has size 1,
  never the batch axis (a reduced batch axis could not be reshaped back to
  `t`'s rows), and the folded entry checks that `g` and `t` hold the
  examples on the same axis. A graph loop (`While`) stays as it is: its
  body is not recorded op by op, so nothing shows that it keeps each
  example's rows, and the check refuses it (eagerly its ops are recorded
  and checked one by one)."""
  producer = {t: e for e in entries for t in e.output_ids}
  folded, replaced = {}, set()
  for s in entries:  # Axes known when tracing: the reduction as it is.
    args = producer.get(s.input_ids[1]) if s.op_type == "Sum" else None
    if args is not None and args.op_type == "BroadcastGradientArgs":
      axes = _broadcast_axes(args, args.output_ids.index(s.input_ids[1]))
      if axes is not None:
        with tf.init_scope():
          axes = tf.constant(axes, tf.int32)
        folded[id(s)] = Entry("Sum", (s.inputs[0], axes), s.outputs, s.attrs,
                              s.op, s.scope)
  for r in entries:
    if r.op_type != "Reshape" or len(r.inputs) != 2:
      continue
    s = producer.get(r.input_ids[0])
    shape = producer.get(r.input_ids[1])
    if s is None or s.op_type != "Sum" or id(s) in folded or (
        shape is None or shape.op_type != "Shape"):
      continue
    args = producer.get(s.input_ids[1])
    if args is None or args.op_type != "BroadcastGradientArgs":
      continue
    k = args.output_ids.index(s.input_ids[1])
    t, g = shape.inputs[0], s.inputs[0]
    if (args.input_ids[k] != r.input_ids[1] or not rows_of_examples(t) or
        t.shape.rank != g.shape.rank):
      continue
    folded[id(r)] = Entry("Identity", (g, t), r.outputs, (), None, r.scope)
    replaced.add(id(s))
  return [folded.get(id(e), e) for e in entries if id(e) not in replaced]


def _broadcast_axes(args: Entry, k: int):
  """The axes `BroadcastGradientArgs` gives operand `k` to reduce over, as
  a list, where both shapes are known when tracing; else None."""
  shapes = [tf.get_static_value(t) for t in args.inputs]
  if any(v is None for v in shapes):
    return None
  rank = max(len(v) for v in shapes)
  padded = [[1] * (rank - len(v)) + [int(d) for d in v] for v in shapes]
  mine, other = padded[k], padded[1 - k]
  return [j for j in range(rank)
          if j < rank - len(shapes[k]) or (mine[j] == 1 and other[j] != 1)]


class _Recording:
  """Entries and their producers, as `Classifier` and `data_path` read a
  `Recorder` (a recording extended with a custom gradient's ops)."""

  def __init__(self, entries: List[Entry]):
    self.entries = entries
    self.producer = {t: e for e in entries for t in e.output_ids}


def _one_chunk_set(itfs: List[Interface]) -> bool:
  """Whether `itfs` are all the chunks of one merged group."""
  sets = {id(itf.chunk_set) if itf.chunk_set is not None else None
          for itf in itfs}
  return len(itfs) > 1 and None not in sets and len(sets) == 1


def _reshape_back(itf: Interface, form: str, result):
  """A rule's result for a reshaped parameter operand, in the original shape
  (`tf_pxg.interface.normalise.normalise_batch_axis` moves size-1 axes)."""
  shape = itf.original_param_shape
  if shape is None or form == "sq_norm":
    return result
  result = base.to_dense(result)
  if form == "per_example":
    return tf.reshape(result, tf.concat([tf.shape(result)[:1],
                                         shape.as_list()], 0))
  return tf.reshape(result, shape.as_list())


def _batched_backward(entry: Entry, out_grads: list, skip: list) -> list:
  """Backward for `[B, ...]` output gradients of a PARAM-only entry."""
  n = len(entry.inputs)
  keep = [i for i in range(n) if i not in skip]
  t = entry.op_type
  if t in ("ReadVariableOp", "Identity") and keep == [0]:
    return [out_grads[0]] + [None] * (n - 1)
  if t == "Cast":
    return [tf.cast(out_grads[0], entry.inputs[0].dtype)]
  if t in ("Reshape", "ExpandDims", "Squeeze") and keep == [0]:
    g = out_grads[0]
    shape = tf.concat([tf.shape(g)[:1], tf.shape(entry.inputs[0])], 0)
    return [tf.reshape(g, shape)] + [None] * (n - 1)

  def one(gs):
    grads = gradient_functions.call_gradient_function(entry, list(gs), skip)
    return [base.to_dense(grads[i]) for i in keep]

  batched = [g if g is not None else None for g in out_grads]
  outs = tf.vectorized_map(one, batched, fallback_to_while_loop=True)
  result = [None] * n
  for i, g in zip(keep, outs):
    result[i] = g
  return result
