"""The boundary for TF/Keras internals (`tf_pxg._compat`) and the supported
version range (`tf_pxg._versions`).

Each internal access is exercised by name, so an upgrade that moves one
fails here with a message naming it.
"""

import pathlib
import re
import subprocess
import sys

import pytest

from tf_pxg import _compat
from tf_pxg import _versions

_PACKAGE = pathlib.Path(_compat.__file__).parent

# Internals used outside _compat (none). Listed so that nothing slips in.
_KNOWN_OUTSIDE = {}


@pytest.mark.parametrize("name", sorted(_compat.ACCESSES))
def test_internal_access_available(name):
  _compat.check(name)


def test_moved_access_is_named(monkeypatch):
  def moved():
    raise AttributeError("module has no attribute '_MockOp'")

  monkeypatch.setitem(_compat.ACCESSES, "_MockOp", moved)
  with pytest.raises(_compat.CompatError, match=r"'_MockOp'.*supports "
                     r"tensorflow>="):
    _compat.check("_MockOp")


_INTERNAL = re.compile(
    r"^\s*(from|import)\s+(keras\.src|tensorflow\.python)[\w.]*|"
    r"\b__internal__\b|"
    r"\._(MockOp|aggregate_grads|SymGrad|gradient_registry|python_function|"
    r"autograph|experimental_autograph_options|flat_metrics|"
    r"flat_weighted_metrics|flatten_y|call_has_training_arg|"
    r"get_regularization_losses|loss_tracker|flatten_layers|flat_losses|"
    r"compile_loss|compile_metrics|symbolic_build|seed_generators|"
    r"get_own_losses)\b|"
    r"\"_(compile_loss|compile_metrics|flatten_layers|seed_generators|id|"
    r"value)\"")


def test_no_internal_access_outside_compat():
  found = {}
  for path in _PACKAGE.rglob("*.py"):
    rel = path.relative_to(_PACKAGE).as_posix()
    if rel == "_compat.py":
      continue
    for line in path.read_text(encoding="utf-8").splitlines():
      code = line.split("#", 1)[0]
      m = _INTERNAL.search(code)
      if m:
        found.setdefault(rel, set()).add(m.group(0).strip())
  unexpected = {}
  for rel, hits in found.items():
    allowed = _KNOWN_OUTSIDE.get(rel, set())
    rest = {h for h in hits if not any(a in h for a in allowed)}
    if rest:
      unexpected[rel] = sorted(rest)
  assert not unexpected, (
      "TF/Keras internals used outside tf_pxg/_compat.py (route them "
      f"through it, with the reason no public API serves): {unexpected}")


def test_version_range_accepts_supported_pairs():
  _versions.check("2.16.2", "3.7.0")
  _versions.check("2.21.0", "3.15.1")


@pytest.mark.parametrize("tf_version,keras_version,bad", [
    ("2.15.1", "3.7.0", "TensorFlow 2.15.1"),
    ("2.22.0", "3.7.0", "TensorFlow 2.22.0"),
    ("2.22.0rc0", "3.15.1", "TensorFlow 2.22.0rc0"),
    ("2.16.2", "2.15.0", "Keras 2.15.0"),
    ("2.16.2", "3.6.0", "Keras 3.6.0"),
    ("2.21.0", "3.16.0", "Keras 3.16.0"),
])
def test_unsupported_version_names_the_range(tf_version, keras_version, bad,
                                             monkeypatch):
  monkeypatch.delenv("TF_PXG_ALLOW_UNSUPPORTED", raising=False)
  with pytest.raises(ImportError) as e:
    _versions.check(tf_version, keras_version)
  assert bad in str(e.value)
  assert _versions.supported_range() in str(e.value)
  monkeypatch.setenv("TF_PXG_ALLOW_UNSUPPORTED", "1")
  with pytest.warns(RuntimeWarning, match="tf_pxg supports"):
    _versions.check(tf_version, keras_version)


def test_lowest_bound_is_setup_py_bound():
  setup = (_PACKAGE.parent / "setup.py").read_text(encoding="utf-8")
  low_tf, high_tf = (".".join(map(str, v)) for v in _versions.TENSORFLOW)
  low_k, high_k = (".".join(map(str, v)) for v in _versions.KERAS)
  assert f'"tensorflow>={low_tf},<{high_tf}"' in setup
  assert f'"keras>={low_k},<{high_k}"' in setup


def _fresh(code: str) -> str:
  return subprocess.run([sys.executable, "-c", code], check=True,
                        capture_output=True, text=True).stdout.strip()


def test_registry_imports_no_rule_and_tf_pxg_no_tensorflow():
  source = (_PACKAGE / "registry.py").read_text(encoding="utf-8")
  imports = [line for line in source.splitlines()
             if re.match(r"\s*(from|import)\s", line)]
  assert imports == ["from __future__ import annotations",
                     "from typing import Dict"]
  out = _fresh("import sys, tf_pxg, tf_pxg.registry; "
               "print('tensorflow' in sys.modules, "
               "'tf_pxg.rules' in sys.modules)")
  assert out == "False False"
  out = _fresh("import tf_pxg; print('MatMul' in tf_pxg.registered_op_types())")
  assert out == "True"
