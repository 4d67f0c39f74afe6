"""dp_digits' model trained with MultiWorkerMirroredStrategy on 2 local workers.

    python examples/dp_digits_multiworker.py                # launches 2 workers
    python examples/dp_digits_multiworker.py --epochs=5

Without `--task_index` the script starts `--num_workers` copies of itself on
127.0.0.1 (free ports, one `TF_CONFIG` each, CPU only) and relays their
output; each copy is one worker of a `MultiWorkerMirroredStrategy`. The
model, data split, DP settings and flags are those of `dp_digits.py`; the
final line is `final: test_accuracy=... epsilon=... delta=...`, printed by
worker 0, followed by a check that all workers hold identical weights.

Why a custom loop: Keras 3's `fit` fails under a multi-worker
MultiWorkerMirroredStrategy before the first step, for any model
(keras-team/keras#20585, tensorflow/tensorflow#72388). The loop runs the DP
model's own `train_step` in `strategy.run`, so clipping, noise (std
`sigma C / sqrt(R)` per replica, `sigma C` in total), Poisson masks and the
logical step are exactly those of `fit`.

Sampling: every worker builds the same Poisson stream (`tf_pxg.data`) from a
seed that worker 0 draws from OS entropy and broadcasts with an all-reduce;
`tf_pxg.data.for_input_pipeline` gives each worker its replicas' slices of
each global batch. So each logical step is one Poisson sample of the whole
training set, split across workers.

On a real cluster: start one copy per machine with `--task_index=i` and a
`TF_CONFIG` naming all workers (see the TensorFlow multi-worker guide), the
training arrays available on every worker (each builds the same global
batches from the broadcast seed and keeps its slices), and the ports open
between the machines. Nothing else changes. With several devices per worker,
`for_input_pipeline` gives each worker's pipeline its local replicas'
slices in order.
"""

import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dp_digits  # noqa: E402  (its flags and model)

from tf_pxg import accounting  # noqa: E402
from tf_pxg import data as dp_data  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402

_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2,
                                    "Local worker processes to launch.")
_TASK_INDEX = flags.DEFINE_integer(
    "task_index", -1, "This worker's index (set by the launcher, or by you "
    "on a real cluster together with TF_CONFIG); -1 launches the workers.")


def _free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


def launch():
  """Starts the workers on 127.0.0.1 (same flags) and relays their output."""
  ports = _free_ports(_NUM_WORKERS.value)
  cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
  procs = []
  for index in range(_NUM_WORKERS.value):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1",
               TF_CONFIG=json.dumps({"cluster": cluster, "task": {
                   "type": "worker", "index": index}}))
    procs.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), f"--task_index={index}"]
        + sys.argv[1:], env=env, stdout=subprocess.PIPE, text=True))
  outputs = [p.communicate()[0] for p in procs]
  for index, out in enumerate(outputs):
    for line in out.splitlines():
      print(f"[worker {index}] {line}" if index else line, flush=True)
  codes = [p.returncode for p in procs]
  if any(codes):
    raise SystemExit(f"worker exit codes: {codes}")


def shared_seed(strategy) -> int:
  """An OS-entropy seed drawn by worker 0 and broadcast to all workers."""
  is_chief = strategy.cluster_resolver.task_id == 0
  mine = int(np.random.SeedSequence().entropy % 2**31) if is_chief else 0

  @tf.function
  def broadcast():
    return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, tf.constant(mine, tf.int64)))

  return int(strategy.experimental_local_results(broadcast())[0])


def train(strategy):
  keras.utils.set_random_seed(dp_digits._SEED.value)
  x_train, x_test, y_train, y_test = dp_digits.load_data(dp_digits._SEED.value)
  n, batch = len(x_train), dp_digits._BATCH_SIZE.value
  epochs = dp_digits._EPOCHS.value
  sampler = dp_data.PoissonSampler(
      n, batch, num_replicas=strategy.num_replicas_in_sync,
      seed=shared_seed(strategy))
  noise = dp_digits._NOISE_MULTIPLIER.value
  if noise is None:
    noise = accounting.noise_multiplier_for_epsilon(
        dp_digits._TARGET_EPSILON.value, n, batch,
        steps=epochs * sampler.steps_per_epoch, delta=dp_digits._DELTA.value)
  with strategy.scope():
    model = dpk.DPSequential(dp_digits.cnn_layers(),
                             l2_norm_clip=dp_digits._L2_NORM_CLIP.value,
                             noise_multiplier=noise)
    model.compile(
        optimizer=keras.optimizers.Adam(dp_digits._LEARNING_RATE.value),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    model.build_accumulator()

  dataset = strategy.distribute_datasets_from_function(
      lambda ctx: dp_data.for_input_pipeline(
          dp_data.poisson_dataset(sampler, x_train, y_train), ctx))

  @tf.function
  def step(batch):
    strategy.run(model.train_step, args=(batch,))

  chief = strategy.cluster_resolver.task_id == 0
  if chief:
    print(f"DP-SGD on {strategy.num_replicas_in_sync} replicas: "
          f"noise_multiplier={noise:.4f} batch_size={batch} "
          f"physical_batch_size={sampler.physical_batch_size} "
          f"train_examples={n}", flush=True)
  for epoch in range(epochs):
    for physical_batch in dataset:  # one epoch of whole logical steps
      step(physical_batch)
    steps = int(model.optimizer.iterations.numpy())
    eps = accounting.compute_epsilon(n, batch, noise, steps=steps,
                                     delta=dp_digits._DELTA.value)
    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    if chief:
      print(f"epoch {epoch + 1}: test_accuracy={accuracy:.4f} "
            f"epsilon={eps:.3f}", flush=True)
  if chief:
    print(f"final: test_accuracy={accuracy:.4f} epsilon={eps:.3f} "
          f"delta={dp_digits._DELTA.value:g}", flush=True)
  checksum = float(sum(np.abs(v.numpy()).sum()
                       for v in model.trainable_variables))
  print(f"weights_checksum={checksum:.8e} steps={steps}", flush=True)


def main(argv):
  del argv
  if _TASK_INDEX.value < 0:
    launch()
    return
  if dp_digits._NODP.value:
    raise app.UsageError("--nodp is not supported here; see dp_digits.py.")
  train(tf.distribute.MultiWorkerMirroredStrategy())


if __name__ == "__main__":
  app.run(main)
