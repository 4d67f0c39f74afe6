"""The boundary for TF/Keras internals (`tf_pxg._compat`) and the supported
version range (`tf_pxg._versions`).

Each internal access is exercised by name, so an upgrade that moves one
fails here with a message naming it.
"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from tf_pxg import _compat
from tf_pxg import _versions

_PACKAGE = pathlib.Path(_compat.__file__).parent

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


# The guard: the code of every module but _compat.py, read as an AST (so
# comments and docstrings do not count, and late imports inside functions
# do). What counts as an internal access or a monkeypatch:
#
# * importing `tensorflow.python*` or `keras.src*` (statement, or a string
#   passed to a call or used as a key: `importlib.import_module`,
#   `sys.modules.get`);
# * an attribute `__internal__` anywhere (`tf.__internal__...`);
# * a `_`-prefixed attribute of TF or Keras: on a chain rooted at a name
#   bound to tensorflow / keras, or (statically the object's type is not
#   known) any `_`-prefixed attribute, or `getattr`/`setattr`/`hasattr`
#   name, that tf_pxg itself does not define;
# * assigning an attribute (`x.a = ...`, `setattr(x, ...)`, `del x.a`) of
#   a TF/Keras module or class: `x` rooted at tensorflow / keras, or a
#   local name bound from such a chain or from a `_compat` call.
_FOREIGN_MODULES = ("tensorflow", "keras", "tf_keras")
_INTERNAL_PREFIXES = ("tensorflow.python", "keras.src")


def _root(node):
  while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node.id if isinstance(node, ast.Name) else None


# Public API despite the underscore (namedtuples).
_PUBLIC = ("_replace", "_asdict", "_fields", "_make", "_field_defaults")


def _private(name) -> bool:
  return (isinstance(name, str) and name.startswith("_") and
          name not in _PUBLIC and
          not (name.startswith("__") and name.endswith("__")))


def defined_names(sources) -> set:
  """Names tf_pxg defines (functions, classes, assigned names and
  attributes, imported aliases): a `_`-prefixed attribute among them is
  tf_pxg's own."""
  names = set()
  for source in sources:
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                           ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
      elif isinstance(node, ast.Attribute) and isinstance(node.ctx,
                                                         ast.Store):
        names.add(node.attr)
      elif isinstance(node, ast.alias):
        names.add(node.asname or node.name.split(".")[-1])
      elif isinstance(node, ast.arg):
        names.add(node.arg)
      elif isinstance(node, ast.Call) and len(node.args) > 1 and isinstance(
          node.args[1], ast.Constant) and (
              getattr(node.func, "id", None) == "setattr" or
              getattr(node.func, "attr", None) == "__setattr__"):
        names.add(node.args[1].value)  # object.__setattr__(self, "_x", v)
  return names


