"""Deprecated names: one helper for every renamed argument and attribute.

One idea has one name (`min_separation` for b of b-min-separation
participation; Choquette-Choo et al. 2023). The names users had before
(`num_bands=` of the accounting, `num_groups=` of the samplers,
`participation_groups` of the mechanisms) keep working: `argument` maps an
old keyword to the new one and `alias` makes an old attribute read the new
one, both with a `DeprecationWarning` that names the new name.

Who is warned: the caller of the old name, when it is not a `tf_pxg`
module, nor Keras or TensorFlow walking every attribute (Keras' saving
reads each attribute of a model or optimizer). tf_pxg's own modules use
the new names (`tests/test_parts.py::
test_tf_pxg_uses_the_new_names_and_does_not_warn` checks the ones that
moved); a module of the package that still forwards an old name while it
moves (e.g. the CLI's deprecated `--num_bands` flag) must not make a
user's `fit` or command print a warning that the user cannot act on.

Imports nothing of tf_pxg (the accounting, the data and the DP layers all
use it).
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from typing import Any, Tuple

__all__ = ["NOT_GIVEN", "alias", "argument", "warn"]


class _NotGiven:
  """The default of a deprecated keyword argument (None is a value the
  old argument was checked against, so it cannot mean "not given")."""

  def __repr__(self):
    return "<not given>"


NOT_GIVEN = _NotGiven()

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_is_user(depth: int) -> bool:
  """Whether the frame `depth` levels above the caller of this function is
  outside the tf_pxg package."""
  frame = inspect.currentframe()
  for _ in range(depth + 1):
    frame = None if frame is None else frame.f_back
  if frame is None:
    return True
  # By file, not module name: `python -m tf_pxg.cli` runs as __main__.
  path = os.path.abspath(frame.f_code.co_filename)
  return not path.startswith(_PACKAGE_DIR) and not any(
      path.startswith(d) for d in _framework_dirs())


def _framework_dirs() -> Tuple[str, ...]:
  """The directories of the frameworks whose attribute walks read every
  attribute of an object (Keras' saving, TensorFlow's tracking): such a
  read is not the user's use of an old name, so it does not warn."""
  dirs = []
  for name in ("keras", "tensorflow", "tf_keras"):
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path:
      dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
  return tuple(dirs)


def warn(old: str, new: str, where: str, depth: int = 2) -> None:
  """`DeprecationWarning`: `where`'s `old` is now `new` (only for callers
  outside tf_pxg; `depth` counts the frames from the caller of `warn` up to
  the code that used the old name)."""
  if _caller_is_user(depth):
    warnings.warn(
        f"{where}: `{old}` is deprecated; use `{new}` (the same value: b "
        "of b-min-separation participation).", DeprecationWarning,
        stacklevel=depth + 1)


def argument(new_value: Any, old_value: Any, *, new: str, old: str,
             where: str, default: Any, depth: int = 3) -> Tuple[Any, str]:
  """The value of a renamed keyword argument, and the name to put in error
  messages (the one the caller used).

  Args:
    new_value: the new keyword's value (`default` if not given).
    old_value: the deprecated keyword's value (`NOT_GIVEN` if not given).
    new, old: the two names.
    where: the function, for the messages.
    default: the new keyword's default.
    depth: frames from the caller of `argument` up to the user's call
      (3: `argument` is called by the function the user called).

  Raises:
    ValueError: both names given with different values.
  """
  if old_value is NOT_GIVEN:
    return new_value, new
  warn(old, new, where, depth)
  if new_value != default and new_value != old_value:
    raise ValueError(f"{where}: got {new}={new_value!r} and its deprecated "
                    f"alias {old}={old_value!r}; pass only {new}.")
  return old_value, old


def alias(old: str, new: str) -> property:
  """A read-only property for the deprecated attribute `old` that returns
  `self.<new>`, with a `DeprecationWarning` (the class assigns it to
  `old`)."""

  def get(self):
    warn(old, new, type(self).__name__, depth=2)
    return getattr(self, new)

  return property(get, doc=f"Deprecated alias of `{new}`.")
