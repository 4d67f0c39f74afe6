"""Running tf.distribute test scripts in fresh Python processes.

Logical devices and `TF_CONFIG` must be set before TensorFlow initialises, so
the distribute tests run their cases as `python -c SCRIPT` subprocesses that
print one `RESULT <json>` line. `run_script` runs one such process (e.g. a
MirroredStrategy over 2 logical CPUs); `run_workers` starts a
MultiWorkerMirroredStrategy cluster of worker processes on 127.0.0.1, one
`TF_CONFIG` each, and collects their results. Not a test file itself.

Each process pays ~10 s of CPU importing TensorFlow and Keras before its
first op, so the cases share processes: a test file puts its
MirroredStrategy cases in a script `MIRRORED_CASES` and its multi-worker
cases in `MULTI_WORKER_CASES`, and gets their results from
`mirrored_results` / `multi_worker_results` through a module-scoped
fixture named `mirrored` / `multi_worker_cluster`. One process on 2 logical
CPUs runs the `MIRRORED_CASES` of every file with a selected, unskipped
test that uses that fixture, and one cluster of two workers the
`MULTI_WORKER_CASES` likewise, once per test run (`run_once`: also when
pytest-xdist spreads the tests over workers). Each script runs in a
namespace of its own with `strategy` bound, and ends by calling
`scenarios(name=function, ...)`: each function's JSON result, or the
traceback of its exception, is kept under its name, the next ones still
run, and each test checks its case with `scenario(results, name)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any, Callable, List

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Script lines (after `import tensorflow as tf`, before TF initialises):
# two logical CPUs and a MirroredStrategy over them, bound to `strategy`.
MIRRORED_TWO_CPUS = """\
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
"""


def scenario(results: dict, name: str) -> Any:
  """The result of case `name` among a file's results (`mirrored_results`,
  or one worker's of `multi_worker_results`).

  Raises:
    AssertionError: the case (or the file's script before it) raised in the
      subprocess, with its traceback.
  """
  for key in ("*", name):
    got = results.get(key)
    if isinstance(got, dict) and set(got) == {"error"}:
      raise AssertionError(f"case {name!r} failed in the subprocess:\n"
                           f"{got['error']}")
  if name not in results:
    raise AssertionError(f"case {name!r} did not run (ran: {sorted(results)})")
  return results[name]


def one_vs_mirrored_fit(model: str) -> str:
  """A script that fits the DP model the expression `model` builds (from
  `keras`, `tf_pxg` and `dpk` = `tf_pxg.keras`; inputs of 3 features,
  targets of 2, MSE, SGD(0.1)) on one device and under MirroredStrategy
  over two logical CPUs, 2 epochs of 4 shuffled batches of 16 each, and
  prints `RESULT {"one": [clips, weights], "two": [...]}`: the optimizer's
  `current_l2_norm_clip` after each batch and the trained weights."""
  return textwrap.dedent("""
      import json, os
      os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
      import numpy as np
      import tensorflow as tf
      import keras
      cpu = tf.config.list_physical_devices("CPU")[0]
      tf.config.set_logical_device_configuration(
          cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      import tf_pxg
      import tf_pxg.keras as dpk

      rng = np.random.default_rng(0)
      x = rng.standard_normal((64, 3)).astype("float32")
      y = rng.standard_normal((64, 2)).astype("float32")

      def run(strategy):
        with strategy.scope():
          keras.utils.set_random_seed(1)
          model = MODEL
          model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                        jit_compile=False)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        clips = []
        cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch,
            logs: clips.append(model.optimizer.current_l2_norm_clip))
        model.fit(ds, epochs=2, verbose=0, sampling="shuffled",
                  callbacks=[cb])
        return clips, [v.numpy().tolist() for v in model.trainable_variables]

      one = run(tf.distribute.get_strategy())
      two = run(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
      print("RESULT", json.dumps(dict(one=one, two=two)))
      """).replace("MODEL", model)


def env(**extra) -> dict:
  """`os.environ` plus `extra`, with the repository first on PYTHONPATH."""
  out = dict(os.environ)
  out.update(extra)
  out["PYTHONPATH"] = os.pathsep.join(
      [_ROOT] + out.get("PYTHONPATH", "").split(os.pathsep))
  return out


def result(stdout: str) -> dict:
  """The JSON of the first `RESULT ` line of `stdout`.

  Raises:
    AssertionError: if there is none, showing the output.
  """
  for line in stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  raise AssertionError(f"no RESULT line in output:\n{stdout}")


def run_script(code: str, *args: str, timeout: float) -> dict:
  """Runs `python -c code *args` in `env()` and returns its RESULT.

  Raises:
    AssertionError: if the process fails (with its stderr's tail) or prints
      no RESULT line.
    subprocess.TimeoutExpired: after `timeout` seconds.
  """
  proc = subprocess.run([sys.executable, "-c", code, *args], env=env(),
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return result(proc.stdout)


def free_ports(n: int) -> List[int]:
  """`n` TCP ports on 127.0.0.1 that were free a moment ago."""
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def run_workers(code: str, *, num_workers: int = 2,
                timeout: float) -> List[dict]:
  """Runs `python -c code` as the workers of a local CPU-only cluster.

  Each worker gets `TF_CONFIG` naming all `num_workers` workers on free
  127.0.0.1 ports and its own index, and `CUDA_VISIBLE_DEVICES=-1`. A worker
  still running when the others are done or time out is killed.

  Returns:
    The RESULT of each worker, in index order.

  Raises:
    AssertionError: if a worker fails (with its stderr's tail) or prints no
      RESULT line.
    subprocess.TimeoutExpired: if a worker takes over `timeout` seconds.
  """
  cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(num_workers)]}
  procs = []
  for index in range(num_workers):
    tf_config = json.dumps({"cluster": cluster,
                            "task": {"type": "worker", "index": index}})
    procs.append(subprocess.Popen(
        [sys.executable, "-c", code],
        env=env(TF_CONFIG=tf_config, CUDA_VISIBLE_DEVICES="-1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outputs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      outputs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for code_, _, err in outputs:
    assert code_ == 0, err[-4000:]
  return [result(out) for _, out, _ in outputs]


_ONCE = {}


def run_once(tmp_path_factory, run: Callable[..., Any], *args,
             **kwargs) -> Any:
  """`run(*args, **kwargs)` (`run_script` or `run_workers`) once per test run.

  In one pytest process the first call runs it and later calls with the
  same arguments give its result (or its error) again. Under pytest-xdist
  the tests of one file may run on different workers: the first worker to
  call runs it under a lock in the workers' shared temporary directory
  (`tmp_path_factory`'s) and leaves the outcome there; the others wait for
  the lock and read it, so the subprocesses start once, not once per worker.

  Raises:
    AssertionError: `run` failed or timed out (here, or on the worker that
      ran it), with its message.
  """
  key = hashlib.sha256(json.dumps(
      [run.__name__, args, sorted(kwargs.items())]).encode()).hexdigest()[:16]
  if key not in _ONCE:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
      _ONCE[key] = _outcome(run, args, kwargs)
    else:
      import fcntl  # pylint: disable=g-import-not-at-top  (POSIX, xdist only)
      shared = tmp_path_factory.getbasetemp().parent / "tf_pxg_run_once"
      shared.mkdir(exist_ok=True)
      with open(shared / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = shared / f"{key}.json"
        if done.exists():
          _ONCE[key] = tuple(json.loads(done.read_text()))
        else:
          _ONCE[key] = _outcome(run, args, kwargs)
          done.write_text(json.dumps(_ONCE[key]))
  ok, value = _ONCE[key]
  if not ok:
    raise AssertionError(value)
  return value


def _outcome(run, args, kwargs):
  """(True, run's result) or (False, the message of its failure)."""
  try:
    return True, run(*args, **kwargs)
  except (AssertionError, subprocess.TimeoutExpired) as e:
    return False, f"{type(e).__name__}: {e}"


# The shared process: each file's cases script in a namespace of its own.
_DRIVER = """\
import faulthandler, json, os, sys, traceback
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
STRATEGY
sys.path.insert(0, TESTS)
out = {}
for name, code in PARTS:
  print("== cases of", name, file=sys.stderr, flush=True)
  # A file's cases that hang: every thread's stack to stderr, and exit 1.
  faulthandler.dump_traceback_later(PART_TIMEOUT, exit=True)
  cases = out[name] = {}
  def scenarios(**functions):
    for case, function in functions.items():
      try:
        cases[case] = function()
      except Exception:  # pylint: disable=broad-except
        cases[case] = {"error": traceback.format_exc()}
  try:
    exec(compile(code, name + ".CASES", "exec"), {  # pylint: disable=exec-used
        "__name__": name + "_cases", "strategy": strategy,
        "scenarios": scenarios})
  except Exception:  # pylint: disable=broad-except
    cases["*"] = {"error": traceback.format_exc()}
faulthandler.cancel_dump_traceback_later()
print("RESULT", json.dumps(out))
"""

_MWMS = "strategy = tf.distribute.MultiWorkerMirroredStrategy()\n"

# Seconds a file's cases may take in a shared process (then it exits with
# every thread's stack), and the process's own start (imports, strategy).
_PART_TIMEOUT = 600
_START_TIMEOUT = 300


def _parts(request, attr: str, fixture: str) -> List[tuple]:
  """(module name, its `attr` script) of every collected module with a
  selected test that uses `fixture` and is not marked skip (the slow tier
  without --slow, tests/conftest.py), in name order."""
  parts = {}
  for item in request.session.items:
    module = getattr(item, "module", None)
    if (module is not None and hasattr(module, attr) and
        fixture in getattr(item, "fixturenames", ()) and
        item.get_closest_marker("skip") is None):
      parts[module.__name__] = getattr(module, attr)
  return sorted(parts.items())


def _driver(strategy: str, parts: List[tuple]) -> str:
  return (_DRIVER.replace("STRATEGY\n", strategy)
          .replace("TESTS", repr(os.path.join(_ROOT, "tests")))
          .replace("PART_TIMEOUT", str(_PART_TIMEOUT))
          .replace("PARTS", repr(parts)))


def _timeout(parts: List[tuple]) -> float:
  return _START_TIMEOUT + _PART_TIMEOUT * len(parts)


def mirrored_results(request, tmp_path_factory,
                     fixture: str = "mirrored") -> dict:
  """The results of the requesting file's `MIRRORED_CASES`: {case: JSON}.

  They come from one process on 2 logical CPUs (`MIRRORED_TWO_CPUS`) that
  runs the `MIRRORED_CASES` of every collected file with a selected test
  using `fixture` (its module-scoped fixture calling this), once per test
  run (`run_once`).

  Raises:
    AssertionError: the process failed, or one file's cases took over
      `_PART_TIMEOUT` seconds (then its stderr's tail holds every thread's
      stack); the tail names the file whose cases were running.
  """
  parts = _parts(request, "MIRRORED_CASES", fixture)
  out = run_once(tmp_path_factory, run_script,
                 _driver(MIRRORED_TWO_CPUS, parts), timeout=_timeout(parts))
  return out[request.module.__name__]


def multi_worker_results(
    request, tmp_path_factory,
    fixture: str = "multi_worker_cluster") -> List[dict]:
  """The results of the requesting file's `MULTI_WORKER_CASES`, one
  {case: JSON} per worker, in index order.

  They come from one cluster of two worker processes (`run_workers`, a
  `MultiWorkerMirroredStrategy` over both) that runs the
  `MULTI_WORKER_CASES` of every collected file with a selected test using
  `fixture`, in the same order on both workers, once per test run.

  Raises:
    AssertionError: a worker failed or timed out (as in `mirrored_results`).
  """
  parts = _parts(request, "MULTI_WORKER_CASES", fixture)
  out = run_once(tmp_path_factory, run_workers, _driver(_MWMS, parts),
                 timeout=_timeout(parts))
  return [worker[request.module.__name__] for worker in out]
