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
* `TfPxgConv2DFilterSqNorm` (`kernels/conv_norms.cc`): per-example squared
  norms of a 2-D convolution's filter gradient, accumulated in registers
  from each example's input and output gradient, with no patch tensor
  (`tf_pxg.rules.conv`).
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
dtypes, and machines without a compiler.

The library is built once per machine: the installed TensorFlow's headers
and flags (`tf.sysconfig`), `-O3 -march=native`, into a cache directory
keyed by the sources, TensorFlow's version, the compiler and the CPU's
features, then loaded with `tf.load_op_library`. Building takes tens of
seconds of one core; the first use logs a WARNING that it is compiling and
how long it took. `tf-pxg build-native` builds ahead of time (for
container images: run it in the image, with the cache directory the
program will use). A file lock (`fcntl`) around the build makes concurrent
processes (the workers of a multi-worker job) build once; the others wait
and load the result. The compiler's own output, warnings included, goes to
`<library>.log` beside the library (its last lines are logged if the build
fails).

Safety: the cache directory is created with mode 0700, and before a
library is built into or loaded from a directory, the directory (and the
library) must belong to the current user and not be writable by group or
others; otherwise that directory is not used (another local user could
otherwise plant a library that `tf.load_op_library` runs).

Without a compiler (or with `TF_PXG_NATIVE=0`), a failed build logs one
warning with the compiler's message, and the TF/XLA paths are used: the
same results, at the cost measured in docs/benchmarks.md (DP noise by the
XLA Threefry kernel, convolutions' per-example norms through patch
tensors, row norms and clip scaling by TF's ops).

Environment:
  TF_PXG_NATIVE=0: never build or use the native ops.
  TF_PXG_CACHE_DIR: where the library goes (default
    `$XDG_CACHE_HOME/tf_pxg`, else `~/.cache/tf_pxg`).
  CXX: the C++ compiler (default the first of g++, c++, clang++ on PATH).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from typing import List, Optional

import tensorflow as tf

from tf_pxg import xla

__all__ = ["KERNELS", "OPTIMIZATION_FLAGS", "build", "compiler", "enabled",
           "library", "serves", "sources"]

KERNELS = pathlib.Path(__file__).with_name("kernels")
# How the kernels are optimised (also for benchmarks/threefry_rounds.cc,
# which times the sampling code outside TF), and what makes a loadable
# library.
OPTIMIZATION_FLAGS = ("-O3", "-march=native", "-fno-math-errno")
_FLAGS = OPTIMIZATION_FLAGS + ("-shared", "-fPIC")
_lock = threading.Lock()
_loaded = {}


def sources() -> List[pathlib.Path]:
  """The library's C++ sources (`kernels/*.cc`), in a fixed order."""
  return sorted(KERNELS.glob("*.cc"))


def enabled() -> bool:
  """False if `TF_PXG_NATIVE=0` (or `false`/`no`/`off`) is set."""
  value = os.environ.get("TF_PXG_NATIVE", "1").strip().lower()
  return value not in ("0", "false", "no", "off")


@tf.autograph.experimental.do_not_convert
def library():
  """The loaded op library (its ops as `tf_pxg_add_normal_noise`,
  `tf_pxg_normal_noise_scatter_add`, `tf_pxg_conv2d_filter_sq_norm`,
  `tf_pxg_depthwise_conv2d_filter_sq_norm`,
  `tf_pxg_depthwise_conv2d_filter_weighted_sum`,
  `tf_pxg_row_sum_of_squares`, `tf_pxg_scale_rows`), or
  None if it is disabled or could not be built (a warning says why, once
  per process)."""
  if not enabled():
    return None
  with _lock:
    if "lib" not in _loaded:
      _loaded["lib"] = None
      try:
        _loaded["lib"] = tf.load_op_library(build())
      except (OSError, subprocess.SubprocessError,
              tf.errors.OpError) as e:
        logging.warning(
            "tf_pxg: the native ops are unavailable, so DP noise uses the "
            "XLA kernel (more CPU per Gaussian, see docs/benchmarks.md) and "
            "convolutions' per-example norms use patch tensors. Why: %s", e)
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
    OSError: If there is none.
  """
  cxx = os.environ.get("CXX")
  if cxx:
    return cxx
  for name in ("g++", "c++", "clang++"):
    found = shutil.which(name)
    if found:
      return found
  raise OSError("no C++ compiler on PATH (install g++ or set CXX)")


def _cpu_features() -> str:
  """The CPU's model and feature flags (what `-march=native` depends on)."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [l for l in f if l.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return ""


def _cache_dir() -> pathlib.Path:
  if os.environ.get("TF_PXG_CACHE_DIR"):
    return pathlib.Path(os.environ["TF_PXG_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "tf_pxg"


def _command(cxx: str, output: pathlib.Path) -> List[str]:
  return ([cxx, *map(str, sources()), "-o", str(output), *_FLAGS] +
          tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())


def build(cache_dir: Optional[pathlib.Path] = None) -> str:
  """Compiles the library unless the cache has it; returns its path.

  Concurrent builds (several processes of a multi-worker job) build once:
  the build holds an exclusive `fcntl` lock on `<library>.lock`, and a
  process that waited for it finds the library built. The compiler writes
  to a file of its own, renamed into place atomically.

  The library goes to `cache_dir` (default: see the module doc), or, if
  that cannot be created or written or is not safe (`check_safe`), to
  `$TMPDIR/tf_pxg-<uid>` (created with mode 0700).

  Raises:
    OSError: No compiler was found, or no cache directory is writable and
      safe (the message says why for each).
    subprocess.CalledProcessError: The compiler failed (its message is in
      the exception's `stderr` and string).
  """
  cxx = compiler()
  cache_dir = pathlib.Path(cache_dir or _cache_dir())
  digest = hashlib.sha256()
  files = sorted(KERNELS.glob("*.[ch]*"))  # the ops and their headers
  for part in (*(f.read_bytes() for f in files), tf.__version__.encode(),
               " ".join(_command(cxx, pathlib.Path("out"))).encode(),
               _cpu_features().encode()):
    digest.update(part)
    digest.update(b"\0")
  name = f"tf_pxg_ops-{digest.hexdigest()[:20]}.so"
  reasons = []
  for directory in _candidates(cache_dir):
    problem = _prepare(directory)
    if problem:
      reasons.append(problem)
      continue
    output = directory / name
    if output.exists():
      check_safe(output)
      return str(output)
    with _locked(output.with_suffix(".lock")):
      if not output.exists():  # Another process may have built it meanwhile.
        _compile(cxx, output)
    check_safe(output)
    return str(output)
  raise OSError("no usable cache directory for tf_pxg's native ops (set "
                "TF_PXG_CACHE_DIR to a directory of yours, mode 0700): " +
                "; ".join(reasons))


def _compile(cxx: str, output: pathlib.Path) -> None:
  partial = output.with_name(f"{output.stem}.{os.getpid()}.partial.so")
  log = output.with_suffix(".log")
  logging.warning(
      "tf_pxg: compiling the native ops once for this machine and "
      "TensorFlow (tens of seconds) into %s; `tf-pxg build-native` does this "
      "ahead of time.", output)
  start = time.monotonic()
  try:
    done = subprocess.run(_command(cxx, partial), capture_output=True,
                          text=True, timeout=600)
    _write_private(log, f"$ {' '.join(done.args)}\n{done.stdout}"
                   f"{done.stderr}exit {done.returncode}\n")
    if done.returncode != 0:
      raise _BuildError(done.returncode, done.args, done.stdout, done.stderr)
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


class _BuildError(subprocess.CalledProcessError):

  def __str__(self):
    tail = "\n".join((self.stderr or "").strip().splitlines()[-15:])
    names = ", ".join(f.name for f in sources())
    return (f"compiling {names} failed (exit {self.returncode}):\n"
            f"{tail}")


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
