"""Runs pytest on the files given as arguments (the Bazel py_test entry)."""

import sys

import pytest

if __name__ == "__main__":
  sys.exit(pytest.main(["-q", *sys.argv[1:]]))
