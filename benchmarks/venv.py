"""The benchmark venv: tf_pxg's environment plus TensorFlow Privacy 0.9.0.

TensorFlow Privacy 0.9.0 pins old versions of TensorFlow, NumPy and
dp-accounting, so it cannot be installed normally next to current TF. The
suite makes its own venv, `benchmarks/.venv-tfp`, that *extends* the
interpreter running the suite: a `.pth` file puts that interpreter's
site-packages (TensorFlow, Keras 3, tf_keras, dp-accounting, tf_pxg) and the
repository root on the path, and only two things are installed into it:

* `tensorflow-privacy==0.9.0` with `--no-deps` (its pins are ignored; the
  modules the benchmarks import need only TF, tf_keras, absl, dp-accounting
  and TFP, which the parent already has);
* `matplotlib`, for the PNG chart.

TensorFlow Privacy reaches Keras as `tf.keras`, so the benchmark process sets
`TF_USE_LEGACY_KERAS=1` (tf.keras is then tf_keras, while `import keras` is
still Keras 3) and `sys.skip_tf_privacy_import = True` (its package
`__init__` would otherwise import estimator and v1 modules that do not load
on current TF).
"""

from __future__ import annotations

import os
import pathlib
import site
import subprocess
import sys
import venv

REPO = pathlib.Path(__file__).resolve().parent.parent
VENV = REPO / "benchmarks" / ".venv-tfp"
TFP_REQUIREMENT = "tensorflow-privacy==0.9.0"
EXTRA_REQUIREMENTS = ("matplotlib",)


def python() -> pathlib.Path:
  """The venv's interpreter."""
  return VENV / "bin" / "python"


def _site_packages(python_exe: pathlib.Path) -> pathlib.Path:
  out = subprocess.run(
      [str(python_exe), "-c",
       "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      check=True, capture_output=True, text=True)
  return pathlib.Path(out.stdout.strip())


def _ready() -> bool:
  if not python().exists():
    return False
  out = subprocess.run(
      [str(python()), "-c",
       "import sys; sys.skip_tf_privacy_import = True\n"
       "import importlib.metadata as m\n"
       "assert m.version('tensorflow-privacy') == '0.9.0'\n"
       "import matplotlib, tensorflow, keras, tf_keras, tf_pxg"],
      capture_output=True, text=True, cwd=str(REPO))
  return out.returncode == 0


def ensure(log=print) -> pathlib.Path:
  """Creates (once) and returns the benchmark venv's interpreter.

  Raises:
    subprocess.CalledProcessError: pip could not install a requirement
      (e.g. no access to the package index); the message has pip's output.
  """
  if _ready():
    return python()
  log(f"Creating the benchmark venv {VENV} (TensorFlow Privacy 0.9.0, "
      "matplotlib) on top of this interpreter's packages ...")
  venv.EnvBuilder(with_pip=True, clear=True).create(str(VENV))
  parent = [p for p in site.getsitepackages() if os.path.isdir(p)]
  pth = _site_packages(python()) / "_tf_pxg_parent.pth"
  pth.write_text("\n".join([str(REPO)] + parent) + "\n")
  pip = [str(python()), "-m", "pip", "install", "-q",
         "--disable-pip-version-check"]
  subprocess.run(pip + ["--no-deps", TFP_REQUIREMENT], check=True)
  subprocess.run(pip + list(EXTRA_REQUIREMENTS), check=True)
  if not _ready():
    raise RuntimeError(
        f"The benchmark venv {VENV} was created but does not import "
        "tensorflow_privacy, matplotlib, tensorflow, keras, tf_keras and "
        "tf_pxg; delete it and run again, or check the interpreter running "
        "the suite has tf_pxg's dependencies installed.")
  return python()


def in_venv() -> bool:
  """Whether this process runs on the benchmark venv's interpreter."""
  return pathlib.Path(sys.prefix).resolve() == VENV.resolve()


def setup_process_env() -> None:
  """Environment the benchmark processes need before TF is imported."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  os.environ["TF_USE_LEGACY_KERAS"] = "1"
  sys.skip_tf_privacy_import = True
  from absl import logging  # noqa: PLC0415
  logging.set_verbosity(logging.WARNING)  # TF Privacy logs every trace
