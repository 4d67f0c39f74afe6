"""Poisson sampling for DP-SGD: masked fixed-shape batches, logical steps.

`PoissonSampler` draws logical batches (each example independently with
probability q = B/N; with `min_separation=b, group_seed=s`, cyclic
Poisson sampling for BandMF: every example is assigned a group uniformly at random
under the run's secret `group_seed` (`group_assignment`), and step s draws
only the examples of group s mod b, at q = B b / N) and
lays them out as fixed-size physical batches with a per-row mask;
`poisson_dataset` turns them into a `tf.data.Dataset` of `(x, y, info)`
that a DP model's `fit` and custom loops consume;
`for_input_pipeline` splits global batches for
`strategy.distribute_datasets_from_function`.
`PoissonShards` reads the step-ordered TFRecord shards that the Apache
Beam pipeline `tf_pxg.data.beam` (optional extra `tf_pxg[beam]`) writes for
data beyond memory. See `tf_pxg.data.poisson` for the semantics and the
overflow rule, `docs/sampling.md` for which path to use at which size.
Every sampler states its accounting event and its participation
(`tf_pxg.data.samplers.Sampler`: `PoissonSampler`, `PoissonShards`,
`PrivacyUnits`, `ShuffledSampler`, `balls_in_bins.BallsInBinsSampler`),
is built from a frozen `SamplerConfig`, and `participation.check` matches
its participation with a noise mechanism's needs; each physical batch's
information is a typed `BatchInfo`.
"""

from tf_pxg.data.batch_info import BatchInfo
from tf_pxg.data.batch_info import MASK
from tf_pxg.data.batch_info import NORMALIZER
from tf_pxg.data.batch_info import ROW_MASK
from tf_pxg.data.batch_info import STEP_END
from tf_pxg.data.batch_info import WEIGHT
from tf_pxg.data.dataset import dp_batch_info
from tf_pxg.data.dataset import for_input_pipeline
from tf_pxg.data.dataset import is_dp_batch_info
from tf_pxg.data.dataset import num_examples
from tf_pxg.data.dataset import poisson_dataset
from tf_pxg.data.dataset import shard_batch
from tf_pxg.data.dataset import user_index
from tf_pxg.data.poisson import default_physical_batch_size
from tf_pxg.data.poisson import group_assignment
from tf_pxg.data.poisson import max_min_separation
from tf_pxg.data.poisson import max_num_groups
from tf_pxg.data.poisson import PhysicalBatch
from tf_pxg.data.poisson import PoissonSampler
from tf_pxg.data.participation import Participation
from tf_pxg.data.samplers import PrivacyUnits
from tf_pxg.data.samplers import Sampler
from tf_pxg.data.samplers import SamplerConfig
from tf_pxg.data.samplers import ShuffledSampler
from tf_pxg.data.shards import PoissonShards

__all__ = [
    "BatchInfo",
    "MASK",
    "NORMALIZER",
    "Participation",
    "PhysicalBatch",
    "PoissonSampler",
    "PoissonShards",
    "PrivacyUnits",
    "ROW_MASK",
    "STEP_END",
    "Sampler",
    "SamplerConfig",
    "ShuffledSampler",
    "WEIGHT",
    "default_physical_batch_size",
    "dp_batch_info",
    "for_input_pipeline",
    "group_assignment",
    "is_dp_batch_info",
    "max_min_separation",
    "max_num_groups",
    "num_examples",
    "poisson_dataset",
    "user_index",
    "shard_batch",
]
