"""Running tf.distribute test scripts in fresh Python processes.

Logical devices and `TF_CONFIG` must be set before TensorFlow initialises, so
the distribute tests run their cases as `python -c SCRIPT` subprocesses that
print one `RESULT <json>` line. `run_script` runs one such process (e.g. a
MirroredStrategy over 2 logical CPUs); `run_workers` starts a
MultiWorkerMirroredStrategy cluster of worker processes on 127.0.0.1, one
`TF_CONFIG` each, and collects their results. Not a test file itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import List

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Script lines (after `import tensorflow as tf`, before TF initialises):
# two logical CPUs and a MirroredStrategy over them, bound to `strategy`.
MIRRORED_TWO_CPUS = """\
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
"""


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
