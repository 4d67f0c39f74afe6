"""Each run of a private search in a process of its own.

`run_isolated(job)` runs `job()` in a fresh process and returns what it
returns, and nothing else of the run reaches the caller:

* **Process.** The run is a child forked from a server process
  (`tf_pxg.tuning._fork_server`, started once, which imported TensorFlow,
  Keras and tf_pxg and ran nothing else; it never imports the caller's
  `__main__`): every run starts from the same clean interpreter, not from
  the caller's (no TF global counters, op or function ids, Keras name
  counters, caches, objects) and not from another run's.
* **Randomness.** The child seeds Python's, NumPy's and TensorFlow's global
  generators from the OS CSPRNG (`keras.utils.set_random_seed` with 32
  bits of `secrets`) before the job runs: whatever seeds the caller set
  (e.g. `keras.utils.set_random_seed(0)` before the search, as tests and
  examples do) do not reach it, so the K runs' initialisations are
  independent and cannot be replayed to tell the winner's index.
* **Output.** File descriptors 1 and 2 (TensorFlow's C++ logs, `tf.print`,
  warnings printed at garbage collection) and Python's streams go to
  /dev/null for the child's whole life (and the server's); Python logging
  is off.
* **Files.** The child works in a private directory (`cwd` and
  `tempfile.tempdir`), which the caller removes after the run ended,
  whatever happened.
* **What crosses back:** the job's return value (pickled), or the failure's
  type and message (a string; no traceback, no object).

`job` crosses the other way: pickled with cloudpickle when that is
installed (closures, lambdas and functions of a script work), else with
`pickle` (a module-level function or a `functools.partial` of one).

Cost: one fork and the TensorFlow runtime's start in the child per run;
the server's start (an import of TensorFlow) once per caller process.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

from tf_pxg.tuning import _wire

__all__ = ["IsolationError", "run_isolated"]


class IsolationError(RuntimeError):
  """The isolated run failed; the message is the only thing kept."""


def _dumps(obj) -> bytes:
  try:
    import cloudpickle  # noqa: PLC0415  (optional: closures)
    return cloudpickle.dumps(obj)
  except ImportError:
    return pickle.dumps(obj)


class _Server:
  """The running fork server (started on first use, closed at exit)."""

  _lock = threading.Lock()
  _process = None

  @classmethod
  def request(cls, payload: bytes, workdir: str):
    with cls._lock:
      process = cls._process
      if process is None or process.poll() is not None:
        process = subprocess.Popen(
            [sys.executable, "-m", "tf_pxg.tuning._fork_server"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=os.sep)
        _wire.write_message(process.stdin.fileno(), list(sys.path))
        cls._process = process
        atexit.register(cls.close)
      try:
        _wire.write_message(process.stdin.fileno(),
                                   (payload, workdir))
        answer = _wire.read_message(process.stdout.fileno())
      except OSError:
        answer = None
      if answer is None:
        cls.close()
        return "error", "the run's process server ended without an answer"
      return answer

  @classmethod
  def close(cls):
    process, cls._process = cls._process, None
    if process is not None and process.poll() is None:
      process.stdin.close()
      try:
        process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        process.kill()


def _silence() -> None:
  """Descriptors 1 and 2 and Python's streams to /dev/null, logging off
  (the child's whole life: nothing is restored)."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  sys.stdout = sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
  logging.disable(logging.CRITICAL)


def child_main(payload: bytes, workdir: str):
  """The run's process (forked by the server): silent, private directory,
  fresh OS seeds; returns `("ok", pickled result)` or `("error",
  message)`."""
  _silence()
  try:
    os.chdir(workdir)
    tempfile.tempdir = workdir
    import keras  # noqa: PLC0415
    keras.utils.set_random_seed(secrets.randbits(32))
    job = pickle.loads(payload)
    return "ok", pickle.dumps(job())
  except BaseException as e:  # pylint: disable=broad-except
    return "error", f"{type(e).__name__}: {e}"


def run_isolated(job: Callable[[], Any]) -> Any:
  """`job()` in a process of its own (module docstring).

  Raises:
    IsolationError: `job` could not be pickled, raised (its type and
      message), or its process died without an answer.
  """
  try:
    payload = _dumps(job)
  except Exception as e:  # pylint: disable=broad-except
    raise IsolationError(
        f"the run's function cannot be sent to its own process "
        f"({type(e).__name__}: {e}); define train_fn at module level (or "
        "install cloudpickle) and give it picklable arguments "
        "(functools.partial).") from None
  workdir = tempfile.mkdtemp(prefix="tf_pxg_run_")
  try:
    status, value = _Server.request(payload, workdir)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  if status != "ok":
    raise IsolationError(value)
  return pickle.loads(value)
