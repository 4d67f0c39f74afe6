"""Offline stand-in for the pip hub "pypi" that MODULE.bazel's pip.parse makes.

The venv the offline check runs in already has every package installed, so
`requirement(name)` maps to an empty py_library. Only the names listed in
PACKAGES exist, so a BUILD that names a package not listed here fails to
build offline: add the name (and make sure requirements_lock.txt has it).
"""

PACKAGES = [
    "absl_py",
    "dp_accounting",
    "keras",
    "pytest",
    "scikit_learn",
    "scipy",
    "tensorflow",
]

def normalize(name):
    """Returns the package name as rules_python spells its hub targets."""
    return name.lower().replace("-", "_").replace(".", "_")

def requirement(name):
    """Returns the stand-in target for the pip package `name`."""
    return "@pypi//:" + normalize(name)
