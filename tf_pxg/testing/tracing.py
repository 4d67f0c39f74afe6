"""`trace_rules`: which rule, and which form of it, ran at each interface
(the records live in the backprop's `tf_pxg.backprop.rule_trace`)."""

from __future__ import annotations

import contextlib
from typing import Dict, List


@contextlib.contextmanager
def trace_rules():
  """Records which rule, and which form of it, runs at each interface op.

  Yields a list that receives one dict per rule call made by tf_pxg's
  per-example engine while the context is active (in `tf.function` and XLA
  at trace time): `op_type`, `rule` (the rule's class name;
  `"_VectorizedFallback"` for an op type without a rule or outside its
  rule's scope), `form` (`"per_example"`, `"sq_norm"` or `"weighted_sum"`)
  and, where the rule says, how it computed it: `sq_norm` is `"ghost"`,
  `"materialised"` or `"native"` (a native op, e.g. a 2-D convolution's
  norms on CPU outside XLA); `per_example` is `"vectorized"` when TF's gradient ran
  under `tf.vectorized_map` (the generic fallback) instead of a closed form.

    with tf_pxg.testing.trace_rules() as records:
      tape.per_example_norms(losses, variables)
    assert {r["sq_norm"] for r in records if r["op_type"] == "MatMul"} == {
        "ghost"}
  """
  from tf_pxg.backprop import rule_trace  # pylint: disable=g-import-not-at-top
  records: List[Dict[str, str]] = []
  with rule_trace.recording(records):
    yield records
