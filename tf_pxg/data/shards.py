"""Reading Poisson-sampled TFRecord shards (written by `tf_pxg.data.beam`).

No Apache Beam needed here: the shards are plain TFRecord files and a
`manifest.json`, read with `tf.data`.

Layout written by the pipeline (`output_dir`):

- `manifest.json`: `num_examples` N, `expected_batch_size` B,
  `sampling_rate` q (`B b / N`), `num_groups`: b, the `min_separation` of
  cyclic sampling (the file keeps the key it was first written with; 1
  for manifests written before cyclic sampling existed), `steps_per_epoch` T, `epochs` E,
  `physical_batch_size` P, `accumulation_steps` k, `num_replicas` R,
  `num_shards`, `steps_per_shard`, `physical_batches` (per shard), the
  seed (null if drawn from OS entropy), `group_seed` (the secret key of
  cyclic sampling's group assignment; null for b = 1 and for older
  manifests), and the file names. The manifest is as private as the
  shards (which already say which record joined which step).
- `poisson-SSSSS-of-TTTTT-replica-RRR-of-QQQ.tfrecord`: shard S holds the
  logical steps `[S * steps_per_shard, (S + 1) * steps_per_shard)` (global
  step = epoch * T + step in epoch), in step order; replica file r holds
  rows `[r P/R, (r + 1) P/R)` of each of their physical batches. Each record
  is a `tf.train.Example` with `dp/records` (bytes, P/R serialized input
  records; padding rows repeat one fixed record), `dp/mask` (float, P/R,
  1 real, 0 padding), `dp/step` and `dp/step_end` (int64).

`PoissonShards(output_dir).dataset(parse_fn)` gives the `(x, y, info)`
stream of `tf_pxg.data.poisson_dataset`, the same physical batches in the
same order, for custom loops (`model.train_step`) and, through
`for_input_pipeline`-style sharding (`input_context=`), for
`MultiWorkerMirroredStrategy` and TPUs: each input pipeline reads only its
replicas' files.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import tensorflow as tf

from tf_pxg.data import batch_info
from tf_pxg.data import participation
from tf_pxg.data import protocol
from tf_pxg.data.sampling_ops import as_written

MANIFEST = "manifest.json"
RECORDS = "dp/records"
MASK = "dp/mask"
STEP = "dp/step"
STEP_END = "dp/step_end"


def shard_file_name(shard: int, num_shards: int, replica: int,
                    num_replicas: int) -> str:
  return (f"poisson-{shard:05d}-of-{num_shards:05d}-replica-"
          f"{replica:03d}-of-{num_replicas:03d}.tfrecord")


class PoissonShards(protocol.Sampler):
  """The shards of one pipeline run, and their `tf.data` stream.

  Args:
    output_dir: the pipeline's output directory (any path `tf.io.gfile`
      reads: local, `gs://`, ...).
    parse_fn: optional default for `dataset(parse_fn)`; needed to pass the
      shards to a DP model's `fit` (`model.fit(PoissonShards(dir, parse),
      epochs=E)`, E at most the pipeline's epochs).

  Attributes: those of the manifest (`num_examples`, `expected_batch_size`,
  `sampling_rate`, `min_separation` (the manifest's `num_groups`),
  `group_seed`, `steps_per_epoch`, `epochs`,
  `physical_batch_size`, `accumulation_steps`, `num_replicas`,
  `num_shards`, `physical_batches`).

  Raises:
    ValueError: no manifest (the pipeline did not finish) in `output_dir`.
  """
  # The `tf_pxg.data.samplers.Sampler` protocol (the event: `dp_event`):
  # (cyclic) Poisson sampling, b from the manifest.
  schema = participation.Participation.poisson(min_separation=None)
  #: The manifest's key of `min_separation` (kept for the files written).
  MANIFEST_MIN_SEPARATION = "num_groups"

  def __init__(self, output_dir: str, parse_fn: Optional[Callable] = None):
    path = os.path.join(output_dir, MANIFEST)
    if not tf.io.gfile.exists(path):
      raise ValueError(
          f"No {MANIFEST} in {output_dir!r}: not the output of a finished "
          "tf_pxg.data.beam pipeline (the manifest is written last).")
    with tf.io.gfile.GFile(path) as f:
      self.manifest = json.load(f)
    self.output_dir = output_dir
    self.parse_fn = parse_fn
    self.min_separation = 1  # manifests from before cyclic sampling
    self.group_seed = None
    for key, value in self.manifest.items():
      if key == self.MANIFEST_MIN_SEPARATION:
        key, value = "min_separation", int(value)
      setattr(self, key, value)

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """The event of `steps` steps of these shards' (cyclic) Poisson sampling
    composed with `mechanism`: `PoissonSampler.dp_event`'s, at the
    manifest's `sampling_rate` and `min_separation`.

    Raises:
      ValueError: the mechanism needs another participation
        (`tf_pxg.data.participation.check`).
    """
    from tf_pxg import accounting  # noqa: PLC0415
    participation.check(self, mechanism, "PoissonShards.dp_event")
    return accounting.cyclic_poisson_event(
        mechanism, float(self.sampling_rate), self.min_separation,
        noise_multiplier, steps)

  def files(self, replica: int, first_shard: int = 0) -> list:
    """Replica `replica`'s shard files from `first_shard`, in step order."""
    return [os.path.join(self.output_dir, shard_file_name(
        s, self.num_shards, replica, self.num_replicas))
            for s in range(first_shard, self.num_shards)]

  def _replica_dataset(self, replica, parse_fn, start_step=0):
    rows = self.physical_batch_size // self.num_replicas
    spec = {RECORDS: tf.io.FixedLenFeature([rows], tf.string),
            MASK: tf.io.FixedLenFeature([rows], tf.float32),
            STEP: tf.io.FixedLenFeature([], tf.int64),
            STEP_END: tf.io.FixedLenFeature([], tf.int64)}
    normalizer = float(self.expected_batch_size)

    def parse(f):
      x, y = parse_fn(f[RECORDS])
      info = batch_info.BatchInfo(f[MASK], tf.not_equal(f[STEP_END], 0),
                                  normalizer)
      return x, y, info.to_element()

    first = start_step // self.steps_per_shard
    if first >= self.num_shards:
      raise ValueError(f"start_step={start_step}: the shards hold steps "
                       f"0..{self.total_steps - 1}.")
    ds = tf.data.TFRecordDataset(self.files(replica, first)).map(
        as_written(lambda r: tf.io.parse_single_example(r, spec)))
    if start_step % self.steps_per_shard:
      ds = ds.filter(as_written(lambda f: f[STEP] >= start_step))
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE,
                  deterministic=True)

  def dataset(self, parse_fn: Optional[Callable] = None,
              input_context: Optional[tf.distribute.InputContext] = None,
              start_step: int = 0) -> tf.data.Dataset:
    """The stream of `(x, y, info)` physical batches, in step order.

    Args:
      parse_fn: maps a `[rows]` tf.string tensor of serialized input
        records to `(x, y)` with leading dimension `rows` (e.g. with
        `tf.io.parse_example`).
      input_context: None: global batches of P rows (one process, or
        Keras/`experimental_distribute_dataset` splitting them over
        replicas; the rows are laid out by replica). Given (from
        `strategy.distribute_datasets_from_function`): this input
        pipeline's replicas' slices of each global batch, P/R rows each,
        in the order the strategy hands them to its local replicas; only
        those replicas' files are read.
      start_step: the first global logical step to read (to resume); the
        files before its shard are not opened.

    Raises:
      ValueError: no `parse_fn` here or at construction.
      ValueError: `input_context` with a replica count other than the
        pipeline's R, or not divisible by the pipeline count.
    """
    parse_fn = parse_fn or self.parse_fn
    if parse_fn is None:
      raise ValueError("PoissonShards.dataset needs parse_fn (records -> "
                       "(x, y)), here or in the constructor.")
    r = self.num_replicas
    if input_context is None:
      parts = [self._replica_dataset(i, parse_fn, start_step)
               for i in range(r)]
      if r == 1:
        return parts[0].prefetch(tf.data.AUTOTUNE)
      return tf.data.Dataset.zip(tuple(parts)).map(as_written(
          lambda *slices: tf.nest.map_structure(
              lambda *t: tf.concat(t, 0), *slices))).prefetch(
                  tf.data.AUTOTUNE)
    if input_context.num_replicas_in_sync != r:
      raise ValueError(
          f"The shards were laid out for {r} replicas; this strategy has "
          f"{input_context.num_replicas_in_sync}. Rerun the pipeline with "
          f"num_replicas={input_context.num_replicas_in_sync}.")
    w = input_context.num_input_pipelines
    if r % w:
      raise ValueError(f"{r} replicas cannot be split evenly over {w} input "
                       "pipelines.")
    local = r // w
    first = input_context.input_pipeline_id * local
    parts = [self._replica_dataset(first + j, parse_fn, start_step)
             for j in range(local)]
    if local == 1:
      return parts[0].prefetch(tf.data.AUTOTUNE)
    order = tf.data.Dataset.range(local).repeat()
    return tf.data.Dataset.choose_from_datasets(
        parts, order, stop_on_empty_dataset=True).prefetch(tf.data.AUTOTUNE)


__all__ = ["MANIFEST", "PoissonShards", "shard_file_name"]
