"""Hides the venv's editable install of tf_pxg from tests run by Bazel.

The offline check (.ci/bazel_check) puts this folder on the tests' PYTHONPATH.
`pip install -e .` added an import hook (a meta path finder from an
`__editable__` .pth file) that finds any tf_pxg module in the checkout, so a
module the BUILD leaves out of the runfiles would still import. Removing the
hook makes the tests see only what the BUILD declares, as under current Bazel
with its hermetic Python.
"""

import sys

sys.meta_path[:] = [
    finder for finder in sys.meta_path
    if not getattr(finder, "__module__", "").startswith("__editable__")
]
