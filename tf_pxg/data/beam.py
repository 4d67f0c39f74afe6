"""Poisson sampling of data beyond memory, as an Apache Beam pipeline.

`pip install tf_pxg[beam]`. The pipeline (after Chua et al., "Scalable
DP-SGD: Shuffling vs. Poisson Subsampling", NeurIPS 2024) runs on any Beam
runner: the DirectRunner locally and in tests, Dataflow, Flink or Spark on
a cluster, unchanged:

1. **Draw the joins per example.** For E epochs of T = ceil(N / B) logical
   steps (global step s = e T + t), every example joins each step
   independently with probability q = B / N. Its joins are drawn as
   geometric skips over the E T steps (`tf_pxg.data.poisson`: the gaps of a
   Bernoulli(q) process are i.i.d. Geometric(q)), so the work is
   O(1 + number of joins), about E per example. Across examples the draws
   are independent (each example has its own random stream), so for every
   step the set of examples that joined it is exactly a Poisson sample,
   independent across steps: the law of `PoissonSampler`.
2. **Group by step.** Joins are keyed by shard (a range of
   `steps_per_shard` consecutive steps) and grouped.
3. **Write step-ordered TFRecord shards.** Each step's examples (sorted by
   a hash of the example, so the output is deterministic) are laid out by
   `tf_pxg.data.poisson.layout` into `m = max(k, ceil(n / P))` physical
   batches of P rows with masks: overflow is carried into extra physical
   batches of the same step, never dropped, so the mechanism is exactly the
   Poisson-subsampled Gaussian mechanism and needs no extra δ (the
   released model depends on a step's sample only through the sum of its
   clipped gradients; how the sample is cut into physical batches only
   orders that sum). A step no example joined is written as k all-padding
   batches. Padding rows repeat one fixed input record (the one with the
   smallest hash), masked out. Rows are split into R replica files.
4. **Manifest last**: `manifest.json` (sizes, per-shard batch counts).

Cyclic Poisson sampling (`PoissonConfig(min_separation=b, group_seed=s)`,
for BandMF; the in-memory `PoissonSampler(min_separation=b, group_seed=s)`
explains it): global step s samples only group `s mod b`, at rate
`q = B b / N`. The partition is the independent one, as in memory, keyed
by the same kind of secret `group_seed` (required for b > 1, drawn once
per training run from OS entropy, e.g. `secrets.randbits(62)`, and reused
by every pipeline run that feeds the same training run): records have no
index here, so a record's group is a keyed hash of its id,
`BLAKE2b(id, key=group_seed as 8 little-endian bytes,
person="tf_pxg.group", 8-byte digest)` read as a little-endian integer mod
b (`example_group`; uniform up to a bias below b / 2^64). Given the secret
seed the groups of distinct ids are i.i.d. uniform on `range(b)`, each
depending on nothing but its own record, so adding or removing a record
moves no one else (add/remove adjacency) and the group sizes are
Binomial(N, 1/b), as in memory (the two paths assign different groups: one
keys positions, the other ids). The groups do not depend on `seed` or
`secure_mode`, which only drive the joins. A record of group g draws its
joins by geometric skips over the steps `g, g + b, g + 2b, ...` only, so
its participations are multiples of b steps apart. T defaults to
`b ceil(N / (B b))` (whole cycles); b = 1 is the plain pipeline, byte for
byte, and needs no group seed.

Randomness: with `seed`, example x's joins are a function of
`(seed, id(x))`, `id(x)` a BLAKE2b hash of the example's key (elements
given as `(key, record)`) or of its bytes: the output is byte-identical on
every runner. Two identical records without keys would then always join
the same steps; the writer raises if it finds such duplicates in a step.
Without a seed, one is drawn from OS entropy when the transform is built
(recorded as null in the manifest). `secure_mode=True` draws every
uniform from `os.urandom` (not reproducible; a seed raises).

Read the shards with `tf_pxg.data.PoissonShards(output_dir).dataset(
parse_fn)`. Command line: `python -m tf_pxg.data.beam --help`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import struct
from typing import Optional

try:
  import apache_beam as beam
  from apache_beam.io.filesystems import FileSystems
  from apache_beam.io.tfrecordio import _TFRecordUtil
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      "tf_pxg.data.beam needs Apache Beam: pip install 'tf_pxg[beam]' (or "
      "pip install apache-beam).") from e

import numpy as np

from tf_pxg import _renamed
from tf_pxg.data import poisson
from tf_pxg.data import shards


class PoissonConfig:
  """Sizes of a Beam Poisson run; N is counted by the pipeline.

  Args:
    expected_batch_size: B (q = B / N).
    epochs: E.
    steps_per_epoch: T; default ceil(N / B).
    physical_batch_size: P; default `default_physical_batch_size(B, k, R)`.
    accumulation_steps: k.
    num_replicas: R (files per shard; the reader's replica count).
    steps_per_shard: logical steps per shard file (a shard's records are
      grouped on one worker: about `steps_per_shard * B` records).
    seed: a non-negative int, or None for OS entropy.
    secure_mode: every uniform from `os.urandom`; excludes `seed`.
    min_separation: b >= 1, cyclic Poisson sampling (module docstring);
      checked against N (`b <= floor(N / B)`) when the pipeline has counted
      N. `num_groups=` is its deprecated name.
    group_seed: required for b > 1: the secret key of the records' group
      assignment, an int in `[0, 2^64)` drawn once per training run
      (module docstring). Ignored for b = 1.

  Raises:
    ValueError: invalid values (named); `seed` with `secure_mode`; b > 1
      without `group_seed`.
  """

  def __init__(self, expected_batch_size: float, epochs: int = 1,
               steps_per_epoch: Optional[int] = None,
               physical_batch_size: Optional[int] = None,
               accumulation_steps: int = 1, num_replicas: int = 1,
               steps_per_shard: int = 100, seed: Optional[int] = None,
               secure_mode: bool = False, min_separation: int = 1,
               group_seed: Optional[int] = None,
               num_groups: Optional[int] = _renamed.NOT_GIVEN):
    min_separation, self._separation_name = _renamed.argument(
        min_separation, num_groups, new="min_separation", old="num_groups",
        where="PoissonConfig", default=1)
    poisson._check_positive(expected_batch_size, "expected_batch_size")
    for value, name in ((epochs, "epochs"),
                        (accumulation_steps, "accumulation_steps"),
                        (num_replicas, "num_replicas"),
                        (steps_per_shard, "steps_per_shard"),
                        (min_separation, self._separation_name)):
      poisson._check_positive_int(value, name)
    if steps_per_epoch is not None:
      poisson._check_positive_int(steps_per_epoch, "steps_per_epoch")
    if physical_batch_size is None:
      physical_batch_size = poisson.default_physical_batch_size(
          expected_batch_size, accumulation_steps, num_replicas)
    poisson._check_positive_int(physical_batch_size, "physical_batch_size")
    if physical_batch_size % num_replicas:
      raise ValueError(
          f"physical_batch_size={physical_batch_size} must be a multiple of "
          f"num_replicas={num_replicas}.")
    self.expected_batch_size = float(expected_batch_size)
    self.epochs = int(epochs)
    self.steps_per_epoch = steps_per_epoch
    self.physical_batch_size = int(physical_batch_size)
    self.accumulation_steps = int(accumulation_steps)
    self.num_replicas = int(num_replicas)
    self.steps_per_shard = int(steps_per_shard)
    self.min_separation = int(min_separation)
    self.group_seed = poisson.check_group_seed(
        group_seed, self.min_separation, self._separation_name)
    self.secure_mode = bool(secure_mode)
    self.seed_given = seed is not None
    self.seed = poisson.resolve_seed(seed, self.secure_mode)

  num_groups = _renamed.alias("num_groups", "min_separation")

  def sizes(self, n: int):
    """`(q, T, total steps, number of shards)` for N = `n`.

    q = B b / N with b = `min_separation`.

    Raises:
      ValueError: B > N, no records, or b > floor(N / B).
    """
    if n < 1 or self.expected_batch_size > n:
      raise ValueError(
          f"expected_batch_size={self.expected_batch_size} with {n} input "
          "records: need 0 < B <= N.")
    b = poisson.check_min_separation(self.min_separation, n,
                                     self.expected_batch_size,
                                     self._separation_name)
    t = self.steps_per_epoch or poisson.default_steps_per_epoch(
        n, self.expected_batch_size, b)
    total = self.epochs * t
    return (self.expected_batch_size * b / n, t, total,
            -(-total // self.steps_per_shard))


def example_id(element) -> tuple:
  """`(16-byte id, record bytes)` of a record or a `(key, record)` pair."""
  if isinstance(element, tuple):
    key, record = element
    key = key if isinstance(key, bytes) else repr(key).encode()
    tag = b"k"
  else:
    key, record, tag = element, element, b"r"
  return hashlib.blake2b(tag + key, digest_size=16).digest(), record


def example_group(uid: bytes, min_separation: int,
                  group_seed: Optional[int]) -> int:
  """The cyclic-sampling group of example `uid`, uniform on `range(b)`.

  BLAKE2b of `uid` keyed by `group_seed` (8 little-endian bytes),
  personalised "tf_pxg.group" (so independent of the joins' stream), 8-byte
  digest as a little-endian integer, mod b. Always 0 for b = 1.

  Raises:
    ValueError: b > 1 without a valid `group_seed`.
  """
  if min_separation == 1:
    return 0
  group_seed = poisson.check_group_seed(group_seed, min_separation)
  raw = hashlib.blake2b(uid, key=group_seed.to_bytes(8, "little"),
                        person=b"tf_pxg.group", digest_size=8).digest()
  return int.from_bytes(raw, "little") % min_separation


def joined_steps(uid: bytes, total_steps: int, q: float,
                 seed: Optional[int], min_separation: int = 1,
                 group: int = 0) -> list:
  """The global steps in `[0, total_steps)` that example `uid` joins.

  Geometric skips (each step independently with probability q); uniforms
  on (0, 1] from BLAKE2b keyed by `seed` over `(uid, counter)`, or from
  `os.urandom` when `seed` is None. O(1 + joins). With `min_separation` b the
  skips run over the steps `group, group + b, ...` only (cyclic sampling).
  """
  b, g = int(min_separation), int(group)
  if b > 1:
    count = (total_steps - g + b - 1) // b if total_steps > g else 0
    return [g + b * k for k in joined_steps(uid, count, q, seed)]
  if q >= 1.0:
    return list(range(total_steps))
  log1mq = math.log1p(-q)
  key = None if seed is None else seed.to_bytes(8, "little")
  counter, buf, steps, pos = 0, [], [], -1
  while True:
    if not buf:
      if key is None:
        raw = os.urandom(64)
      else:
        raw = hashlib.blake2b(uid + counter.to_bytes(8, "little"),
                              key=key, digest_size=64).digest()
        counter += 1
      buf = [((w >> 11) + 1) * 2.0 ** -53
             for w in struct.unpack("<8Q", raw)]
    u = buf.pop()
    pos += int(min(math.floor(math.log(u) / log1mq), total_steps)) + 1
    if pos >= total_steps:
      return steps
    steps.append(pos)


class _DrawJoins(beam.DoFn):
  """(uid, record) -> (shard, (step, uid, record)) for every join."""

  def __init__(self, config: PoissonConfig):
    self._config = config

  def process(self, keyed, n):
    uid, record = keyed
    c = self._config
    q, _, total, _ = c.sizes(n)
    group = example_group(uid, c.min_separation, c.group_seed)
    for step in joined_steps(uid, total, q, c.seed, c.min_separation,
                             group):
      yield step // self._config.steps_per_shard, (step, uid, record)


def _example_proto(records, mask, step, step_end):
  from tensorflow.core.example import example_pb2  # noqa: PLC0415
  ex = example_pb2.Example()
  feat = ex.features.feature
  feat[shards.RECORDS].bytes_list.value.extend(records)
  feat[shards.MASK].float_list.value.extend(mask)
  feat[shards.STEP].int64_list.value.append(step)
  feat[shards.STEP_END].int64_list.value.append(int(step_end))
  return ex.SerializeToString()


class _WriteShard(beam.DoFn):
  """Writes one shard's R replica files; yields (shard, physical batches)."""

  def __init__(self, config: PoissonConfig, output_dir: str):
    self._config = config
    self._output_dir = output_dir

  def process(self, grouped, n, pad):
    shard, items = grouped
    c = self._config
    _, _, total, num_shards = c.sizes(n)
    by_step = {}
    for item in items:
      if item is not None:
        step, uid, record = item
        by_step.setdefault(step, []).append((uid, record))
    p, r = c.physical_batch_size, c.num_replicas
    rows = p // r
    pad_record = pad[0][1]
    files = [FileSystems.create(os.path.join(
        self._output_dir, shards.shard_file_name(shard, num_shards, i, r)))
             for i in range(r)]
    count = 0
    try:
      first = shard * c.steps_per_shard
      for step in range(first, min(first + c.steps_per_shard, total)):
        members = sorted(by_step.get(step, ()), key=lambda m: m[0])
        for a, b in zip(members, members[1:]):
          if a[0] == b[0]:
            raise ValueError(
                f"Two identical input records (or keys) joined step {step}: "
                "with a seed, identical records get identical draws, which "
                "breaks independence across examples. Give each record a "
                "unique key (elements (key, record)) or deduplicate.")
        for batch in poisson.layout(np.arange(len(members)), p,
                                    c.accumulation_steps, r):
          recs = [members[i][1] if m else pad_record
                  for i, m in zip(batch.indices, batch.mask)]
          for i in range(r):
            part = slice(i * rows, (i + 1) * rows)
            _TFRecordUtil.write_record(files[i], _example_proto(
                recs[part], batch.mask[part].tolist(), step,
                batch.step_end))
          count += 1
    finally:
      for f in files:
        f.close()
    yield shard, count


def _write_manifest(counts, n, config: PoissonConfig, output_dir: str):
  q, t, total, num_shards = config.sizes(n)
  per_shard = dict(counts)
  if sorted(per_shard) != list(range(num_shards)):
    raise RuntimeError(f"Shards written: {sorted(per_shard)}; expected "
                       f"0..{num_shards - 1}.")
  manifest = {
      "num_examples": n, "expected_batch_size": config.expected_batch_size,
      "sampling_rate": q,
      shards.PoissonShards.MANIFEST_MIN_SEPARATION: config.min_separation,
      "steps_per_epoch": t, "epochs": config.epochs,
      "total_steps": total,
      "physical_batch_size": config.physical_batch_size,
      "accumulation_steps": config.accumulation_steps,
      "num_replicas": config.num_replicas, "num_shards": num_shards,
      "steps_per_shard": config.steps_per_shard,
      "physical_batches": [per_shard[s] for s in range(num_shards)],
      "seed": config.seed if config.seed_given else None,
      "group_seed": config.group_seed,
      "secure_mode": config.secure_mode,
  }
  with FileSystems.create(os.path.join(output_dir, shards.MANIFEST)) as f:
    f.write(json.dumps(manifest, indent=1).encode())
  return manifest


class WritePoissonShards(beam.PTransform):
  """PCollection of records -> Poisson-sampled step-ordered TFRecord shards.

  Input elements: `bytes` (one serialized example each, e.g. from
  `beam.io.ReadFromTFRecord`) or `(key, bytes)` with unique keys. Output:
  a PCollection holding the manifest dict, written last to
  `output_dir/manifest.json` (see `tf_pxg.data.shards` for the files).

  Args:
    output_dir: where to write (local or any Beam filesystem, e.g. gs://).
    config: a `PoissonConfig`.
  """

  def __init__(self, output_dir: str, config: PoissonConfig):
    super().__init__()
    self._output_dir = output_dir
    self._config = config

  def expand(self, records):
    c, out = self._config, self._output_dir
    keyed = records | "Id" >> beam.Map(example_id)
    n = beam.pvalue.AsSingleton(
        keyed | "Count" >> beam.combiners.Count.Globally())
    pad = beam.pvalue.AsSingleton(
        keyed | "Pad" >> beam.combiners.Top.Smallest(1))
    joins = keyed | "DrawJoins" >> beam.ParDo(_DrawJoins(c), n=n)
    every_shard = (
        records.pipeline | "One" >> beam.Create([None])
        | "Shards" >> beam.FlatMap(
            lambda _, n: [(s, None) for s in range(c.sizes(n)[3])], n=n))
    counts = (
        (joins, every_shard) | "Flatten" >> beam.Flatten()
        | "GroupByShard" >> beam.GroupByKey()
        | "Write" >> beam.ParDo(_WriteShard(c, out), n=n, pad=pad))
    return (counts | "Counts" >> beam.combiners.ToList()
            | "Manifest" >> beam.Map(_write_manifest, n=n, config=c,
                                     output_dir=out))


def run(input_pattern: str, output_dir: str, config: PoissonConfig,
        pipeline_options=None):
  """Reads TFRecord files `input_pattern`, writes shards; blocks until done."""
  with beam.Pipeline(options=pipeline_options) as p:
    _ = (p | "Read" >> beam.io.ReadFromTFRecord(input_pattern)
         | "Poisson" >> WritePoissonShards(output_dir, config))


def main(argv=None):
  """`python -m tf_pxg.data.beam --input=... --output=... --batch_size=...`.

  Unknown flags go to Beam (`--runner=DataflowRunner --project=...`).
  """
  from apache_beam.options.pipeline_options import PipelineOptions  # noqa
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--input", required=True,
                      help="TFRecord file pattern of serialized examples")
  parser.add_argument("--output", required=True, help="output directory")
  parser.add_argument("--batch_size", type=float, required=True,
                      help="expected logical batch size B")
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--steps_per_epoch", type=int, default=None)
  parser.add_argument("--physical_batch_size", type=int, default=None)
  parser.add_argument("--accumulation_steps", type=int, default=1)
  parser.add_argument("--num_replicas", type=int, default=1)
  parser.add_argument("--steps_per_shard", type=int, default=100)
  parser.add_argument("--seed", type=int, default=None)
  parser.add_argument("--secure_mode", action="store_true")
  parser.add_argument("--min_separation", type=int, default=None,
                      help="b of cyclic Poisson sampling (BandMF, BLT): "
                      "each record joins only every b-th step of its "
                      "group; q = B * b / N (default 1)")
  parser.add_argument("--num_groups", type=int, default=None,
                      help="deprecated name of --min_separation")
  parser.add_argument("--group_seed", type=int, default=None,
                      help="required with --min_separation > 1: the secret "
                      "key "
                      "of the records' group assignment, drawn once per "
                      "training run (e.g. secrets.randbits(62)) and reused "
                      "by every pipeline run of it")
  args, beam_args = parser.parse_known_args(argv)
  config = PoissonConfig(
      args.batch_size, epochs=args.epochs,
      steps_per_epoch=args.steps_per_epoch,
      physical_batch_size=args.physical_batch_size,
      accumulation_steps=args.accumulation_steps,
      num_replicas=args.num_replicas, steps_per_shard=args.steps_per_shard,
      seed=args.seed, secure_mode=args.secure_mode,
      min_separation=1 if args.min_separation is None else
      args.min_separation, group_seed=args.group_seed,
      **({} if args.num_groups is None else
         {"num_groups": args.num_groups}))
  run(args.input, args.output, config, PipelineOptions(beam_args))


if __name__ == "__main__":
  main()


__all__ = ["PoissonConfig", "WritePoissonShards", "example_group",
           "example_id", "joined_steps", "main", "run"]
