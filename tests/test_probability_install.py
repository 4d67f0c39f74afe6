"""The [probability] extra: which TFP and tf-keras fit which TensorFlow.

`tf_pxg.probability._tfp_import` reads the installed versions without
importing TFP and raises an ImportError naming them and the one pip
command that fits. Its table is checked here at both ends of the supported
range; the module is loaded from its file, so these tests also run where
TFP is not installed (the main suite's venv), and there importing
`tf_pxg.probability` must raise that error instead of TFP's traceback.
.ci/run installs the extra at both ends and checks that TensorFlow and
Keras did not move.
"""

import importlib.metadata
import importlib.util
import pathlib

import pytest

import tf_pxg

_PATH = pathlib.Path(tf_pxg.__file__).parent / "probability" / "_tfp_import.py"


@pytest.fixture(scope="module")
def tfp_import():
  spec = importlib.util.spec_from_file_location("_tfp_import_under_test",
                                                _PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# (TensorFlow, TFP, tf-keras, what the problems must mention; () = fits).
CASES = [
    ("2.21.0", "0.25.0", "2.21.0", ()),
    ("2.18.1", "0.25.0", "2.18.0", ()),
    ("2.17.1", "0.24.0", "2.17.0", ()),
    ("2.16.2", "0.24.0", "2.16.0", ()),
    ("2.16.2", "0.25.0", "2.16.0", ("tensorflow-probability 0.25.0", "0.24.x")),
    ("2.21.0", "0.24.0", "2.21.0", ("tensorflow-probability 0.24.0", ">= 0.25")),
    ("2.16.2", "0.24.0", "2.21.0", ("tf-keras 2.21.0",)),
    ("2.21.0", "0.25.0", "2.20.0", ("tf-keras 2.20.0",)),
    ("2.21.0", None, "2.21.0", ("not installed",)),
    ("2.21.0", "0.25.0", None, ("tf-keras", "not installed")),
]


@pytest.mark.parametrize("tf_version,tfp_version,tf_keras_version,mentions",
                         CASES)
def test_problems_table(tfp_import, tf_version, tfp_version,
                        tf_keras_version, mentions):
  found = tfp_import.problems(tf_version, tfp_version, tf_keras_version)
  assert bool(found) == bool(mentions), found
  text = "; ".join(found)
  for word in mentions:
    assert word in text, (word, text)


@pytest.mark.parametrize("tf_version,command", [
    ("2.16.2", 'pip install "tf_pxg[probability]" '
               '"tensorflow-probability~=0.24.0" "tf-keras~=2.16.0"'),
    ("2.17.0", 'pip install "tf_pxg[probability]" '
               '"tensorflow-probability~=0.24.0" "tf-keras~=2.17.0"'),
    ("2.21.0", 'pip install "tf_pxg[probability]" '
               '"tensorflow-probability>=0.25" "tf-keras~=2.21.0"'),
])
def test_fix_command_pins_tf_keras_to_the_tensorflow_minor(
    tfp_import, tf_version, command):
  assert tfp_import.fix_command(tf_version) == command


def test_mismatch_raises_naming_versions_and_the_fix(tfp_import, monkeypatch):
  monkeypatch.delenv("TF_PXG_ALLOW_UNSUPPORTED", raising=False)
  with pytest.raises(ImportError) as info:
    tfp_import.check("2.16.2", "0.25.0", "2.21.0")
  message = str(info.value)
  for word in ("TensorFlow 2.16.2", "tensorflow-probability 0.25.0",
               "tf-keras 2.21.0", "tensorflow-probability~=0.24.0",
               "tf-keras~=2.16.0", "docs/probability.md"):
    assert word in message, (word, message)
  monkeypatch.setenv("TF_PXG_ALLOW_UNSUPPORTED", "1")
  with pytest.warns(RuntimeWarning, match="tensorflow-probability 0.25.0"):
    tfp_import.check("2.16.2", "0.25.0", "2.21.0")
  tfp_import.check("2.21.0", "0.25.0", "2.21.0")  # Fits: silent.


def _installed(name):
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def test_importing_the_integration_with_what_is_installed(tfp_import):
  """With a fitting trio the package imports; otherwise our ImportError,
  naming the fix, comes before TFP's own import."""
  found = tfp_import.problems(_installed("tensorflow"),
                              _installed("tensorflow-probability"),
                              _installed("tf-keras"))
  if found:
    with pytest.raises(ImportError, match="pip install"):
      import tf_pxg.probability  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  else:
    import tf_pxg.probability as pxp  # pylint: disable=g-import-not-at-top
    pxp.check_versions()
    assert pxp.NegativeLogLikelihood(pxp.Normal()).head.num_params == 2
