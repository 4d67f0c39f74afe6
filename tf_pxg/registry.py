"""The per-example rule registry: one dict keyed by TF op type.

A rule turns the gradients at an op that consumes a parameter (the
*interface*) into per-example quantities. See `tf_pxg.rules.base.Rule`.
"""

from __future__ import annotations

from typing import Dict

_RULES: Dict[str, "object"] = {}


def add(op_type: str, rule, override: bool = False) -> None:
  """Stores `rule` (a `tf_pxg.rules.base.Rule`) for `op_type`.

  Users register through `tf_pxg.register` (`tf_pxg.rules.base.register`),
  which converts classes and functions to rules first. The registry itself
  imports no rule: the built-in rules register when `tf_pxg.rules` is
  imported, which the engine (`tf_pxg.per_example.backward`, `tf_pxg.interface.batch_axis`)
  and the public names `tf_pxg.register` / `tf_pxg.registered_op_types` do.

  Raises:
    ValueError: if `op_type` already has a rule and `override` is False.
  """
  if op_type in _RULES and not override:
    raise ValueError(
        f"A per-example rule for op type '{op_type}' is already registered "
        f"({type(_RULES[op_type]).__name__}). Pass override=True to "
        "tf_pxg.register to replace it.")
  _RULES[op_type] = rule


def lookup(op_type: str):
  """The rule registered for `op_type`, or None."""
  return _RULES.get(op_type)


def registered_op_types() -> list:
  """Sorted op types that have a rule (used to build error messages)."""
  return sorted(_RULES)


def unregister(op_type: str) -> None:
  """Removes a rule (for tests of user registration)."""
  _RULES.pop(op_type, None)
