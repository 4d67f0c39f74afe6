"""The plug points' registries: one idiom, and the built-ins in one list.

tf_pxg has four kinds of parts that users add by name:

============================  ==========================================
kind                          table, and how to add one
============================  ==========================================
per-example rule (op type)    `tf_pxg.register("OpType")` (`tf_pxg.registry`)
sampler                       `tf_pxg.data.samplers.register("name")`
noise mechanism               `tf_pxg.dp.mechanisms.register("name")`
clipping policy               `tf_pxg.dp.clipping.register("name")`
============================  ==========================================

All four register the same way: a decorator `@register(name)` on the
class, or `register(name, obj)`; a name that is taken by another object
raises `ValueError` unless `override=True`. The tables of the last three
are plain dicts (`SAMPLINGS`, `MECHANISMS`, `POLICIES` in their modules),
filled through `add` below.

Built-ins. `BUILTIN_MODULES` lists, per kind, the modules that register
the built-in parts: the one place to look for what is built in, and the
modules `load_builtins` imports the first time a name of that kind is
resolved or listed, in a fresh process too
(`fit(sampling="balls_in_bins")` needs no import first). The modules are
named by strings and imported with importlib, so this module imports none
of them (and nothing of tf_pxg: the data and DP layers both use it).

`tests/test_parts.py` has a table with a case for every registered part
of the three kinds and fails when a part has none, as
`test_every_registered_op_has_a_case` does for the rules.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Optional

__all__ = ["BUILTIN_MODULES", "add", "load_builtins", "name_of"]

#: The modules that register the built-in parts, per kind (see the
#: module docstring). A new built-in part's module goes here.
BUILTIN_MODULES: Dict[str, tuple] = {
    "sampler": ("tf_pxg.data.samplers", "tf_pxg.data.balls_in_bins",
                "tf_pxg.data.truncated_poisson"),
    "noise mechanism": ("tf_pxg.dp.mechanisms", "tf_pxg.dp.blt"),
    "clipping policy": ("tf_pxg.dp.clipping", "tf_pxg.dp.norm_tracking"),
}

_loaded = set()


def load_builtins(kind: str) -> None:
  """Imports `BUILTIN_MODULES[kind]` (once per process), which registers
  the built-in parts of that kind.

  Raises:
    KeyError: an unknown kind.
  """
  if kind in _loaded:
    return
  _loaded.add(kind)  # before importing: the modules call `add`
  for module in BUILTIN_MODULES[kind]:
    importlib.import_module(module)


def add(table: dict, kind: str, name: str, obj=None, *,
        override: bool = False,
        check: Optional[Callable[[object], Optional[str]]] = None):
  """Registers `obj` under `name` in `table` (a decorator when `obj` is
  None): the body of every part kind's `register`.

  Args:
    table: the kind's dict, name -> part.
    kind: "sampler", "noise mechanism" or "clipping policy" (messages).
    name: a non-empty string.
    obj: the part (a class); None: return a decorator.
    override: replace the part registered under `name`.
    check: returns why `obj` cannot be a part of this kind (None: it can).

  Returns:
    `obj` (or the decorator, which returns its argument).

  Raises:
    ValueError: `name` is not a non-empty string; `check` refuses `obj`;
      `name` already names another part and `override` is False.
  """
  def register(part):
    if not isinstance(name, str) or not name:
      raise ValueError(f"register: a {kind} name must be a non-empty "
                       f"string; got {name!r}.")
    why = None if check is None else check(part)
    if why is not None:
      raise ValueError(f"register({name!r}): {part!r} is not a {kind}: "
                       f"{why}")
    taken = table.get(name)
    if taken is not None and taken is not part and not override:
      raise ValueError(
          f"register: the {kind} name {name!r} already names {taken!r}; "
          "choose another name, or pass override=True to replace it.")
    table[name] = part
    return part
  return register if obj is None else register(obj)


def name_of(table: dict, part) -> Optional[str]:
  """The name `part` is registered under in `table` (the object itself,
  not an equal one), or None."""
  for name, registered in table.items():
    if registered is part:
      return name
  return None
