"""TensorFlow Probability, imported only once its version fits TensorFlow's.

TFP is an optional extra (`pip install "tf_pxg[probability]"`). Each TFP
release supports a range of TensorFlow and imports `tf_keras`, whose
releases each pin one TensorFlow minor. A mismatch fails inside TFP with a
traceback that does not say what to install; this module reads the three
installed versions from the distributions' metadata (importing nothing),
and raises an `ImportError` that names them and gives the one pip command
that fits the installed TensorFlow:

| TensorFlow  | tensorflow-probability | tf-keras               |
|-------------|------------------------|------------------------|
| 2.16, 2.17  | 0.24.x                 | the same minor (2.16.x) |
| >= 2.18     | >= 0.25                | the same minor          |

Set `TF_PXG_ALLOW_UNSUPPORTED=1` to turn the error into a warning (as for
`tf_pxg._versions`).
"""

from __future__ import annotations

from typing import List, Optional

from tf_pxg import _versions

# (lowest TensorFlow, first TensorFlow after) -> (lowest TFP, first TFP after).
TFP_FOR_TENSORFLOW = (
    (((2, 16), (2, 18)), ((0, 24), (0, 25))),
    (((2, 18), None), ((0, 25), None)),
)


_fmt = _versions._fmt  # pylint: disable=protected-access


def _tfp_range(tf_version: str):
  """The (lowest, first excluded or None) TFP for a TensorFlow version, or
  None outside the table."""
  v = _versions.parse(tf_version)
  for (low, high), tfp_range in TFP_FOR_TENSORFLOW:
    if low <= v[:2] and (high is None or v[:2] < high):
      return tfp_range
  return None


def fix_command(tf_version: str) -> str:
  """The pip command that installs the TFP and tf-keras matching
  `tf_version` without changing TensorFlow or Keras."""
  minor = _fmt(_versions.parse(tf_version)[:2])
  tfp_range = _tfp_range(tf_version)
  if tfp_range is None:
    return 'pip install "tf_pxg[probability]"'
  low, high = tfp_range
  tfp = (f'"tensorflow-probability~={_fmt(low)}.0"' if high is not None
         else f'"tensorflow-probability>={_fmt(low)}"')
  return f'pip install "tf_pxg[probability]" {tfp} "tf-keras~={minor}.0"'


def problems(tf_version: Optional[str], tfp_version: Optional[str],
             tf_keras_version: Optional[str]) -> List[str]:
  """What is wrong with the installed trio (empty when it fits).

  Args:
    tf_version, tfp_version, tf_keras_version: installed versions, None for
      a distribution that is not installed.
  """
  if tf_version is None:
    return []  # TensorFlow under another name: tf_pxg._versions decides.
  out = []
  tfp_range = _tfp_range(tf_version)
  if tfp_version is None:
    out.append("tensorflow-probability is not installed")
  elif tfp_range is not None:
    low, high = tfp_range
    v = _versions.parse(tfp_version)[:2]
    if v < low or (high is not None and v >= high):
      wanted = (f"{_fmt(low)}.x" if high is not None and high[1] == low[1] + 1
                else f">= {_fmt(low)}")
      out.append(f"tensorflow-probability {tfp_version} does not support "
                 f"TensorFlow {tf_version} (it needs tensorflow-probability "
                 f"{wanted})")
  if tf_keras_version is None:
    out.append("tf-keras (which TensorFlow Probability imports) is not "
               "installed")
  elif (_versions.parse(tf_keras_version)[:2] !=
        _versions.parse(tf_version)[:2]):
    out.append(f"tf-keras {tf_keras_version} is for another TensorFlow than "
               f"{tf_version} (each tf-keras release pins one TensorFlow "
               "minor)")
  return out


def check(tf_version: Optional[str] = None, tfp_version: Optional[str] = None,
          tf_keras_version: Optional[str] = None) -> None:
  """Raises ImportError naming the versions and the fix on a mismatch.

  Versions default to the installed distributions' (no import).

  Raises:
    ImportError: TFP or tf-keras missing, or not matching TensorFlow.
  """
  if tf_version is None:
    _, tf_version = _versions._installed(_versions._TF_DISTRIBUTIONS)  # pylint: disable=protected-access
  if tfp_version is None:
    _, tfp_version = _versions._installed(("tensorflow-probability",  # pylint: disable=protected-access
                                           "tfp-nightly"))
  if tf_keras_version is None:
    _, tf_keras_version = _versions._installed(("tf-keras", "tf_keras",  # pylint: disable=protected-access
                                                "tf-keras-nightly"))
  found = problems(tf_version, tfp_version, tf_keras_version)
  if not found:
    return
  message = (f"tf_pxg.probability needs TensorFlow Probability matching "
             f"TensorFlow {tf_version}: " + "; ".join(found) + ". Install "
             f"the matching pair with: {fix_command(tf_version)} (see "
             "docs/probability.md).")
  _versions.refuse(message)


def import_tfp():
  """`tensorflow_probability`, after `check()`.

  Raises:
    ImportError: from `check()`, before TFP's own import can fail.
  """
  check()
  import tensorflow_probability  # pylint: disable=g-import-not-at-top
  return tensorflow_probability
