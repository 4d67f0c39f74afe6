"""tf_pxg's native CPU ops: one TensorFlow op library, compiled on first use.

The library (`kernels/*.cc`) holds:

* `TfPxgAddNormalNoise`, `TfPxgNormalNoiseScatterAdd`
  (`kernels/threefry_noise.cc` with `kernels/threefry_normal.h`): the DP
  noise. They draw the same Gaussians as the XLA kernel of
  `tf_pxg.dp.threefry` (element for element, up to float rounding), but
  compute both outputs of a Box-Muller pair at once, run loops written for
  the compiler's vectoriser and shard them over TF's intra-op threads: less
  CPU per Gaussian than the XLA loop (the measured figures are in
  docs/benchmarks.md; `python -m benchmarks.limits`).
* `TfPxgConv2DFilterSqNorm`, `TfPxgConv2DFilterWeightedSum`
  (`kernels/conv_norms.cc`): per-example squared norms and the
  clip-weighted sum of a 2-D convolution's filter gradient, accumulated in
  registers from each example's input and output gradient, with no patch
  tensor (`tf_pxg.rules.conv`).
* `TfPxgDepthwiseConv2DFilterSqNorm`, `TfPxgDepthwiseConv2DFilterWeightedSum`
  (`kernels/depthwise_norms.cc`): a depthwise convolution's per-example
  squared norms and clip-weighted filter gradient sum (`DepthwiseConv2dNative`
  and `Conv2D` with one input channel per group), from channel vectors of
  the input and output gradient, with no patch tensor.
* `TfPxgRowSumOfSquares`, `TfPxgScaleRows` (`kernels/rows.cc`): each
  row's sum of squares in one vectorised pass
  (`tf_pxg.rules.base.row_sum_of_squares`, for ghost norms of one-row
  examples and materialised gradients' norms), and rows scaled by their
  example's clip factor (`tf_pxg.rules.base.scale_examples`).

Each user keeps a TF/XLA path for what the ops cannot serve (`serves`):
code compiled with XLA (`jit_compile=True`, TPUs), accelerators, other
dtypes, and machines where the library is not available (`FALLBACKS` names
each op's; `tf-pxg build-native --check` prints which ops run natively
here and why the others do not).

Portable build. The library is compiled with the installed TensorFlow's
headers and flags (`tf.sysconfig`), `-O3 -fno-math-errno` and an
instruction-set level chosen at run time from the CPU (`isa`), never
`-march=native`: on x86-64 the highest of the psABI levels `x86-64-v2`
(SSE4.2), `x86-64-v3` (AVX2, FMA) and `x86-64-v4` (AVX-512 F/BW/CD/DQ/VL)
that the CPU has, elsewhere (aarch64, ...) the compiler's baseline. The
kernels' register blocking (vector width, rows per block) is a compile-time
constant of whole loops, so the wider path is chosen per library rather
than per function: each level is its own library in the cache, and a
machine loads the one of its own level. A library built on one machine
(a container image) therefore runs on every CPU of the same level, and a
CPU of another level builds or loads its own, never one with instructions
it lacks. On x86 `-mno-avx512fp16` comes last whenever the compiler knows
it (probed): with `__AVX512FP16__` defined, TensorFlow's bundled Eigen
includes its FP16 packet math, which gcc 12 cannot compile (issue 30). The
level `native` (`TF_PXG_NATIVE_ISA=native`) restores `-march=native` (with
the same guard) for a library that need not leave its machine.

Cache. The library goes into a cache directory, named by a digest of the
sources, TensorFlow's version, the compiler (its path, size and date), the
build's commands (flags included) and the level (the CPU's model and features
too for `native` or extra flags), then is loaded with `tf.load_op_library`.
Building compiles each source to an object file, up to one compiler per
CPU at once (`os.cpu_count()`, at most one per source), then links them:
80-100 s of compiler CPU in all (gcc 12, clang 14; TF's and Eigen's
headers), so roughly a minute with two free cores and less with four (an
estimate from that CPU time: not measured on an idle machine). Measured
on a 2-core machine shared with other jobs (load 5-6): 137 s, against
195 s for the former single command compiling all sources in one
process. A failing compile stops the others; the log gives each step's
exit status and time. The first use logs a WARNING that it is compiling
and how long it took. `tf-pxg build-native` builds ahead of
time (for container images: run it in the image, with the cache directory
the program will use). A file lock (`fcntl`) around the build makes
concurrent processes (the workers of a multi-worker job) build once; the
others wait and load the result. The compiler's own output, warnings
included, goes only to `<library>.log` beside the library.

A failed build is remembered: `<library>.failed` records why (the first
compiler error) under the same name, so no other process, now or later,
retries the same compiler, flags, level and TensorFlow. Each process then
logs one WARNING line saying why and that `tf-pxg build-native --force`
retries, and uses the TF/XLA paths: the same results, at the cost measured
in docs/benchmarks.md (DP noise by the XLA Threefry kernel, convolutions'
per-example norms through patch tensors, row norms and clip scaling by
TF's ops). Without a compiler (or with `TF_PXG_NATIVE=0`) the same
fallbacks run, after one WARNING line per process (none for
`TF_PXG_NATIVE=0`).

Safety: the cache directory is created with mode 0700, and before a
library is built into or loaded from a directory, the directory (and the
library) must belong to the current user and not be writable by group or
others; otherwise that directory is not used (another local user could
otherwise plant a library that `tf.load_op_library` runs).

Environment:
  TF_PXG_NATIVE=0: never build or use the native ops.
  TF_PXG_CACHE_DIR: where the library goes (default
    `$XDG_CACHE_HOME/tf_pxg`, else `~/.cache/tf_pxg`).
  CXX: the C++ compiler (default the first of g++, c++, clang++ on PATH).
  TF_PXG_NATIVE_ISA: the instruction-set level to build for instead of the
    CPU's (`ISA_LEVELS`; e.g. `x86-64-v3` for a library that also runs on
    AVX2 machines without AVX-512, or `native`).
  TF_PXG_NATIVE_FLAGS: extra compiler flags (split on spaces), after the
    level's and before the `-mno-avx512fp16` guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import platform
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from typing import List, Optional, Tuple

import tensorflow as tf

from tf_pxg import xla

__all__ = ["BuildFailed", "FALLBACKS", "ISA_LEVELS", "KERNELS",
           "OPTIMIZATION_FLAGS", "build", "check", "check_safe",
           "compile_command", "compiler", "enabled", "isa", "library",
           "library_name", "optimization_flags", "ops", "serves", "sources"]

KERNELS = pathlib.Path(__file__).with_name("kernels")
# How the kernels are optimised, besides the instruction-set level
# (`optimization_flags()` adds it, also for benchmarks/threefry_rounds.cc,
# which times the sampling code outside TF).
OPTIMIZATION_FLAGS = ("-O3", "-fno-math-errno")
_LIBRARY_FLAGS = ("-shared", "-fPIC")
# Last on x86 when the compiler knows it: `__AVX512FP16__` makes TF's
# bundled Eigen include AVX512/PacketMathFP16.h, which gcc 12 cannot compile.
_FP16_GUARD = "-mno-avx512fp16"

# x86-64 psABI levels, lowest first, with the /proc/cpuinfo flags each adds
# to the one before (`abm` is how Linux names LZCNT).
_X86_LEVELS = (
    ("x86-64-v2", ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2",
                   "ssse3")),
    ("x86-64-v3", ("abm", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
                   "movbe", "xsave")),
    ("x86-64-v4", ("avx512bw", "avx512cd", "avx512dq", "avx512f",
                   "avx512vl")),
)
# What TF_PXG_NATIVE_ISA accepts: "baseline" is the compiler's default for
# the machine (x86-64 with SSE2 on x86, armv8-a on aarch64).
ISA_LEVELS = ("baseline",) + tuple(name for name, _ in _X86_LEVELS) + (
    "native",)

# What runs instead of each op when it is not native here (`check`).
FALLBACKS = {
    "TfPxgAddNormalNoise": "DP noise by the XLA Threefry kernel "
                           "(tf_pxg.dp.threefry)",
    "TfPxgNormalNoiseScatterAdd": "noise of sparse gradients by the XLA "
                                  "Threefry kernel and a scatter-add",
    "TfPxgConv2DFilterSqNorm": "conv norms through patch tensors (ghost or "
                               "materialised)",
    "TfPxgConv2DFilterWeightedSum": "TF's filter gradient of the "
                                    "clip-scaled output gradient",
    "TfPxgDepthwiseConv2DFilterSqNorm": "depthwise norms through patch "
                                        "tensors",
    "TfPxgDepthwiseConv2DFilterWeightedSum": "TF's filter gradient of the "
                                             "clip-scaled output gradient",
    "TfPxgRowSumOfSquares": "TF's Square and Sum",
    "TfPxgScaleRows": "TF's broadcasting Mul (with a select for factor 0)",
}

# How long a build takes (the sources compile in parallel: `_run_compiler`).
_BUILD_TIME = "roughly a minute with two free cores"

_lock = threading.Lock()
_loaded = {}


class BuildFailed(OSError):
  """The native ops could not be built, now or in an earlier process (the
  failure is recorded in the cache); the message is one line saying why,
  where the compiler's output is, and how to retry."""


