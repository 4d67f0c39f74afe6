"""The supported TensorFlow / Keras range, checked at `import tf_pxg`.

Read from the installed distributions' metadata, so the check imports
neither TensorFlow nor Keras (`tf_pxg.accounting` and the `tf-pxg` command
start without them). `setup.py` states the same bounds; the README's
"Supported versions" table gives the pairs CI tests (`.ci/run`).

Set `TF_PXG_ALLOW_UNSUPPORTED=1` to turn the error into a warning (at your
own risk: `tests/test_compat.py` names what moved).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings

# (lowest supported, first unsupported). Keep in step with setup.py.
TENSORFLOW = ((2, 16), (2, 22))
KERAS = ((3, 7), (3, 16))

# Distributions that provide the `tensorflow` module.
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-intel",
                     "tensorflow-macos", "tf-nightly", "tf-nightly-cpu")


def _fmt(v) -> str:
  return ".".join(str(p) for p in v)


def supported_range() -> str:
  """The supported range in words (used in the error and the README)."""
  return (f"tensorflow>={_fmt(TENSORFLOW[0])},<{_fmt(TENSORFLOW[1])} with "
          f"keras>={_fmt(KERAS[0])},<{_fmt(KERAS[1])}")


def parse(version: str) -> tuple:
  """'2.16.2' -> (2, 16, 2); '2.22.0rc1' / '2.22.0.dev2025' -> (2, 22, 0)."""
  parts = []
  for piece in version.split(".")[:3]:
    m = re.match(r"\d+", piece)
    if m is None:
      break
    parts.append(int(m.group()))
  return tuple(parts)


def _installed(names) -> tuple:
  for name in names:
    try:
      return name, importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
  return None, None


def problems(tf_version=None, keras_version=None) -> list:
  """Messages for each of TensorFlow / Keras outside the range (versions
  read from the installed metadata unless given)."""
  out = []
  if tf_version is None:
    _, tf_version = _installed(_TF_DISTRIBUTIONS)
  if keras_version is None:
    _, keras_version = _installed(("keras", "keras-nightly"))
  for name, version, (low, high) in (("TensorFlow", tf_version, TENSORFLOW),
                                     ("Keras", keras_version, KERAS)):
    if version is None:
      continue  # Not installed as a distribution we know: import will tell.
    v = parse(version)
    if not low <= v[:len(low)] or not v[:len(high)] < high:
      out.append(f"{name} {version} is installed")
  return out


def check(tf_version=None, keras_version=None) -> None:
  """Raises ImportError naming the supported range if TensorFlow or Keras
  is outside it (a warning with `TF_PXG_ALLOW_UNSUPPORTED=1`)."""
  found = problems(tf_version, keras_version)
  if not found:
    return
  message = (f"tf_pxg supports {supported_range()}; "
             + " and ".join(found) + ". Install a supported pair, e.g. "
             f"pip install 'tensorflow>={_fmt(TENSORFLOW[0])},"
             f"<{_fmt(TENSORFLOW[1])}' 'keras>={_fmt(KERAS[0])},"
             f"<{_fmt(KERAS[1])}' (or set TF_PXG_ALLOW_UNSUPPORTED=1 to try "
             "anyway).")
  refuse(message)


def refuse(message: str) -> None:
  """Raises `ImportError(message)`, or, with `TF_PXG_ALLOW_UNSUPPORTED=1`,
  warns (`RuntimeWarning`, at the caller's caller) and returns."""
  if os.environ.get("TF_PXG_ALLOW_UNSUPPORTED") == "1":
    warnings.warn(message, RuntimeWarning, stacklevel=4)
    return
  raise ImportError(message)
