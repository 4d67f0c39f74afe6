"""The Bazel BUILD covers the source tree, so it cannot drift from it.

Every tests/**/test_*.py must be run by a py_test, every tf_pxg/**/*.py must
be in a py_library's srcs, and every other .py file under tests/, examples/
and benchmarks/ must be in some target's srcs. The BUILD is evaluated here in
Python: its Bazel functions (load, package, glob, the py_* rules and the pip
hub's requirement) are replaced by recorders, and glob follows Bazel's rules
(`*` stays within one path segment, `**` spans any number of them, files of a
subpackage, i.e. below another BUILD file, and .bazelignore'd directories are
left out). The real Bazel runs in .ci/bazel_check.

requirements_lock.txt, which MODULE.bazel's pip.parse reads, must pin every
package setup.py asks for (install_requires and the extras), at a version
setup.py accepts.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path
import re
from typing import Dict, List, Optional, Tuple

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
import pytest

import tf_pxg

# Under Bazel this file is a runfiles symlink; resolving it finds the
# checkout, whose tree is what the BUILD must cover.
ROOT = Path(__file__).resolve().parents[1]
_RULES = ("py_binary", "py_library", "py_test")
_TEST_FILE = re.compile(r"tests/(?:.+/)?test_[^/]*\.py")


@dataclasses.dataclass(frozen=True)
class Target:
  kind: str
  name: str
  srcs: Tuple[str, ...]
  main: Optional[str]
  args: Tuple[str, ...]


@dataclasses.dataclass
class Build:
  """What evaluating a BUILD file recorded."""
  targets: Dict[str, Target]
  requirements: List[str]


def glob_regex(pattern: str) -> re.Pattern:
  """Returns a regex matching the paths Bazel's glob matches for `pattern`."""
  segments = pattern.split("/")
  regex = ""
  for i, segment in enumerate(segments):
    last = i == len(segments) - 1
    if segment == "**":
      regex += ".*" if last else "(?:[^/]+/)*"
      continue
    regex += "".join(
        "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
        for c in segment)
    regex += "" if last else "/"
  return re.compile(regex + r"\Z")


def package_files(root: Path) -> List[str]:
  """Returns the files of the root package, as relative POSIX paths.

  Directories holding a BUILD file (subpackages), .git and those listed in
  .bazelignore are skipped, as Bazel's glob and `//...` skip them; so are
  virtualenvs (a pyvenv.cfg inside), which hold no project sources.
  """
  ignore_file = root / ".bazelignore"
  ignored = {".git"}
  if ignore_file.exists():
    ignored |= {line.strip().rstrip("/")
                for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel = Path(dirpath).relative_to(root).as_posix()
    prefix = "" if rel == "." else rel + "/"
    dirnames[:] = sorted(
        d for d in dirnames
        if prefix + d not in ignored
        and not any(Path(dirpath, d, marker).exists()
                    for marker in ("BUILD", "BUILD.bazel", "pyvenv.cfg")))
    files += [prefix + f for f in filenames]
  return sorted(files)


def evaluate_build(text: str, root: Path = ROOT) -> Build:
  """Runs a BUILD file's text in Python, recording its py_* targets.

  Raises:
    ValueError: two targets share a name, or a load names a symbol this
      evaluator does not provide.
  """
  files = package_files(root)
  build = Build(targets={}, requirements=[])

  def glob(include, exclude=(), **unused_kwargs):
    def matching(patterns):
      regexes = [glob_regex(p) for p in patterns]
      return {f for f in files if any(r.match(f) for r in regexes)}
    return sorted(matching(include) - matching(exclude))

  def rule(kind):
    def record(name, srcs=(), main=None, args=(), **unused_kwargs):
      if name in build.targets:
        raise ValueError(f"BUILD defines two targets named {name!r}")
      build.targets[name] = Target(kind, name, tuple(srcs), main, tuple(args))
    return record

  def requirement(name):
    build.requirements.append(name)
    return "@pypi//" + name

  def load(unused_label, *symbols):
    unknown = sorted(set(symbols) - set(namespace))
    if unknown:
      raise ValueError(f"BUILD loads {unknown}, which "
                       f"{__name__}.evaluate_build does not provide")

  namespace = {"glob": glob, "load": load, "package": lambda **kw: None,
               "requirement": requirement, **{k: rule(k) for k in _RULES}}
  exec(compile(text, "BUILD", "exec"), namespace)  # pylint: disable=exec-used
  return build


def uncovered(build: Build, files: List[str]) -> Dict[str, List[str]]:
  """Returns the .py files the BUILD leaves out, keyed by what is missing."""
  targets = build.targets.values()
  in_srcs = {s for t in targets for s in t.srcs}
  in_library = {s for t in targets if t.kind == "py_library" for s in t.srcs}
  run_by_test = {a for t in targets if t.kind == "py_test"
                 for a in t.args if a in t.srcs}
  missing = {"not run by a py_test": [], "not in a py_library": [],
             "in no target": []}
  for f in files:
    if _TEST_FILE.fullmatch(f):
      if f not in run_by_test:
        missing["not run by a py_test"].append(f)
    elif f.startswith("tf_pxg/") and f.endswith(".py"):
      if f not in in_library:
        missing["not in a py_library"].append(f)
    elif f.startswith(("tests/", "examples/", "benchmarks/")) and (
        f.endswith(".py") and f not in in_srcs):
      missing["in no target"].append(f)
  return {why: fs for why, fs in missing.items() if fs}


@pytest.fixture(scope="module")
def build() -> Build:
  assert (ROOT / "setup.py").exists(), f"{ROOT} is not the checkout"
  return evaluate_build((ROOT / "BUILD").read_text())


def test_build_covers_every_module(build):
  files = package_files(ROOT)
  assert "tests/test_build_coverage.py" in files
  assert "tf_pxg/__init__.py" in files
  assert uncovered(build, files) == {}


def test_targets_the_docs_name_exist(build):
  for name in ("tf_pxg", "tf_pxg_cli", "dp_digits", "test_cli",
               "test_build_coverage"):
    assert name in build.targets, name
  assert build.targets["test_cli"].args == ("tests/test_cli.py",)


def test_every_main_is_an_existing_source(build):
  for target in build.targets.values():
    if target.main is not None:
      assert target.main in target.srcs, target
      assert (ROOT / target.main).is_file(), target
    for src in target.srcs:
      assert (ROOT / src).is_file(), (target.name, src)


def _setup_requirements() -> List[Requirement]:
  tree = ast.parse((ROOT / "setup.py").read_text())
  call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
              and getattr(node.func, "attr", None) == "setup")
  kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords
            if k.arg in ("install_requires", "extras_require")}
  # The lock covers what Bazel builds and tests: the [test] and [examples]
  # extras (bazel/update_requirements_lock.sh); optional extras such as
  # [beam], whose tests skip without them, are not locked.
  specs = kwargs["install_requires"] + [
      s for name, extra in kwargs.get("extras_require", {}).items()
      if name in _LOCKED_EXTRAS for s in extra]
  return [Requirement(s) for s in specs]