def sources() -> List[pathlib.Path]:
  """The library's C++ sources (`kernels/*.cc`), in a fixed order."""
  return sorted(KERNELS.glob("*.cc"))


def ops() -> List[str]:
  """The names of the ops the sources register (`REGISTER_OP`), sorted."""
  names = set()
  for source in sources():
    names.update(re.findall(r'REGISTER_OP\("(\w+)"\)', source.read_text()))
  return sorted(names)


def enabled() -> bool:
  """False if `TF_PXG_NATIVE=0` (or `false`/`no`/`off`) is set."""
  value = os.environ.get("TF_PXG_NATIVE", "1").strip().lower()
  return value not in ("0", "false", "no", "off")


@tf.autograph.experimental.do_not_convert
def library():
  """The loaded op library (its ops as `tf_pxg_add_normal_noise`,
  `tf_pxg_normal_noise_scatter_add`, `tf_pxg_conv2d_filter_sq_norm`,
  `tf_pxg_conv2d_filter_weighted_sum`,
  `tf_pxg_depthwise_conv2d_filter_sq_norm`,
  `tf_pxg_depthwise_conv2d_filter_weighted_sum`,
  `tf_pxg_row_sum_of_squares`, `tf_pxg_scale_rows`), or None if it is
  disabled or not available (one WARNING line per process says why, and
  how to retry)."""
  if not enabled():
    return None
  with _lock:
    if "lib" not in _loaded:
      _loaded["lib"] = None
      try:
        _loaded["lib"] = tf.load_op_library(build())
      except (OSError, ValueError, subprocess.SubprocessError,
              tf.errors.OpError) as e:
        logging.warning(
            "tf_pxg: the native ops are unavailable, so the TF/XLA "
            "fallbacks run (same results, slower: docs/benchmarks.md; "
            "`tf-pxg build-native --check` lists them). Why: %s",
            _one_line(str(e)))
    return _loaded["lib"]