def internal_uses(source: str, own_names: set) -> list:
  """`(line, what)` for each internal access or monkeypatch in `source`."""
  tree = ast.parse(source)
  foreign = set()  # Names bound to TF/Keras modules.
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in _FOREIGN_MODULES:
          foreign.add(a.asname or a.name.split(".")[0])
    elif isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split(".")[0] in _FOREIGN_MODULES):
      foreign.update(a.asname or a.name for a in node.names)
  # Local names bound from TF/Keras chains or from `_compat` calls.
  bound = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and (
        _root(node.value) in foreign or _root(node.value) == "_compat"):
      bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
  patchable = foreign | bound
  found = []

  def hit(node, what):
    found.append((node.lineno, what))

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith(_INTERNAL_PREFIXES):
          hit(node, f"import {a.name}")
    elif isinstance(node, ast.ImportFrom):
      module = node.module or ""
      names = [f"{module}.{a.name}" for a in node.names]
      if module.startswith(_INTERNAL_PREFIXES) or any(
          n.startswith(_INTERNAL_PREFIXES) for n in names):
        hit(node, f"from {module} import ...")
    elif isinstance(node, ast.Attribute):
      root = _root(node)
      if node.attr == "__internal__":
        hit(node, f"{root}...__internal__")
      elif _private(node.attr) and (root in foreign or
                                    node.attr not in own_names):
        hit(node, f"{root}...{node.attr}")
      if isinstance(node.ctx, (ast.Store, ast.Del)) and root in patchable:
        hit(node, f"monkeypatch {root}...{node.attr}")
    elif isinstance(node, ast.Call):
      fn = node.func.id if isinstance(node.func, ast.Name) else None
      args = [a.value for a in node.args if isinstance(a, ast.Constant)]
      for value in args:
        if isinstance(value, str) and value.startswith(_INTERNAL_PREFIXES):
          hit(node, f"'{value}'")
      if fn in ("getattr", "setattr", "hasattr", "delattr") and (
          len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
        name = node.args[1].value
        if _private(name) and (_root(node.args[0]) in foreign or
                               name not in own_names):
          hit(node, f"{fn}(..., '{name}')")
      if fn in ("setattr", "delattr") and node.args and (
          _root(node.args[0]) in patchable):
        hit(node, f"monkeypatch {fn}({_root(node.args[0])}, ...)")
    elif isinstance(node, ast.Subscript) and isinstance(
        node.slice, ast.Constant) and isinstance(node.slice.value, str) and (
            node.slice.value.startswith(_INTERNAL_PREFIXES)):
      hit(node, f"['{node.slice.value}']")
  return sorted(set(found))


def _package_sources():
  return {path.relative_to(_PACKAGE).as_posix(): path.read_text(
      encoding="utf-8") for path in sorted(_PACKAGE.rglob("*.py"))}


def test_no_internal_access_outside_compat():
  sources = _package_sources()
  own = defined_names(sources.values())
  unexpected = {}
  for rel, source in sources.items():
    if rel == "_compat.py":
      continue
    uses = internal_uses(source, own)
    if uses:
      unexpected[rel] = uses
  assert not unexpected, (
      "TF/Keras internals or monkeypatches outside tf_pxg/_compat.py "
      "(route them through it, with the reason no public API serves): "
      f"{unexpected}")


_PLANTED = """\
import importlib
import keras
import tensorflow as tf
from tensorflow.python.eager import backprop
from tf_pxg import _compat


def f(x, model):
  import keras.src.backend as kb
  a = tf.__internal__.nest.flatten(x)
  b = x._keras_mask
  c = getattr(model, "_compile_loss", None)
  d = importlib.import_module("tensorflow.python.ops.array_ops")
  tf.function.__call__ = None
  keras.layers.Dense.call = None
  backend = _compat.keras_backend_module()
  backend.rnn = None
  setattr(backend, "gru", None)
  return x._own_private_name + tf.constant(1.0)._id
"""

_PLANTED_HITS = {
    4: "from tensorflow.python.eager import ...",
    9: "import keras.src.backend",
    10: "tf...__internal__",
    11: "x..._keras_mask",
    12: "getattr(..., '_compile_loss')",
    13: "'tensorflow.python.ops.array_ops'",
    14: "monkeypatch tf...__call__",
    15: "monkeypatch keras...call",
    17: "monkeypatch backend...rnn",
    18: "monkeypatch setattr(backend, ...)",
    19: "tf..._id",
}


def test_guard_catches_planted_violations():
  """Each kind of access, planted in a module's source, is reported at its
  line; tf_pxg's own private names (`_own_private_name`) are not."""
  uses = internal_uses(_PLANTED, {"_own_private_name"})
  assert {line for line, _ in uses} == set(_PLANTED_HITS), uses
  for line, what in _PLANTED_HITS.items():
    assert (line, what) in uses, (line, what, uses)
  clean = "import tensorflow as tf\n\ndef g(x):\n  return tf.nn.relu(x)\n"
  assert internal_uses(clean, set()) == []


def test_guard_reads_a_planted_module_of_the_package(tmp_path):
  """The package scan reads module files: a temporary module with a
  monkeypatch is found, one without is not."""
  bad = tmp_path / "bad.py"
  bad.write_text("import tensorflow as tf\n\n\ndef install():\n"
                 "  tf.Variable.assign = None\n", encoding="utf-8")
  good = tmp_path / "good.py"
  good.write_text("import tensorflow as tf\n\n\ndef f(x):\n"
                  "  return tf.identity(x)\n", encoding="utf-8")
  own = defined_names(_package_sources().values())
  assert internal_uses(bad.read_text(encoding="utf-8"), own) == [
      (5, "monkeypatch tf...assign")]
  assert internal_uses(good.read_text(encoding="utf-8"), own) == []


def test_patches_install_and_uninstall():
  """`tf.function.__call__` is TF's own until a recorder starts; the
  patch is undone by `control_flow.uninstall` and comes back on the next
  recording."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_pxg  # pylint: disable=g-import-not-at-top
  from tf_pxg.tape import control_flow  # pylint: disable=g-import-not-at-top
  cls = _compat.tf_function_class()
  with tf_pxg.GradientTape():
    pass
  assert _compat.patched("tf.function.__call__")
  wrapper = cls.__call__
  control_flow.uninstall()
  try:
    assert not _compat.patched("tf.function.__call__")
    original = cls.__call__
    assert original is wrapper.__wrapped__ and original is not wrapper
    assert tf.function(lambda: tf.constant(2.0))().numpy() == 2.0
  finally:
    with tf_pxg.GradientTape():
      pass
  assert _compat.patched("tf.function.__call__")
  assert cls.__call__.__wrapped__ is original


def test_custom_gradient_patch_installs_and_uninstalls():
  """TF's `record.record_operation` (the internal
  `tensorflow.python.eager.record.record_operation`, which eager
  `tf.custom_gradient` calls) is TF's own until a recorder starts; the
  patch is undone by `control_flow.uninstall`, and then an eager custom
  gradient is missed again, which is what the patch is for."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_pxg  # pylint: disable=g-import-not-at-top
  from tf_pxg.tape import control_flow  # pylint: disable=g-import-not-at-top
  record = _compat._tf_module("tensorflow.python.eager.record")  # pylint: disable=protected-access

  @tf.custom_gradient
  def f(x):
    return tf.square(x), lambda dy: dy * 7.0

  def grad():
    x = tf.constant([1.0, 2.0])
    with tf_pxg.GradientTape() as tape:
      tape.watch(x)
      y = tf.reduce_sum(f(x))
    return tape.gradient(y, x).numpy()

  np.testing.assert_allclose(grad(), [7.0, 7.0])
  assert _compat.patched("record.record_operation")
  wrapper = record.record_operation
  control_flow.uninstall()
  try:
    assert not _compat.patched("record.record_operation")
    assert record.record_operation is wrapper.__wrapped__
    with tf.GradientTape() as plain:  # TF's tape is served as before.
      x = tf.constant([1.0, 2.0])
      plain.watch(x)
      y = tf.reduce_sum(f(x))
    np.testing.assert_allclose(plain.gradient(y, x).numpy(), [7.0, 7.0])
    x = tf.constant([1.0, 2.0])
    with tf_pxg.GradientTape() as tape:  # The recorder re-installs it ...
      control_flow.uninstall()  # ... so take it away while recording.
      tape.watch(x)
      y = tf.reduce_sum(f(x))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [2.0, 4.0])
  finally:
    with tf_pxg.GradientTape():
      pass
  assert record.record_operation.__wrapped__ is wrapper.__wrapped__
  np.testing.assert_allclose(grad(), [7.0, 7.0])


