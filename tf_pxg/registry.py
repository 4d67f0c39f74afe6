"""The per-example rule registry: one dict keyed by TF op type.

A rule turns the gradients at an op that consumes a parameter (the
*interface*) into per-example quantities. See `tf_pxg.rules.base.Rule`.
"""

from __future__ import annotations

from typing import Callable, Dict, Union

_RULES: Dict[str, "object"] = {}


def register(op_type: str, override: bool = False) -> Callable:
  """Registers a per-example rule for TF op type `op_type`.

  Use as a decorator on a `tf_pxg.rules.base.Rule` subclass (instantiated with
  no arguments), a `Rule` instance, or a plain function `per_example(ctx)`
  (wrapped so `sq_norm` and `weighted_sum` take the defaults):

      @tf_pxg.register("MyOp")
      class MyOpRule(tf_pxg.rules.base.Rule):
        def per_example(self, ctx):
          ...

  Args:
    op_type: the op's type as in `tf.Operation.type`, e.g. "MatMul".
    override: replace an existing rule instead of raising.

  Raises:
    ValueError: if `op_type` already has a rule and `override` is False.
  """
  def decorator(rule_like: Union[type, object, Callable]):
    _load_builtin_rules()  # So a user rule meets the built-in ones now.
    from tf_pxg.rules import base  # pylint: disable=import-outside-toplevel
    rule = base.as_rule(rule_like)
    if op_type in _RULES and not override:
      raise ValueError(
          f"A per-example rule for op type '{op_type}' is already registered "
          f"({type(_RULES[op_type]).__name__}). Pass override=True to "
          "tf_pxg.register to replace it.")
    _RULES[op_type] = rule
    return rule_like
  return decorator


def _load_builtin_rules() -> None:
  import tf_pxg.rules  # noqa: F401  pylint: disable=import-outside-toplevel


def lookup(op_type: str):
  """The rule registered for `op_type`, or None."""
  _load_builtin_rules()
  return _RULES.get(op_type)


def registered_op_types() -> list:
  """Sorted op types that have a rule (used to build error messages)."""
  _load_builtin_rules()
  return sorted(_RULES)


def unregister(op_type: str) -> None:
  """Removes a rule (for tests of user registration)."""
  _RULES.pop(op_type, None)
