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

A second venv, `benchmarks/.venv-jaxp`, holds jax-privacy 2.0 (its Keras
API runs Keras 3 on the JAX backend, which cannot share a process with
TensorFlow's Keras backend): `ensure_jax()` creates it on its own (no
parent packages) with `pip install jax-privacy==2.0.0 jax[cpu]
keras==<the suite's Keras version> absl-py`, and a `.pth` file that puts
the repository root on its path (for `benchmarks.models` and
`benchmarks.jax_anchor`). The suite runs it as a subprocess per model.
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
JAX_VENV = REPO / "benchmarks" / ".venv-jaxp"
JAXP_REQUIREMENT = "jax-privacy==2.0.0"
JAX_REQUIREMENTS = ("jax[cpu]", "absl-py")


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
  import importlib.util  # noqa: PLC0415
  if importlib.util.find_spec("tf_keras") is not None:
    # Without tf_keras the flag makes TF's `tf.keras` lazy loader recurse
    # (RecursionError) in a `--no_venv` process that touches `tf.keras`.
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
  sys.skip_tf_privacy_import = True
  from absl import logging  # noqa: PLC0415
  logging.set_verbosity(logging.WARNING)  # TF Privacy logs every trace


def jax_python() -> pathlib.Path:
  """The jax-privacy venv's interpreter."""
  return JAX_VENV / "bin" / "python"


def _keras_version() -> str:
  import importlib.metadata as md  # noqa: PLC0415
  return md.version("keras")


def _jax_ready(keras_version: str) -> bool:
  if not jax_python().exists():
    return False
  out = subprocess.run(
      [str(jax_python()), "-c",
       "import importlib.metadata as m\n"
       f"assert m.version('jax-privacy') == '{JAXP_REQUIREMENT.split('==')[1]}'\n"
       f"assert m.version('keras') == '{keras_version}'\n"
       "import keras, jax\n"
       "from jax_privacy import keras_api\n"
       "import benchmarks.models"],
      capture_output=True, text=True, cwd="/",
      env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu"))
  return out.returncode == 0


def ensure_jax(log=print) -> pathlib.Path:
  """Creates (once) and returns the jax-privacy venv's interpreter.

  Keras is pinned to the version of the interpreter running the suite, so
  that both backends build the same models.

  Raises:
    subprocess.CalledProcessError: pip could not install a requirement
      (e.g. no access to the package index); `stderr` has pip's output.
    RuntimeError: the venv was created but does not import jax_privacy.
  """
  keras_version = _keras_version()
  if _jax_ready(keras_version):
    return jax_python()
  log(f"Creating the jax-privacy venv {JAX_VENV} ({JAXP_REQUIREMENT}, "
      f"jax[cpu], keras=={keras_version}) ...")
  venv.EnvBuilder(with_pip=True, clear=True).create(str(JAX_VENV))
  pth = _site_packages(jax_python()) / "_tf_pxg_repo.pth"
  pth.write_text(str(REPO) + "\n")
  subprocess.run(
      [str(jax_python()), "-m", "pip", "install", "-q",
       "--disable-pip-version-check", JAXP_REQUIREMENT,
       f"keras=={keras_version}", *JAX_REQUIREMENTS],
      check=True, capture_output=True, text=True)
  if not _jax_ready(keras_version):
    raise RuntimeError(
        f"The jax-privacy venv {JAX_VENV} was created but does not import "
        "jax_privacy.keras_api with KERAS_BACKEND=jax; delete it and run "
        "again.")
  return jax_python()
