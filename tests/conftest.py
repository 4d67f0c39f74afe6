"""Shared pytest setup: quiet TF logs, the `slow` marker, a Keras dtype
policy that a failing test cannot leak into the next ones, and the native
op library (`native_ops`)."""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: takes more than ~60 s; deselect with -m 'not slow'")


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