@tf.autograph.experimental.do_not_convert
def serves(t, dtypes=(tf.float32,)) -> bool:
  """Whether a native op should compute with `t` here: its dtype is one of
  `dtypes` (the op's), the code is not being compiled with XLA, no
  accelerator is in use, and the library loads."""
  if t.dtype not in dtypes or xla.in_xla_context() or _accelerators():
    return False
  return library() is not None


def _accelerators() -> bool:
  return bool(tf.config.list_logical_devices("GPU") or
              tf.config.list_logical_devices("TPU"))


def compiler() -> str:
  """The C++ compiler: `$CXX`, else the first of g++, c++, clang++ on PATH.

  Raises:
    OSError: If there is none, or `$CXX` names no executable.
  """
  cxx = os.environ.get("CXX")
  if cxx:
    if shutil.which(cxx) is None:
      raise OSError(f"CXX={cxx} is not an executable (install g++ or "
                    "clang++, or set CXX to one)")
    return cxx
  for name in ("g++", "c++", "clang++"):
    found = shutil.which(name)
    if found:
      return found
  raise OSError("no C++ compiler on PATH (install g++ or clang++, or set "
                "CXX)")


def _cpu_info() -> Tuple[str, frozenset]:
  """The CPU's model name and feature flags from /proc/cpuinfo (empty
  where there is none)."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = f.read().splitlines()
  except OSError:
    return "", frozenset()
  model = next((l.split(":", 1)[1].strip() for l in lines
                if l.startswith("model name")), "")
  flags = next((l.split(":", 1)[1].split() for l in lines
                if l.startswith(("flags", "Features"))), [])
  return model, frozenset(flags)


def _is_x86() -> bool:
  return platform.machine().lower() in ("x86_64", "amd64")


def isa() -> str:
  """The instruction-set level the library is built for: `$TF_PXG_NATIVE_ISA`
  if set, else on x86-64 the highest psABI level whose features the CPU
  has (`x86-64-v2` .. `x86-64-v4`), else `baseline`.

  Raises:
    ValueError: `$TF_PXG_NATIVE_ISA` is not one of `ISA_LEVELS`.
  """
  chosen = os.environ.get("TF_PXG_NATIVE_ISA", "").strip()
  if chosen:
    if chosen not in ISA_LEVELS:
      raise ValueError(f"TF_PXG_NATIVE_ISA={chosen} is not one of "
                       f"{', '.join(ISA_LEVELS)}")
    return chosen
  if not _is_x86():
    return "baseline"
  _, have = _cpu_info()
  level = "baseline"
  for name, needs in _X86_LEVELS:
    if not have.issuperset(needs):
      break
    level = name
  return level


def optimization_flags(level: Optional[str] = None) -> Tuple[str, ...]:
  """`OPTIMIZATION_FLAGS` plus the level's (`isa()` unless given):
  `-march=<level>` for an x86-64 psABI level, `-march=native` for
  `native`, nothing for `baseline`; then `$TF_PXG_NATIVE_FLAGS`. Without
  the FP16 guard (`_guard_flags`), which must come last."""
  level = level or isa()
  arch = () if level == "baseline" else (f"-march={level}",)
  extra = tuple(os.environ.get("TF_PXG_NATIVE_FLAGS", "").split())
  return OPTIMIZATION_FLAGS + arch + extra


_probed = {}


def _guard_flags(cxx: str) -> Tuple[str, ...]:
  """`-mno-avx512fp16` on x86 if `cxx` accepts it (probed once per
  compiler and process: gcc < 12 and clang < 14 do not know the flag, and
  cannot define `__AVX512FP16__` either)."""
  if not _is_x86():
    return ()
  if cxx not in _probed:
    try:
      done = subprocess.run(
          [cxx, _FP16_GUARD, "-Werror", "-x", "c++", "-fsyntax-only", "-"],
          input="", capture_output=True, text=True, timeout=60)
      _probed[cxx] = done.returncode == 0
    except (OSError, subprocess.SubprocessError):
      _probed[cxx] = False
  return (_FP16_GUARD,) if _probed[cxx] else ()


def compile_command(cxx: str, output: pathlib.Path, level: Optional[str] = None,
                    guard: bool = True,
                    files: Optional[List[pathlib.Path]] = None) -> List[str]:
  """One command that builds the library into `output` (or, with `output`
  None and `files`, checks their syntax only) with `cxx` for `level`
  (`isa()` unless given); `guard=False` leaves out the FP16 guard (for its
  test). `build` runs the same flags split into one `object_command` per
  source, in parallel, and a `link_command`."""
  files = sources() if files is None else files
  target = ["-o", str(output), *_LIBRARY_FLAGS] if output else [
      "-fsyntax-only"]
  return ([cxx, *map(str, files), *target, *optimization_flags(level)] +
          tf.sysconfig.get_compile_flags() +
          (tf.sysconfig.get_link_flags() if output else []) +
          list(_guard_flags(cxx) if guard else ()))


def object_command(cxx: str, source: pathlib.Path, output: pathlib.Path,
                   level: Optional[str] = None,
                   guard: bool = True) -> List[str]:
  """The command that compiles one source into the object file `output`
  (position-independent, for the shared library) with `cxx` for `level`
  (`isa()` unless given): the flags of `compile_command`, without TF's
  link flags; `guard=False` leaves out the FP16 guard."""
  return ([cxx, "-c", "-fPIC", str(source), "-o", str(output),
           *optimization_flags(level)] + tf.sysconfig.get_compile_flags() +
          list(_guard_flags(cxx) if guard else ()))


def link_command(cxx: str, objects: List[pathlib.Path],
                 output: pathlib.Path,
                 level: Optional[str] = None) -> List[str]:
  """The command that links the object files into the library `output`
  (`-shared` with TensorFlow's link flags), with the compiles'
  `optimization_flags(level)`: flags such as `-fsanitize=...` in
  `$TF_PXG_NATIVE_FLAGS` must reach the link too, or the library is left
  with undefined references to their runtime (`__ubsan_handle_*`,
  `__asan_*`) and fails to load."""
  return [cxx, "-shared", *map(str, objects), "-o", str(output),
          *optimization_flags(level), *tf.sysconfig.get_link_flags()]


def _build_commands(cxx: str, partial: pathlib.Path, objects: pathlib.Path,
                    level: Optional[str] = None, guard: bool = True
                    ) -> Tuple[List[List[str]], List[str]]:
  """(one `object_command` per source, its object in the directory
  `objects`; the `link_command` of those objects into `partial`)."""
  targets = [(source, objects / f"{source.stem}.o") for source in sources()]
  return ([object_command(cxx, source, obj, level, guard)
           for source, obj in targets],
          link_command(cxx, [obj for _, obj in targets], partial, level))


def _compiler_identity(cxx: str) -> str:
  """The compiler's resolved path, size and modification time (changes
  when it is upgraded), without running it."""
  path = os.path.realpath(shutil.which(cxx) or cxx)
  try:
    info = os.stat(path)
  except OSError:
    return path
  return f"{path}:{info.st_size}:{info.st_mtime_ns}"


def library_name(cxx: str, level: Optional[str] = None) -> str:
  """The library's file name: the level and a digest of the sources,
  TensorFlow's version, the compiler and the command (plus the CPU's model
  and features for `native` or extra `$TF_PXG_NATIVE_FLAGS`, whose code
  may depend on them)."""
  level = level or isa()
  digest = hashlib.sha256()
  files = sorted(KERNELS.glob("*.[ch]*"))  # the ops and their headers
  cpu_specific = level == "native" or os.environ.get(
      "TF_PXG_NATIVE_FLAGS", "").strip()
  model, flags = _cpu_info() if cpu_specific else ("", frozenset())
  # The build's commands with placeholder paths (the FP16 guard follows
  # from the compiler, hashed below, so it is not probed here).
  compiles, link = _build_commands(cxx, pathlib.Path("LIBRARY"),
                                   pathlib.Path("OBJECTS"), level, False)
  commands = "\n".join(" ".join(c) for c in (*compiles, link)).replace(
      str(KERNELS), "KERNELS")  # wherever tf_pxg is installed
  for part in (*(f.read_bytes() for f in files), tf.__version__.encode(),
               commands.encode(),
               _compiler_identity(cxx).encode(),
               f"{model} {' '.join(sorted(flags))}".encode()):
    digest.update(part)
    digest.update(b"\0")
  return f"tf_pxg_ops-{level}-{digest.hexdigest()[:20]}.so"


def _cache_dir() -> pathlib.Path:
  if os.environ.get("TF_PXG_CACHE_DIR"):
    return pathlib.Path(os.environ["TF_PXG_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "tf_pxg"


def build(cache_dir: Optional[pathlib.Path] = None, force: bool = False) -> str:
  """Compiles the library unless the cache has it; returns its path.

  Concurrent builds (several processes of a multi-worker job) build once:
  the build holds an exclusive `fcntl` lock on `<library>.lock`, and a
  process that waited for it finds the library built, or the failure
  recorded. The compiler writes to a file of its own, renamed into place
  atomically.

  The library goes to `cache_dir` (default: see the module doc), or, if
  that cannot be created or written or is not safe (`check_safe`), to
  `$TMPDIR/tf_pxg-<uid>` (created with mode 0700).

  Args:
    cache_dir: Where the library goes.
    force: Build again even if the cache has the library or a recorded
      failure (`tf-pxg build-native --force`).

  Raises:
    OSError: No compiler was found, or no cache directory is writable and
      safe (the message says why for each).
    BuildFailed: The compiler failed, now or in an earlier process with the
      same compiler, flags, level and TensorFlow (one line: why, the log,
      how to retry).
  """
  cxx = compiler()
  name = library_name(cxx)
  reasons = []
  for directory in _candidates(pathlib.Path(cache_dir or _cache_dir())):
    problem = _prepare(directory)
    if problem:
      reasons.append(problem)
      continue
    output = directory / name
    if not force and _cached(output):
      return str(output)
    with _locked(output.with_suffix(".lock")):
      if force:
        _forget(output)
      if not _cached(output):  # Another process may have built it meanwhile.
        _compile(cxx, output)
    check_safe(output)
    return str(output)
  raise OSError("no usable cache directory for tf_pxg's native ops (set "
                "TF_PXG_CACHE_DIR to a directory of yours, mode 0700): " +
                "; ".join(reasons))


def _cached(output: pathlib.Path) -> bool:
  """True if the library is built (and safe); False if it is not.

  Raises:
    BuildFailed: A failure of this build is recorded.
    OSError: The library is not safe to load (`check_safe`).
  """
  if output.exists():
    check_safe(output)
    return True
  record = _failure_record(output)
  if record.exists():
    check_safe(record)
    try:
      reason = json.loads(record.read_text())["message"]
    except (ValueError, KeyError, OSError):
      reason = f"the build failed earlier (recorded in {record})"
    raise BuildFailed(reason)
  return False


def _failure_record(output: pathlib.Path) -> pathlib.Path:
  return output.with_suffix(".failed")


def _forget(output: pathlib.Path) -> None:
  """Removes the library and its recorded failure (`force`)."""
  for path in (output, _failure_record(output)):
    if path.exists():
      path.unlink()


def _compile(cxx: str, output: pathlib.Path) -> None:
  """Builds the library into `output`, the compiler's output into
  `<library>.log` only; on failure records it (`<library>.failed`) and
  raises BuildFailed."""
  partial = output.with_name(f"{output.stem}.{os.getpid()}.partial.so")
  log = output.with_suffix(".log")
  logging.warning(
      "tf_pxg: compiling the native ops once for this CPU level (%s), "
      "compiler and TensorFlow (%s) into %s; `tf-pxg build-native` does "
      "this ahead of time.", isa(), _BUILD_TIME, output)
  start = time.monotonic()
  try:
    done = _run_compiler(cxx, partial, output, log)
    os.chmod(partial, 0o700)
    os.replace(partial, output)
  finally:
    if partial.exists():
      partial.unlink()
  warnings = [line for line in done.stderr.splitlines() if "warning:" in line]
  own = [line for line in warnings if str(KERNELS) in line or
         line.startswith(tuple(f.name for f in sources()))]
  logging.warning("tf_pxg: native ops compiled in %.1f s (%d compiler "
                  "warning(s), %d in tf_pxg's kernels; compiler output in %s)",
                  time.monotonic() - start, len(warnings), len(own), log)
  for line in own:
    logging.warning("tf_pxg: %s", line)


# How long the whole build (all compile steps and the link) may take.
_TIMEOUT = 1200


def _jobs(steps: int) -> int:
  """How many compile steps run at once: one per CPU, at most `steps`."""
  return max(1, min(os.cpu_count() or 1, steps))


def _run_compiler(cxx: str, partial: pathlib.Path, output: pathlib.Path,
                  log: pathlib.Path) -> subprocess.CompletedProcess:
  """Compiles each source to an object file (up to `_jobs` compilers at
  once, the objects in a private temporary directory beside `output`,
  removed afterwards), then links them into `partial`; writes every
  command, its output and exit status to `log`. Unless all succeed within
  `_TIMEOUT` seconds, stops the steps still running, records the failure
  of `output` and raises BuildFailed.

  Returns:
    A CompletedProcess whose `args` are the commands run and `stdout` and
    `stderr` the outputs of all of them, in command order.
  """
  objects = pathlib.Path(tempfile.mkdtemp(  # mode 0700
      prefix=f"{output.stem}.{os.getpid()}.", suffix=".objects",
      dir=output.parent))
  try:
    compiles, link = _build_commands(cxx, partial, objects)
    deadline = time.monotonic() + _TIMEOUT
    steps, why = _run_steps(compiles, _jobs(len(compiles)), deadline,
                            objects)
    if why is None:
      more, why = _run_steps([link], 1, deadline, objects)
      steps += more
    _write_private(log, "".join(step.log() for step in steps))
  finally:
    shutil.rmtree(objects, ignore_errors=True)
  if why is not None:
    _fail(output, why, log)
  return subprocess.CompletedProcess(
      [step.command for step in steps], 0,
      "".join(step.stdout for step in steps),
      "".join(step.stderr for step in steps))


@dataclasses.dataclass
class _Step:
  """One compiler command of a build, and what became of it."""
  command: List[str]
  stdout: str = ""
  stderr: str = ""
  status: str = "not run (another step failed)"

  def log(self) -> str:
    return f"$ {' '.join(self.command)}\n{self.stdout}{self.stderr}" \
           f"{self.status}\n"


def _run_steps(commands: List[List[str]], jobs: int, deadline: float,
               scratch: pathlib.Path) -> Tuple[List["_Step"], Optional[str]]:
  """Runs `commands`, up to `jobs` at once (each in a process group of its
  own, its output in files under `scratch`), until all succeed, one fails,
  or `deadline` passes; then stops (SIGKILL to the group) those still
  running.

  Returns:
    (a `_Step` per command, in order; None if all succeeded, else why the
    first failure failed, in one line).
  """
  steps = [_Step(command) for command in commands]
  waiting = list(range(len(steps)))
  running = {}  # step index -> (Popen, stdout file, stderr file, start)
  why = None
  stop = "another step failed"
  try:
    while (waiting or running) and why is None:
      while waiting and len(running) < jobs:
        i = waiting.pop(0)
        out, err = (open(scratch / f"step{i}.{kind}", "w+")
                    for kind in ("out", "err"))
        try:
          running[i] = (subprocess.Popen(
              steps[i].command, stdin=subprocess.DEVNULL, stdout=out,
              stderr=err, text=True, start_new_session=True), out, err,
                        time.monotonic())
        except OSError as e:
          out.close()
          err.close()
          steps[i].status = f"not run: {e}"
          why = f"running {steps[i].command[0]} failed: {_one_line(str(e))}"
          break
      for i, (process, out, err, began) in list(running.items()):
        if process.poll() is None:
          continue
        del running[i]
        _collect(steps[i], out, err, f"exit {process.returncode} after "
                 f"{time.monotonic() - began:.1f} s")
        if process.returncode != 0 and why is None:
          why = (f"{os.path.basename(steps[i].command[0])} exited with "
                 f"status {process.returncode}: "
                 f"{_first_error(steps[i].stdout + steps[i].stderr)}")
      if why is None and running and time.monotonic() > deadline:
        stop = "the build took too long"
        why = (f"running {steps[0].command[0]} failed: the build took "
               f"longer than {_TIMEOUT} s")
      if why is None and running:
        time.sleep(0.05)
  finally:
    for i, (process, out, err, _) in running.items():
      with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
      process.wait()
      _collect(steps[i], out, err,
               f"stopped (exit {process.returncode}): "
               f"{stop if why else 'interrupted'}")
  return steps, why


def _collect(step: "_Step", out, err, status: str) -> None:
  """Reads a finished step's output files (and closes them)."""
  for f in (out, err):
    f.seek(0)
  step.stdout, step.stderr = out.read(), err.read()
  out.close()
  err.close()
  step.status = status


