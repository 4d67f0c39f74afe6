"""Each run of a private search in a process of its own.

`run_isolated(job)` runs `job()` in a fresh process and returns what it
returns, and nothing else of the run reaches the caller:

* **Process.** The run is a child of a fork server (`multiprocessing`'s
  "forkserver" context, TensorFlow, Keras and tf_pxg imported there once,
  before any op ran): every run starts from the same clean interpreter,
  not from the caller's (no TF global counters, op or function ids, Keras
  name counters, caches, objects of an earlier run) and not from another
  run's. Where the platform has no fork server, "spawn" (slower, the same
  guarantees).
* **Randomness.** The child seeds Python's, NumPy's and TensorFlow's global
  generators from the OS CSPRNG (`keras.utils.set_random_seed` with 32
  bits of `secrets`) before the job runs: whatever seeds the caller set
  (e.g. `keras.utils.set_random_seed(0)` before the search, as tests and
  examples do) do not reach it, so the K runs' initialisations are
  independent and cannot be replayed to tell the winner's index.
* **Output.** File descriptors 1 and 2 (TensorFlow's C++ logs, `tf.print`,
  warnings printed at garbage collection) and Python's streams go to
  /dev/null for the child's whole life; Python logging is off.
* **Files.** The child works in a private directory (`cwd` and
  `tempfile.tempdir`), which the caller removes after the child ended,
  whatever happened.
* **What crosses back:** the job's return value (pickled), or the failure's
  type and message (a string; no traceback, no object).

`job` crosses the other way: it is pickled with cloudpickle when that is
installed (closures and lambdas work), else with `pickle` (a module-level
function or a `functools.partial` of one).

Cost: one fork (and the TensorFlow runtime's start in the child) per run,
plus the fork server's start once per process (the import of TensorFlow).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import secrets
import shutil
import sys
import tempfile
from typing import Any, Callable

__all__ = ["IsolationError", "run_isolated"]

#: Modules the fork server imports once (the runs then start with them).
PRELOAD = ["tensorflow", "keras", "tf_pxg.keras", "tf_pxg.tuning.search"]


class IsolationError(RuntimeError):
  """The isolated run failed; the message is the only thing kept."""


def _dumps(obj) -> bytes:
  try:
    import cloudpickle  # noqa: PLC0415  (optional: closures)
    return cloudpickle.dumps(obj)
  except ImportError:
    return pickle.dumps(obj)


def _context():
  methods = multiprocessing.get_all_start_methods()
  if "forkserver" in methods:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
  return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _silenced():
  """Descriptors 1 and 2 and Python's streams to /dev/null, logging off
  (the child's whole life: nothing is restored)."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  sink = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
  sys.stdout = sys.stderr = sink
  logging.disable(logging.CRITICAL)
  yield


def _child(conn, payload: bytes, workdir: str) -> None:
  """The run's process: silent, private directory, fresh OS seeds; sends
  `("ok", pickled result)` or `("error", message)`."""
  with _silenced():
    try:
      os.chdir(workdir)
      tempfile.tempdir = workdir
      import keras  # noqa: PLC0415
      keras.utils.set_random_seed(secrets.randbits(32))
      job = pickle.loads(payload)
      conn.send(("ok", pickle.dumps(job())))
    except BaseException as e:  # pylint: disable=broad-except
      conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
      conn.close()
  os._exit(0)  # pylint: disable=protected-access  (no atexit, no output)


def run_isolated(job: Callable[[], Any]) -> Any:
  """`job()` in a process of its own (module docstring).

  Raises:
    IsolationError: `job` could not be pickled, raised (its type and
      message), or the process died without an answer.
  """
  try:
    payload = _dumps(job)
  except Exception as e:  # pylint: disable=broad-except
    raise IsolationError(
        f"the run's function cannot be sent to its own process "
        f"({type(e).__name__}: {e}); define train_fn at module level (or "
        "install cloudpickle) and give it picklable arguments "
        "(functools.partial).") from None
  ctx = _context()
  workdir = tempfile.mkdtemp(prefix="tf_pxg_run_")
  receive, send = ctx.Pipe(duplex=False)
  process = ctx.Process(target=_child, args=(send, payload, workdir),
                        daemon=True)
  try:
    process.start()
    send.close()
    try:
      status, value = receive.recv()
    except EOFError:
      status, value = "error", (f"the run's process ended without an answer "
                                f"(exit code {process.exitcode})")
    process.join()
  finally:
    receive.close()
    if process.is_alive():
      process.kill()
      process.join()
    shutil.rmtree(workdir, ignore_errors=True)
  if status != "ok":
    raise IsolationError(value)
  return pickle.loads(value)