def test_custom_gradient_patch_installed_while_autograph_converts(tmp_path):
  """The first recorder may start in code AutoGraph converts (as
  `tf_pxg.probability` does on import), which converts the installed
  wrapper too (another caller frame); it must still tell custom
  gradients' calls apart (a fresh process, where
  the patch is first installed there; a script file, since AutoGraph
  needs the source, which `python -c` does not keep)."""
  script = tmp_path / "first_recorder_in_autograph.py"
  script.write_text(
      "import tensorflow as tf, tf_pxg\n"
      "from tf_pxg.tape import recording\n"
      "recorder = recording.Recorder()\n"
      "@tf.function\n"
      "def traced(x):\n"
      "  recorder.start()\n"  # A call AutoGraph converts (a `with` is not).
      "  y = x * x\n"
      "  recorder.stop()\n"
      "  return y\n"
      "traced(tf.constant([1.0]))\n"
      "@tf.custom_gradient\n"
      "def f(x):\n"
      "  return tf.square(x), lambda dy: dy * 7.0\n"
      "x = tf.constant([1.0, 2.0])\n"
      "with tf_pxg.GradientTape() as tape:\n"
      "  tape.watch(x)\n"
      "  y = tf.reduce_sum(f(x))\n"
      "print(tape.gradient(y, x).numpy().tolist())\n", encoding="utf-8")
  out = subprocess.run([sys.executable, str(script)], check=True,
                       capture_output=True, text=True).stdout.strip()
  assert out.splitlines()[-1] == "[7.0, 7.0]"


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