def _fail(output: pathlib.Path, why: str, log: pathlib.Path) -> None:
  """Records a failed build of `output` and raises BuildFailed."""
  message = (f"building {output.name} failed ({why}; the compiler's output "
             f"is in {log}). The failure is recorded for this compiler, its "
             "flags, this CPU level and TensorFlow, so no process retries "
             "it; `tf-pxg build-native --force` does.")
  _write_private(_failure_record(output),
                 json.dumps({"message": message, "time": time.time()}))
  raise BuildFailed(message)


def _first_error(text: str) -> str:
  """The compiler's first error line (`...: error: ...`), or its last line."""
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  errors = [l for l in lines if "error:" in l]
  return _one_line((errors or lines or ["no output"])[0])[:300]


def _one_line(text: str) -> str:
  return " ".join(text.split())


def _write_private(path: pathlib.Path, text: str) -> None:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(text)


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  """An exclusive `fcntl` lock on `path` (created 0600), held for the block."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _candidates(cache_dir: pathlib.Path):
  """`cache_dir`, then a per-user directory under the system's temporary
  directory (for a read-only or unsafe home)."""
  yield cache_dir
  yield pathlib.Path(tempfile.gettempdir()) / f"tf_pxg-{os.getuid()}"


def _prepare(directory: pathlib.Path) -> Optional[str]:
  """Creates `directory` (mode 0700) if missing; None if it is usable
  (writable and `check_safe`), else why not."""
  try:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
  except OSError as e:
    return f"cannot create {directory} ({e.strerror or e})"
  try:
    check_safe(directory)
  except OSError as e:
    return str(e)
  if not os.access(directory, os.W_OK):
    return f"{directory} is not writable"
  return None


def check_safe(path: pathlib.Path) -> None:
  """Raises OSError unless `path` (a cache directory or a library in it)
  belongs to the current user and is not writable by group or others (so
  no other local user can plant or replace a library that
  `tf.load_op_library` would run)."""
  info = os.stat(path, follow_symlinks=False)
  if stat.S_ISLNK(info.st_mode):
    raise OSError(f"{path} is a symbolic link; tf_pxg does not load native "
                  "ops through one")
  if info.st_uid != os.geteuid():
    raise OSError(f"{path} belongs to uid {info.st_uid}, not to this user "
                  f"(uid {os.geteuid()}); tf_pxg does not load native ops "
                  "from it")
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise OSError(f"{path} is writable by group or others (mode "
                  f"{stat.S_IMODE(info.st_mode):o}); tf_pxg does not load "
                  "native ops from it (chmod 0700 it, or set "
                  "TF_PXG_CACHE_DIR)")


def check(cache_dir: Optional[pathlib.Path] = None) -> Tuple[bool, List[str]]:
  """Which ops run natively in this environment and, for each other, what
  runs instead and why (`tf-pxg build-native --check`). Loads the library
  if it is built; never builds it.

  Returns:
    (whether every op is native, the report's lines).
  """
  lines, why, lib = _availability(cache_dir)
  for op in ops():
    if lib is not None and hasattr(lib, op):
      lines.append(f"  {op:<38} native")
    else:
      lines.append(f"  {op:<38} fallback: {FALLBACKS.get(op, 'TF ops')}")
      why = why or (f"{op} is not in the library (`tf-pxg build-native "
                    "--force` rebuilds it)")
  if why:
    lines.append(f"why: {why}")
  lines.append("(code compiled with XLA, GPUs/TPUs and dtypes an op does "
               "not take use the fallbacks anyway)")
  return not why, lines


def _availability(cache_dir) -> Tuple[List[str], Optional[str], object]:
  """(header lines, why the ops are not native or None, the loaded library
  or None), without building."""
  if not enabled():
    return ["tf_pxg native ops: switched off"], (
        "TF_PXG_NATIVE=0 (or false/no/off) is set"), None
  try:
    cxx = compiler()
    level = isa()
  except (OSError, ValueError) as e:
    return ["tf_pxg native ops: no build possible"], str(e), None
  header = [f"tf_pxg native ops: level {level}, compiler {cxx} "
            f"({_compiler_version(cxx)}), TensorFlow {tf.__version__}"]
  path = _locate(pathlib.Path(cache_dir or _cache_dir()),
                 library_name(cxx, level))
  if path is None:
    return header, "no usable cache directory (set TF_PXG_CACHE_DIR)", None
  header.append(f"library: {path}")
  try:
    if not _cached(path):
      return header, ("not built yet: the first use in a process compiles "
                      f"it ({_BUILD_TIME}); `tf-pxg "
                      "build-native` does it now"), None
    return header, None, tf.load_op_library(str(path))
  except (OSError, tf.errors.OpError) as e:
    return header, _one_line(str(e)), None


def _compiler_version(cxx: str) -> str:
  """The first line of `cxx --version`, or why there is none."""
  try:
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                          timeout=60)
  except (OSError, subprocess.SubprocessError) as e:
    return f"--version failed: {_one_line(str(e))}"
  return (done.stdout.strip().splitlines() or ["unknown version"])[0]


def _locate(cache_dir: pathlib.Path, name: str) -> Optional[pathlib.Path]:
  """Where `build` puts library `name`: in the first usable candidate
  directory (None if none is)."""
  for directory in _candidates(cache_dir):
    if _prepare(directory) is None:
      return directory / name
  return None


@tf.RegisterGradient("TfPxgAddNormalNoise")
def _add_normal_noise_grad(op, grad):
  """The noise does not depend on the tensor: d(c (t + s z))/dt = c."""
  return [grad * op.inputs[3], None, None, None]


@tf.RegisterGradient("TfPxgNormalNoiseScatterAdd")
def _normal_noise_scatter_add_grad(op, grad):
  """Row `i` of `values`, times the scale, is added to row `indices[i]`."""
  return [tf.gather(grad, op.inputs[1]) * op.inputs[4], None, None, None,
          None]


@tf.RegisterGradient("TfPxgRowSumOfSquares")
def _row_sum_of_squares_grad(op, grad):
  """d(sum_j x_nj^2)/dx_nj = 2 x_nj."""
  x = op.inputs[0]
  shape = tf.concat([tf.shape(grad), tf.ones([tf.rank(x) - 1], tf.int32)], 0)
  return [2.0 * x * tf.reshape(grad, shape)]


@tf.RegisterGradient("TfPxgScaleRows")
def _scale_rows_grad(op, grad):
  """y[n] = t[n] c[n // k]: dt = grad scaled the same way; dc[b] = the sum
  over example b's k rows of grad * t."""
  t, c = op.inputs
  by_example = tf.stack([tf.shape(c)[0], -1])
  dt = tf.reshape(tf.reshape(grad, by_example) * c[:, None], tf.shape(grad))
  dc = tf.reduce_sum(tf.reshape(grad * t, by_example), axis=1)
  return [dt, dc]
