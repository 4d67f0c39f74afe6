"""Shared pytest setup: quiet TF logs, the `slow` tier, a Keras dtype
policy that a failing test cannot leak into the next ones, and the native
op library (`native_ops`).

The suite is what `pytest tests` runs (README command 2, and CI's first
stage). Tests marked `slow` form a second tier: breadth beyond what the
suite already proves (more architectures of a kind the suite covers), each
skipped with that reason unless `--slow` is given (or `-m` names the
marker). A test that is the only check of a property is never marked slow.
"""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_addoption(parser):
  parser.addoption(
      "--slow", action="store_true", default=False,
      help="also run the slow tier (tests marked `slow`: breadth beyond the "
           "suite; see tests/conftest.py)")
  parser.addoption(
      "--adversary-models", type=int, default=None,
      help="models the generated adversary tries "
           "(tests/test_generated_adversary.py; default 2000, or "
           "TF_PXG_ADVERSARY_MODELS)")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: the second tier (breadth beyond the suite), run "
                 "with --slow")


@pytest.fixture(autouse=True)
def _restore_keras_dtype_policy():
  """Tests that build mixed-precision models set the global policy while
  building: a test that leaves it changed is reported (as an error in its
  teardown) and the policy restored, so the next tests are not affected.
  Keras is not imported here: tests that never use it do not pay for it."""
  keras = sys.modules.get("keras")
  name = keras.config.dtype_policy().name if keras is not None else None
  yield
  if name is not None and keras.config.dtype_policy().name != name:
    leaked = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(name)
    pytest.fail(f"the test left the Keras dtype policy at {leaked!r} "
                f"(was {name!r}); restored")


@pytest.fixture(scope="module")
def native_ops():
  """tf_pxg's native op library. It must build on every machine of this
  kind (it has g++): if it does not, the tests that use it fail, with
  `tf-pxg build-native --check`'s report of why. Skipped when
  `TF_PXG_NATIVE=0` switches the native ops off deliberately."""
  from tf_pxg import native  # pylint: disable=g-import-not-at-top
  if not native.enabled():
    pytest.skip("TF_PXG_NATIVE=0: the native ops are switched off")
  loaded = native.library()
  assert loaded is not None, "the native ops did not build:\n" + "\n".join(
      native.check()[1])
  return loaded


# Grouped convolutions on TensorFlow's CPU kernels --------------------------
# Where TensorFlow runs without oneDNN (seen on an AMD EPYC VM with TF 2.21),
# its own CPU kernels have no gradient for a grouped convolution
# (`Conv2DBackpropInput`: "Gradients for grouped convolutions are not
# supported on CPU") and grappler's fused Conv2D+BiasAdd refuses groups
# ("Fused conv implementation does not support grouped convolutions"):
# plain Keras cannot train such a model there either, so the tests that
# need it are skipped with that reason instead of failing.
_GROUPED = ("Conv2D_groups", "per_group", "grouped_convs", "[convnext]",
            "test_keras_fit_step_with_the_depthwise_ops")


def _grouped_conv_trains() -> bool:
  import tensorflow as tf  # noqa: PLC0415
  x = tf.random.normal([2, 6, 6, 4])
  kernel = tf.Variable(tf.random.normal([3, 3, 1, 4]))
  bias = tf.Variable(tf.zeros([4]))

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.nn.bias_add(tf.nn.conv2d(x, kernel, 2, "SAME"), bias)
      loss = tf.reduce_sum(tf.nn.relu(y))
    return tape.gradient(loss, [x, kernel, bias])

  try:
    step(x)
    tf.function(step)(x)
    return True
  except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError):
    return False


def _slow_tier_skipped(config, items):
  """Skips the `slow` tier unless `--slow` or an `-m` expression that
  names the marker asks for it."""
  if config.getoption("--slow") or "slow" in (config.option.markexpr or ""):
    return
  skip = pytest.mark.skip(reason="slow tier (breadth beyond the suite): "
                                 "run with --slow")
  for item in items:
    if item.get_closest_marker("slow") is not None:
      item.add_marker(skip)


def pytest_collection_modifyitems(config, items):
  _slow_tier_skipped(config, items)
  grouped = [item for item in items
             if any(k in item.nodeid for k in _GROUPED)]
  if grouped and not _grouped_conv_trains():
    skip = pytest.mark.skip(
        reason="TensorFlow's CPU kernels here (no oneDNN) have no gradient "
               "for grouped convolutions: plain Keras cannot train them")
    for item in grouped:
      item.add_marker(skip)
