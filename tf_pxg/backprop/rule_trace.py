"""Which rule, and which form of it, the per-example backprop ran.

Instrumentation for `tf_pxg.testing.trace_rules`, owned by the backprop:
while `recording(records)` is active on a thread, `PerExampleBackprop`
appends one record per rule call (`call`) and rules annotate the form they
took (`note`, through `tf_pxg.rules.base.trace_note`). The state is
thread-local, so a trace on one thread does not collect another thread's
rule calls.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, List

_local = threading.local()


def _stack() -> list:
  if not hasattr(_local, "stack"):
    _local.stack = []
  return _local.stack


@contextlib.contextmanager
def recording(records: List[Dict[str, str]]):
  """Appends this thread's rule calls to `records` for the block."""
  stack = _stack()
  stack.append(records)
  try:
    yield records
  finally:
    stack.remove(records)


def call(op_type: str, rule, form: str) -> None:
  """Records that `rule.<form>` runs for an `op_type` interface (if tracing)."""
  stack = _stack()
  if stack:
    stack[-1].append({"op_type": op_type, "rule": type(rule).__name__,
                      "form": form})


def note(**details) -> None:
  """Annotates the current rule call's record, e.g. `sq_norm="ghost"`."""
  stack = _stack()
  if stack and stack[-1]:
    stack[-1][-1].update(details)