_LOCKED_EXTRAS = ("test", "examples")


def _lock_pins() -> Dict[str, str]:
  text = (ROOT / "requirements_lock.txt").read_text()
  return {canonicalize_name(name): version for name, version in
          re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", text, re.M)}


def test_lock_pins_every_setup_requirement():
  pins = _lock_pins()
  assert len(pins) > 20  # the lock has the transitive closure
  for req in _setup_requirements():
    name = canonicalize_name(req.name)
    assert name in pins, (
        f"{req.name} is in setup.py but not in requirements_lock.txt: run "
        "bazel/update_requirements_lock.sh")
    assert req.specifier.contains(pins[name], prereleases=True), (
        f"requirements_lock.txt pins {name}=={pins[name]}, which setup.py's "
        f"{req} excludes: run bazel/update_requirements_lock.sh")


def test_build_requirements_are_locked(build):
  pins = _lock_pins()
  assert build.requirements
  for name in build.requirements:
    assert canonicalize_name(name) in pins, name


def test_package_comes_from_the_build_sources():
  """Under Bazel the tests import the py_library's runfiles, not the venv."""
  package_dir = Path(tf_pxg.__file__).parent
  if "TEST_SRCDIR" in os.environ:
    runfiles = Path(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"])
    assert package_dir == runfiles / "tf_pxg"
  else:
    assert package_dir.resolve() == ROOT / "tf_pxg"


# The checker itself: it must report what a BUILD leaves out.

_PARTIAL_BUILD = """
load("@rules_python//python:defs.bzl", "py_library", "py_test")

py_library(
    name = "lib",
    srcs = glob(["tf_pxg/**/*.py"], exclude = ["tf_pxg/cli.py"]),
)

[
    py_test(name = src[6:-3], srcs = [src, "tests/pytest_main.py"],
            args = [src], main = "tests/pytest_main.py")
    for src in glob(["tests/test_*.py"], exclude = ["tests/test_cli.py"])
]
"""


def test_checker_reports_files_a_build_excludes():
  files = package_files(ROOT)
  missing = uncovered(evaluate_build(_PARTIAL_BUILD), files)
  assert missing["not run by a py_test"] == ["tests/test_cli.py"]
  assert missing["not in a py_library"] == ["tf_pxg/cli.py"]
  assert "tests/conftest.py" in missing["in no target"]
  assert "examples/dp_digits.py" in missing["in no target"]


def test_checker_reports_a_test_in_srcs_that_no_test_runs():
  text = _PARTIAL_BUILD.replace(
      'srcs = [src, "tests/pytest_main.py"]',
      'srcs = [src, "tests/pytest_main.py", "tests/test_cli.py"]')
  missing = uncovered(evaluate_build(text), package_files(ROOT))
  assert missing["not run by a py_test"] == ["tests/test_cli.py"]


def test_checker_rejects_duplicate_names_and_unknown_loads():
  with pytest.raises(ValueError, match="two targets named 'x'"):
    evaluate_build('py_library(name = "x")\npy_binary(name = "x")')
  with pytest.raises(ValueError, match=r"loads \['py_wheel'\]"):
    evaluate_build('load("@rules_python//python:packaging.bzl", "py_wheel")')


def test_glob_follows_bazel_semantics(tmp_path):
  for rel in ("pkg/a.py", "pkg/x/y/b.py", "pkg/c.txt", "pkg/sub/d.py",
              "pkg/sub/BUILD", "venv/e.py", "top.py"):
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text("")
  (tmp_path / ".bazelignore").write_text("venv\n")
  files = package_files(tmp_path)
  assert "pkg/sub/d.py" not in files  # below another BUILD: a subpackage
  assert "venv/e.py" not in files

  def glob(pattern):
    return sorted(f for f in files if glob_regex(pattern).match(f))

  assert glob("pkg/**/*.py") == ["pkg/a.py", "pkg/x/y/b.py"]
  assert glob("pkg/*.py") == ["pkg/a.py"]
  assert glob("*.py") == ["top.py"]
  assert glob("pkg/**") == ["pkg/a.py", "pkg/c.txt", "pkg/x/y/b.py"]
  assert glob("pkg/?.py") == ["pkg/a.py"]
