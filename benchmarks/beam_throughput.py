"""Throughput of the Beam Poisson pipeline (`tf_pxg.data.beam`), DirectRunner.

    python benchmarks/beam_throughput.py                        # 1e6 records
    python benchmarks/beam_throughput.py --records=100000 --direct_num_workers=2

Synthetic records of `--record_bytes` bytes (a serialized tf.train.Example
with an int64 id and a bytes payload) are created in the pipeline
(`beam.Create` of ids, then a Map), run through `WritePoissonShards` with
B = `--batch_size`, E = `--epochs`, and written to a temporary directory.
Prints wall time, input records per second and joins (written rows) per
second, and the estimate of one epoch of N = 1e9 records at that rate on
one DirectRunner process (a cluster divides it by its worker count, less
the shuffle's overhead).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Replace this script's directory (whose profile.py would shadow the
# standard library's, which Beam imports) by the repository root.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import apache_beam as beam  # noqa: E402
from apache_beam.options.pipeline_options import PipelineOptions  # noqa: E402

from tf_pxg.data import beam as dp_beam  # noqa: E402
from tf_pxg.data import shards  # noqa: E402


def _record(i, size):
  from tensorflow.core.example import example_pb2  # noqa: PLC0415
  ex = example_pb2.Example()
  ex.features.feature["id"].int64_list.value.append(i)
  ex.features.feature["x"].bytes_list.value.append(
      i.to_bytes(8, "little") * max(1, size // 8))
  return ex.SerializeToString()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--records", type=int, default=1_000_000)
  parser.add_argument("--record_bytes", type=int, default=16)
  parser.add_argument("--batch_size", type=float, default=1024)
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--steps_per_shard", type=int, default=100)
  parser.add_argument("--direct_num_workers", type=int, default=1)
  args = parser.parse_args()
  out = tempfile.mkdtemp(prefix="beam_poisson_")
  options = PipelineOptions(
      runner="DirectRunner", direct_num_workers=args.direct_num_workers,
      direct_running_mode=("multi_processing" if args.direct_num_workers > 1
                           else "in_memory"))
  config = dp_beam.PoissonConfig(args.batch_size, epochs=args.epochs,
                                 steps_per_shard=args.steps_per_shard,
                                 seed=0)
  size = args.record_bytes
  start = time.perf_counter()
  with beam.Pipeline(options=options) as p:
    _ = (p | beam.Create(range(args.records))
         | beam.Map(_record, size)
         | dp_beam.WritePoissonShards(out, config))
  seconds = time.perf_counter() - start
  manifest = shards.PoissonShards(out).manifest
  rows = sum(manifest["physical_batches"]) * manifest["physical_batch_size"]
  joins = args.records * args.epochs  # expected: E joins per example
  print(f"records={args.records} record_bytes~{len(_record(1, size))} "
        f"B={args.batch_size:g} epochs={args.epochs} "
        f"workers={args.direct_num_workers}")
  print(f"wall={seconds:.1f}s records/s={args.records / seconds:,.0f} "
        f"joins/s~{joins / seconds:,.0f} physical_batches="
        f"{sum(manifest['physical_batches'])} rows_written={rows}")
  per_epoch_1e9 = 1e9 / (args.records * args.epochs / seconds)
  print(f"estimate, one epoch of N=1e9 at this rate: {per_epoch_1e9:,.0f} s "
        f"= {per_epoch_1e9 / 3600:.1f} h on this runner; /W on W workers")
  shutil.rmtree(out)


if __name__ == "__main__":
  main()
