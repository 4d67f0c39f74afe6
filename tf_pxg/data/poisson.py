"""Poisson-sampled logical batches laid out as fixed-shape physical batches.

DP-SGD's privacy analysis (the subsampled Gaussian mechanism that
`tf_pxg.accounting` evaluates) assumes **Poisson sampling**: at every
logical step each of the N examples joins the batch independently with
probability `q = B / N`, so the realised batch size is `n ~ Binomial(N, q)`
with mean B. Shuffling once per epoch and cutting fixed batches is a
different mechanism, and can be much less private than the Poisson ε says
(Chua et al., "How Private are DP-SGD Implementations?", ICML 2024).

Static shapes (XLA, TPU) and bounded memory need fixed-size batches. A
logical step is therefore laid out as `m >= k` **physical batches** of `P`
rows each (`k = accumulation_steps`), with a per-row mask: 1 for a sampled
example, 0 for a padding row (it points at example 0 and contributes
nothing: no gradient, norm, loss or metric). The last physical batch of a
logical step carries `step_end = True`; the DP train step accumulates the
clipped sums of the step's physical batches, adds the noise once at
`step_end`, and divides by the *expected* batch size `qN`.

Overflow rule (carry, never drop). The step uses
`m = max(k, ceil(n / P))` physical batches. With the default
`P = ceil((B + 4 sqrt(B)) / k)` (rounded up to a multiple of the replica
count), `m = k` unless `n > kP >= B + 4 sqrt(B)`, i.e. unless the draw
exceeds its mean by more than about 4 standard deviations
(`Var n = Nq(1-q) <= B`): about 3e-5 per step in the normal
approximation (Bernstein's inequality bounds it by
`exp(-8 / (1 + 4 / (3 sqrt(B))))`, 1e-3 at B = 64). Such a step just takes
extra physical batches.
Derivation that this keeps the guarantee exact: the released quantity
(the model after each logical step) is a function of
`sum_{b in S} clip(g_b) + N(0, (sigma C)^2)` with S the Poisson sample, and
of nothing else about S: how S is cut into physical batches only changes
the order of a sum. So the mechanism *is* the Poisson subsampled Gaussian
that the accountant analyses, for every draw, with no extra δ. (Truncating
to `kP` rows instead would make it a different mechanism, whose δ grows by
the probability of overflow over all steps, roughly `T * 3e-5` here, far
above a typical δ of 1e-5.) The number of physical batches of a step is not
part of the released model; like any implementation's running time it
depends on n.

Under a `tf.distribute` strategy with R replicas the *global* logical batch
is sampled once and each physical batch is split into R equal slices
(`P` is a multiple of R): real rows are dealt round-robin over the slices,
so every replica holds `ceil` or `floor` of its share.

The sampler draws from `numpy.random.Generator` (PCG64), seeded from OS
entropy unless a seed is given (tests, or to agree on one stream across the
workers of a multi-worker job: then draw the seed from OS entropy on one
worker and broadcast it).
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional

import numpy as np

# Keys of the per-row DP batch information (see `PhysicalBatch`).
MASK = "dp_mask"
STEP_END = "dp_step_end"
NORMALIZER = "dp_normalizer"
WEIGHT = "dp_weight"


def default_physical_batch_size(expected_batch_size: float,
                                accumulation_steps: int = 1,
                                num_replicas: int = 1) -> int:
  """`ceil((B + 4 sqrt(B)) / k)` rounded up to a multiple of `num_replicas`.

  Holds a whole Poisson batch of expected size B in k physical batches
  except with probability about 3e-5 per step (see the module docstring);
  the padding costs `4 / sqrt(B)` of the batch (50% at B = 64, 12.5% at
  B = 1024, 6% at 4096).

  Raises:
    ValueError: a non-positive argument.
  """
  _check_positive(expected_batch_size, "expected_batch_size")
  _check_positive_int(accumulation_steps, "accumulation_steps")
  _check_positive_int(num_replicas, "num_replicas")
  b = float(expected_batch_size)
  size = math.ceil((b + 4.0 * math.sqrt(b)) / accumulation_steps)
  return int(math.ceil(size / num_replicas) * num_replicas)


class PhysicalBatch(NamedTuple):
  """One physical batch of a Poisson-sampled logical step.

  Attributes:
    indices: `[P]` int64 example indices (padding rows point at example 0).
    mask: `[P]` float32, 1 for sampled examples and 0 for padding rows.
    step_end: True for the last physical batch of the logical step.
  """
  indices: np.ndarray
  mask: np.ndarray
  step_end: bool


class PoissonSampler:
  """Draws Poisson logical batches as fixed-shape masked physical batches.

  Args:
    num_examples: N, the dataset size.
    expected_batch_size: B; each example joins each logical step with
      probability `q = B / N`. `0 < B <= N`.
    physical_batch_size: P rows per physical batch (global, over all
      replicas); a multiple of `num_replicas`. Default
      `default_physical_batch_size(B, accumulation_steps, num_replicas)`.
    accumulation_steps: k, the number of physical batches a logical step
      normally spans (more only on overflow, see the module docstring).
    num_replicas: R; rows are dealt round-robin over R equal slices.
    steps_per_epoch: logical steps per epoch; default `ceil(N / B)`.
    seed: an int for a reproducible stream; None draws from OS entropy.

  Raises:
    ValueError: invalid sizes (named).
  """

  def __init__(self, num_examples: int, expected_batch_size: float,
               physical_batch_size: Optional[int] = None,
               accumulation_steps: int = 1, num_replicas: int = 1,
               steps_per_epoch: Optional[int] = None,
               seed: Optional[int] = None):
    _check_positive_int(num_examples, "num_examples")
    _check_positive(expected_batch_size, "expected_batch_size")
    _check_positive_int(accumulation_steps, "accumulation_steps")
    _check_positive_int(num_replicas, "num_replicas")
    if expected_batch_size > num_examples:
      raise ValueError(
          f"expected_batch_size={expected_batch_size} exceeds num_examples="
          f"{num_examples}: the sampling rate q = B / N must be <= 1.")
    if physical_batch_size is None:
      physical_batch_size = default_physical_batch_size(
          expected_batch_size, accumulation_steps, num_replicas)
    _check_positive_int(physical_batch_size, "physical_batch_size")
    if physical_batch_size % num_replicas:
      raise ValueError(
          f"physical_batch_size={physical_batch_size} must be a multiple of "
          f"num_replicas={num_replicas} so that every replica gets an equal "
          "slice of each physical batch.")
    if steps_per_epoch is None:
      steps_per_epoch = math.ceil(num_examples / expected_batch_size)
    _check_positive_int(steps_per_epoch, "steps_per_epoch")
    self.num_examples = int(num_examples)
    self.expected_batch_size = float(expected_batch_size)
    self.sampling_rate = self.expected_batch_size / self.num_examples
    self.physical_batch_size = int(physical_batch_size)
    self.accumulation_steps = int(accumulation_steps)
    self.num_replicas = int(num_replicas)
    self.steps_per_epoch = int(steps_per_epoch)
    self._rng = np.random.default_rng(seed)

  def sample_indices(self) -> np.ndarray:
    """The indices of one Poisson sample (sorted; size ~ Binomial(N, q))."""
    keep = self._rng.random(self.num_examples) < self.sampling_rate
    return np.flatnonzero(keep).astype(np.int64)

  def layout(self, indices: np.ndarray) -> list:
    """Lays a logical batch's `indices` out as `PhysicalBatch`es.

    `m = max(k, ceil(n / P))` physical batches; example `c` goes to physical
    batch `c mod m` and, within it, to replica slice `j mod R` (j its rank
    in that batch), so physical batches and replica slices are balanced.
    """
    n, p, r = len(indices), self.physical_batch_size, self.num_replicas
    m = max(self.accumulation_steps, -(-n // p))
    rows = p // r
    batches = []
    for i in range(m):
      chunk = indices[i::m]
      j = np.arange(len(chunk))
      pos = (j % r) * rows + j // r
      idx = np.zeros(p, np.int64)
      mask = np.zeros(p, np.float32)
      idx[pos] = chunk
      mask[pos] = 1.0
      batches.append(PhysicalBatch(idx, mask, i == m - 1))
    return batches

  def logical_step(self) -> list:
    """Samples one logical step: its list of `PhysicalBatch`es."""
    return self.layout(self.sample_indices())

  def epoch(self) -> Iterator[PhysicalBatch]:
    """The physical batches of `steps_per_epoch` fresh logical steps."""
    for _ in range(self.steps_per_epoch):
      yield from self.logical_step()


def _check_positive(value, name):
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise ValueError(f"`{name}` must be a positive number; got {value!r}.")
  if not value > 0 or not math.isfinite(value):
    raise ValueError(f"`{name}` must be a positive number; got {value!r}.")


def _check_positive_int(value, name):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
  if value < 1:
    raise ValueError(f"`{name}` must be a positive integer; got {value!r}.")
