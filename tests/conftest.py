"""Shared pytest setup: quiet TF logs and the `slow` marker."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: takes more than ~60 s; deselect with -m 'not slow'")
