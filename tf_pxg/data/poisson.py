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

O(B) per step: geometric skips. Poisson sampling includes each index
independently with probability q, i.e. it is a Bernoulli process on
0, 1, ..., N-1. In a Bernoulli process the gaps between consecutive
included indices are i.i.d. Geometric(q) (the number of failures before a
success, `P(G = g) = (1-q)^g q`) and independent of everything before them
(memorylessness). So the sample is exactly
`{p_1 < p_2 < ... : p_i < N}` with `p_1 = G_1`, `p_{i+1} = p_i + 1 + G_{i+1}`,
and drawing the gaps costs O(n + 1) = O(B) in expectation instead of the N
uniforms of `U_i < q`. A gap is drawn by inversion,
`G = floor(log(U) / log(1 - q))` with `U` uniform on (0, 1]:
`P(G >= g) = P(U <= (1-q)^g) = (1-q)^g`. (With float64 `U` of 53 random
bits the law is exact up to that resolution, the same as comparing a
float64 uniform with q.) Equivalently: `n ~ Binomial(N, q)` and, given n,
a uniformly random n-subset; the realised batch sizes and inclusions pass
the same tests as the N-uniform sampler (`tests/test_sampling.py`).

Cyclic Poisson sampling (`min_separation=b > 1`; Choquette-Choo et al. 2023,
"Amplified banded matrix factorization", for BandMF's correlated noise).
The examples are split once into b groups by an **independent uniform
assignment**: example i's group is `g_i`, where

    g = np.random.default_rng([group_seed, GROUP_SALT]).integers(
        0, b, size=N)

(`group_assignment`; `GROUP_SALT` is the ASCII of "tf_pxg/groups" read as a
big-endian integer, above 2^64, so this generator is never the one of a
sampling step, keyed `[seed, step]`). Global logical step s (counted like
`optimizer.iterations`, from `start_step`) samples only group `s mod b`:
each of its members independently with probability `q = B b / N`, by the
same geometric skips, run over the group's sorted member list (precomputed
once per sampler) and mapped back to the members' indices: O(B) per step.
So an example can join only every b-th step, and two of its participations
are a multiple of b steps apart.

Why this partition, and why a seed. The amplified-BandMF ε (ceil(T / b)
rounds of the Poisson-subsampled Gaussian at rate q) is claimed, like
every ε here, under add/remove adjacency. A partition by position
(`i mod b`) does not give that: removing one example shifts the groups of
all the examples after it, so it is only valid under zero-out/replace
adjacency (jax-privacy's `PartitionType` docs draw the same line:
`INDEPENDENT`, each example's group drawn independently and uniformly at
random, is the partition valid for add/remove). Here the groups are a
function of the position too, but under a secret seed drawn uniformly at
random and independently of the data: the values `g_0, ..., g_{N-1}` are
then (modelling the generator as a random function of its key) i.i.d.
uniform on `range(b)` for every N, whichever records sit at those
positions. So the data set with one record removed, its later rows shifted
up, gives the remaining records i.i.d. uniform groups again: the same law
as the full data set's assignment restricted to them. That is the
independent partition, and the mechanism on the smaller data set is the
mechanism on the larger one without the removed record's contributions,
which is what the add/remove analysis needs. The seed must therefore be
drawn once from OS entropy, never chosen after looking at the data, kept
secret (like the noise; it is optimizer state, not a published artefact),
and kept for the whole run: the group assignment must not change between
epochs or resumed fits (nor differ between the workers of a multi-worker
job: broadcast it like the sampling seed), or an example could join two
steps less than b apart. That is why it is an argument, `group_seed`, and not drawn here: a
DP model's `fit` passes the seed its optimizer drew once and persists
(`optimizer.dp_state.group_seed`); a custom loop draws one
(`secrets.randbits(62)`), saves it with its checkpoint and passes it to
every sampler of the run. `group_seed=None` with b > 1 raises.

The group sizes are Binomial(N, 1/b) (they differ by about `sqrt(N / b)`;
they depend on the seed and N only, never on the data). The expected batch
of a step of group g is `q |G_g|`, on average over the assignment
`q N / b = B`; the noisy sum is divided by the data-independent constant
`expected_batch_size` B (`NORMALIZER`). `q <= 1` needs `b <= floor(N / B)`.
b = 1 is ordinary Poisson sampling, bit for bit the same draws as a sampler
without the argument, with no group seed (one group, nothing to assign).
The Beam pipeline (`tf_pxg.data.beam`) draws each record's group from a
keyed hash of its id under the same kind of `group_seed`.

Randomness. Logical step t of a seeded sampler is a pure function of
`(seed, t)`: the numpy sampler seeds a PCG64 generator with the key
`[seed, t]`, the `tf.data` stream (`tf_pxg.data.poisson_dataset`) keys
TensorFlow's stateless Philox with `fold_in(seed, t)`. So a stream can be
resumed at any step (`fit` continues at `optimizer.iterations`) and agrees
across the workers of a multi-worker job given the same seed (draw it from
OS entropy on one worker and broadcast it). Without a seed, the seed is
drawn from OS entropy (`secrets`). With `secure_mode=True` there is no seed
at all: every logical step takes fresh randomness from the operating
system's CSPRNG (`os.urandom` for the numpy sampler: every uniform is 53
bits read from it; the `tf.data` stream reads a fresh 128-bit key per step
from `/dev/urandom` and expands only that step's draws from it with
stateless Philox), so no step can be predicted from another and two runs
never repeat; a `seed` with `secure_mode=True` raises. The group
assignment of cyclic sampling is not per-step randomness but state that
must persist over the run, so secure mode still takes `group_seed` (from
OS entropy, see above); only the draws within the groups come from the
CSPRNG.
"""

from __future__ import annotations

import math
import os
import secrets
from typing import Iterator, NamedTuple, Optional

import numpy as np

# The wire keys of a physical batch's `BatchInfo` (kept importable here).
from tf_pxg.data.batch_info import MASK  # noqa: F401
from tf_pxg.data.batch_info import NORMALIZER  # noqa: F401
from tf_pxg.data.batch_info import ROW_MASK  # noqa: F401
from tf_pxg.data.batch_info import STEP_END  # noqa: F401
from tf_pxg.data.batch_info import WEIGHT  # noqa: F401
from tf_pxg import _renamed
from tf_pxg.data import participation
from tf_pxg.data import protocol
from tf_pxg.data._gaps import gap_chunk_size


# Second word of the key of the group assignment's generator,
# `np.random.default_rng([group_seed, GROUP_SALT])`: the ASCII bytes of
# "tf_pxg/groups" as a big-endian integer. It is above 2^64, so it is never
# the step of a sampling key `[seed, step]`.
GROUP_SALT = int.from_bytes(b"tf_pxg/groups", "big")
# Examples per call of `integers` when drawing the assignment (the draws of
# consecutive calls on one generator concatenate to those of one call).
_GROUP_CHUNK = 1 << 22


def max_min_separation(num_examples: int,
                       expected_batch_size: float) -> int:
  """The largest `min_separation` b with `q = B b / N <= 1` and `b <= N`:
  `floor(N / B)`.

  Raises:
    ValueError: a non-positive argument, or B > N.
  """
  _check_positive_int(num_examples, "num_examples")
  _check_positive(expected_batch_size, "expected_batch_size")
  n, b = int(num_examples), float(expected_batch_size)
  if b > n:
    raise ValueError(
        f"expected_batch_size={expected_batch_size} exceeds num_examples="
        f"{num_examples}: the sampling rate q = B / N must be <= 1.")
  groups = min(n, int(math.floor(n / b)))
  # Guard the float floor: the largest b with B * b <= N exactly.
  while groups > 1 and b * groups > n:
    groups -= 1
  while groups < n and b * (groups + 1) <= n:
    groups += 1
  return groups


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


class PoissonSampler(protocol.Sampler):
  """Draws Poisson logical batches as fixed-shape masked physical batches.

  Built from a `tf_pxg.data.SamplerConfig` (`PoissonSampler.from_config(
  config)`, what `fit` calls) or from the config's fields as arguments,
  `PoissonSampler(N, B, ...)`:

  Args:
    num_examples: N, the dataset size.
    expected_batch_size: B, the expected logical batch size; each example
      joins each logical step it is eligible for with probability
      `q = B b / N` (b = `min_separation`; `q = B / N` by default).
      `0 < B <= N`.
    physical_batch_size: P rows per physical batch (global, over all
      replicas); a multiple of `num_replicas`. Default
      `default_physical_batch_size(B, accumulation_steps, num_replicas)`.
    accumulation_steps: k, the number of physical batches a logical step
      normally spans (more only on overflow, see the module docstring).
    num_replicas: R; rows are dealt round-robin over R equal slices.
    steps_per_epoch: logical steps per epoch; default `ceil(N / B)`
      (with b groups: `b ceil(N / (B b))`, a whole number of cycles).
    seed: a non-negative int for a reproducible stream (step t is a pure
      function of `(seed, t)`); None draws the seed from OS entropy.
    secure_mode: draw every step's randomness from the OS CSPRNG
      (`os.urandom`) instead of a seeded stream; see the module docstring.
    start_step: the global index of the first logical step
      `logical_step` / `sample_indices` draw (to resume a stream: pass
      `optimizer.iterations`). With `min_separation` it also fixes where
      the cycle is: step s samples group `s mod b`.
    min_separation: b >= 1, cyclic Poisson sampling (module docstring):
      example i is in group `g_i` (`group_assignment(N, b, group_seed)`,
      i.i.d. uniform on `range(b)`), step s samples only group `s mod b`,
      at rate `q = B b / N`, so two participations of an example are at
      least b steps apart. 1 (default) is ordinary Poisson sampling.
      `num_groups=` is its deprecated name.
    group_seed: required when b > 1: a non-negative int below 2^64 that
      keys the group assignment. It must be drawn once per training run
      from OS entropy, kept secret, and passed unchanged to every sampler
      of the run (every epoch and resumed fit), so that each example keeps
      its group. A DP model's `fit` passes its optimizer's persisted seed;
      in a custom loop use e.g. `secrets.randbits(62)` and save it with
      the checkpoint. Independent of `seed` and `secure_mode` (secure
      mode needs it too). Ignored (no assignment) when b = 1.

  Attributes:
    config: the resolved `SamplerConfig` (defaults filled in, the seed
      drawn), from which `from_config` rebuilds the same stream.
    seed: the stream's seed (None in secure mode).
    next_step: the index of the next logical step the stateful methods draw.
    min_separation: b (`num_groups`, deprecated, reads it too).
    group_seed: the assignment's seed (None when b = 1 and none was given).
    sampling_rate: q = B b / N, the probability that an example joins a
      step of its group (what the accountant composes, ceil(T / b) times
      per example for BandMF).
    step_indices: None: the stream (`tf_pxg.data.sampling_ops`) draws
      this class's (cyclic) Poisson selection by its own ops. A subclass
      that selects otherwise defines the method `step_indices(step, key)`
      (TF ops: the sorted int64 indices of global logical step `step`;
      `key` is the stream's `[2]` int64 key of the step), e.g.
      `tf_pxg.data.balls_in_bins`.

  Raises:
    ValueError: invalid sizes (named); `seed` together with `secure_mode`;
      `min_separation` not a positive integer or above `floor(N / B)`
      (q > 1); b > 1 without `group_seed` (the message says where it comes
      from), or a `group_seed` that is not an int in `[0, 2^64)`.
    TypeError: unknown arguments.
  """

  # The `tf_pxg.data.samplers.Sampler` protocol: what one ε protects, that
  # `dp_event` is a guarantee, and the schema (b set by the config).
  privacy_unit = "example"
  certified = True
  schema = participation.Participation.poisson(min_separation=None)
  step_indices = None

  def __init__(self, *args, **kwargs):
    config, name = protocol.SamplerConfig.named(*args, **kwargs)
    n, bsz = config.num_examples, config.expected_batch_size
    _check_positive_int(n, "num_examples")
    _check_positive(bsz, "expected_batch_size")
    _check_positive_int(config.accumulation_steps, "accumulation_steps")
    _check_positive_int(config.num_replicas, "num_replicas")
    if bsz > n:
      raise ValueError(
          f"expected_batch_size={bsz} exceeds num_examples="
          f"{n}: the sampling rate q = B / N must be <= 1.")
    physical_batch_size = config.physical_batch_size
    if physical_batch_size is None:
      physical_batch_size = default_physical_batch_size(
          bsz, config.accumulation_steps, config.num_replicas)
    _check_positive_int(physical_batch_size, "physical_batch_size")
    if physical_batch_size % config.num_replicas:
      raise ValueError(
          f"physical_batch_size={physical_batch_size} must be a multiple of "
          f"num_replicas={config.num_replicas} so that every replica gets "
          "an equal slice of each physical batch.")
    separation = check_min_separation(config.min_separation, n, bsz, name)
    group_seed = check_group_seed(config.group_seed, separation, name)
    steps_per_epoch = config.steps_per_epoch
    if steps_per_epoch is None:
      steps_per_epoch = default_steps_per_epoch(n, bsz, separation)
    _check_positive_int(steps_per_epoch, "steps_per_epoch")
    start_step = config.start_step
    if isinstance(start_step, bool) or not isinstance(
        start_step, (int, np.integer)) or start_step < 0:
      raise ValueError(
          f"`start_step` must be a non-negative integer; got {start_step!r}.")
    self.num_examples = int(n)
    self.expected_batch_size = float(bsz)
    self.min_separation = separation
    # B * 1 is exact, so b = 1 keeps q = B / N bit for bit.
    self.sampling_rate = (self.expected_batch_size * self.min_separation /
                          self.num_examples)
    self.physical_batch_size = int(physical_batch_size)
    self.accumulation_steps = int(config.accumulation_steps)
    self.num_replicas = int(config.num_replicas)
    self.steps_per_epoch = int(steps_per_epoch)
    self.secure_mode = bool(config.secure_mode)
    self.seed = resolve_seed(config.seed, self.secure_mode)
    self.next_step = int(start_step)
    self.group_seed = group_seed
    self.config = config.replace(
        num_examples=self.num_examples,
        expected_batch_size=self.expected_batch_size,
        physical_batch_size=self.physical_batch_size,
        accumulation_steps=self.accumulation_steps,
        num_replicas=self.num_replicas, steps_per_epoch=self.steps_per_epoch,
        seed=self.seed, secure_mode=self.secure_mode,
        start_step=self.next_step, min_separation=separation,
        group_seed=group_seed)
    # The groups' members, once: group g is `members[offsets[g]:
    # offsets[g + 1]]`, ascending (b = 1: no arrays, the plain sampler).
    self._groups = None
    if self.min_separation > 1:
      self._groups = GroupIndex(self.num_examples, self.min_separation,
                                group_seed)

  @classmethod
  def from_config(cls, config: protocol.SamplerConfig) -> "PoissonSampler":
    """The sampler of `config` (`cls(**config.kwargs())`, so a subclass
    with its own constructor over the same arguments works too).

    Raises:
      as the constructor.
    """
    return cls(**config.kwargs())

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """The `dp_accounting` event of `steps` steps of this sampler composed
    with `mechanism` (a `tf_pxg.dp.mechanisms.NoiseMechanism`):
    `tf_pxg.accounting.cyclic_poisson_event` at rate q with b groups; None
    past a whole-run mechanism's `num_steps` (no ε claimed).

    Raises:
      ValueError: the mechanism needs another participation
        (`tf_pxg.data.participation.check`).
    """
    from tf_pxg import accounting  # noqa: PLC0415
    participation.check(self, mechanism, f"{type(self).__name__}.dp_event")
    return accounting.cyclic_poisson_event(mechanism, self.sampling_rate,
                                           self.min_separation,
                                           noise_multiplier, steps)

  @property
  def group_index(self) -> Optional["GroupIndex"]:
    """The `GroupIndex` of the assignment (None for b = 1)."""
    return self._groups

  def group_of_step(self, step: int) -> int:
    """The group that global logical step `step` samples: `step mod b`."""
    return int(step) % self.min_separation

  def group_size(self, group: int) -> int:
    """|G_g|, the number of examples assigned to group g (N for b = 1)."""
    if self._groups is None:
      _check_group(group, 1)
      return self.num_examples
    return self._groups.size(group)

  def group_members(self, group: int) -> np.ndarray:
    """`[|G_g|]` int64, the ascending indices of the examples of group g."""
    if self._groups is None:
      _check_group(group, 1)
      return np.arange(self.num_examples, dtype=np.int64)
    return self._groups.members(group).astype(np.int64)

  def example_groups(self) -> np.ndarray:
    """`[N]` int64, every example's group (`group_assignment`; 0s for b = 1)."""
    if self._groups is None:
      return np.zeros(self.num_examples, np.int64)
    return self._groups.assignment()

  def indices_for_step(self, step: int) -> np.ndarray:
    """The sorted indices of logical step `step` (O(B) work, see module doc).

    A pure function of `(seed, step)` (and `group_seed`); in secure mode
    every call draws fresh OS randomness (there is no stream to index).
    With b groups, only the members of group `step mod b` can be drawn:
    the geometric skips run over the positions in the group's member list.

    Returns:
      `[n]` int64, sorted, distinct, in `[0, N)`, all in group
      `g = step mod b`; `n ~ Binomial(|G_g|, q)` (`Binomial(N, q)` for
      b = 1).
    """
    if self.secure_mode:
      uniforms = _os_uniforms
    else:
      rng = np.random.default_rng([self.seed, int(step)])
      uniforms = lambda size: 1.0 - rng.random(size)  # noqa: E731  (0, 1]
    if self.min_separation == 1:
      return geometric_skip_indices(uniforms, self.num_examples,
                                    self.sampling_rate)
    members = self._groups.members(self.group_of_step(step))
    positions = geometric_skip_indices(uniforms, len(members),
                                       self.sampling_rate)
    return members[positions].astype(np.int64)

  def sample_indices(self) -> np.ndarray:
    """The indices of the next Poisson sample (sorted; ~ Binomial(N, q))."""
    step = self.next_step
    self.next_step += 1
    return self.indices_for_step(step)

  def layout(self, indices: np.ndarray) -> list:
    """Lays a logical batch's `indices` out as `PhysicalBatch`es.

    `m = max(k, ceil(n / P))` physical batches; example `c` goes to physical
    batch `c mod m` and, within it, to replica slice `j mod R` (j its rank
    in that batch), so physical batches and replica slices are balanced.
    """
    return layout(indices, self.physical_batch_size, self.accumulation_steps,
                  self.num_replicas)

  def logical_step(self) -> list:
    """Samples one logical step: its list of `PhysicalBatch`es."""
    return self.layout(self.sample_indices())

  def epoch(self) -> Iterator[PhysicalBatch]:
    """The physical batches of `steps_per_epoch` fresh logical steps."""
    for _ in range(self.steps_per_epoch):
      yield from self.logical_step()


def layout(indices: np.ndarray, physical_batch_size: int,
           accumulation_steps: int = 1, num_replicas: int = 1) -> list:
  """`PoissonSampler.layout` as a function (also used by `tf_pxg.data.beam`).

  Returns:
    `m = max(k, ceil(n / P))` `PhysicalBatch`es holding `indices`: entry
    `c` in batch `c mod m`, slot `(j mod R) * P/R + j div R`, `j = c div m`.
  """
  indices = np.asarray(indices, np.int64)
  n, p, r = len(indices), physical_batch_size, num_replicas
  m = max(accumulation_steps, -(-n // p))
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


def group_assignment(num_examples: int, min_separation: int,
                     group_seed: int) -> np.ndarray:
  """`[N]` int64, the group of every example under `group_seed`.

  Exactly `np.random.default_rng([group_seed, GROUP_SALT]).integers(0, b,
  size=N)` (drawn in chunks of one generator, which concatenate to the
  same values): i.i.d. uniform on `range(b)` given a secret random seed
  (module docstring). b = 1 gives zeros.

  Raises:
    ValueError: invalid N or b, or `group_seed` not an int in `[0, 2^64)`.
  """
  _check_positive_int(num_examples, "num_examples")
  _check_positive_int(min_separation, "min_separation")
  if min_separation == 1:
    return np.zeros(int(num_examples), np.int64)
  group_seed = check_group_seed(group_seed, min_separation)
  return np.concatenate(list(_assignment_chunks(
      int(num_examples), int(min_separation), group_seed)))


def _assignment_chunks(n: int, b: int, group_seed: int):
  rng = np.random.default_rng([group_seed, GROUP_SALT])
  for start in range(0, n, _GROUP_CHUNK):
    yield rng.integers(0, b, size=min(_GROUP_CHUNK, n - start))


class GroupIndex:
  """The b groups of `group_assignment(N, b, group_seed)`, as member lists.

  Built once per sampler in O(N) (a stable radix sort of the assignment):
  `member_indices` holds the example indices sorted by (group, index), and
  group g is `member_indices[offsets[g]:offsets[g + 1]]`, ascending.
  `member_indices` is int32 when N < 2^31, else int64; `groups` is the
  `[N]` assignment in the smallest unsigned dtype that holds b.
  """

  def __init__(self, num_examples: int, min_separation: int,
               group_seed: int):
    n, b = int(num_examples), int(min_separation)
    self.num_examples, self.min_separation = n, b
    self.group_seed = check_group_seed(group_seed, b)
    dtype = (np.uint8 if b <= 1 << 8 else np.uint16 if b <= 1 << 16 else
             np.uint32 if b <= 1 << 32 else np.uint64)
    self.groups = np.empty(n, dtype)
    start = 0
    for chunk in _assignment_chunks(n, b, self.group_seed):
      self.groups[start:start + len(chunk)] = chunk
      start += len(chunk)
    # Radix sort for 8/16-bit keys; stable, so each group stays ascending.
    order = np.argsort(self.groups, kind="stable")
    self.member_indices = order.astype(np.int32 if n < 1 << 31 else
                                       np.int64)
    del order
    self.offsets = np.zeros(b + 1, np.int64)
    np.cumsum(np.bincount(self.groups, minlength=b), out=self.offsets[1:])

  def members(self, group: int) -> np.ndarray:
    """Group g's members, ascending (a view of `member_indices`)."""
    g = _check_group(group, self.min_separation)
    return self.member_indices[self.offsets[g]:self.offsets[g + 1]]

  def size(self, group: int) -> int:
    """|G_g|."""
    g = _check_group(group, self.min_separation)
    return int(self.offsets[g + 1] - self.offsets[g])

  def assignment(self) -> np.ndarray:
    """`[N]` int64, `group_assignment(N, b, group_seed)`."""
    return self.groups.astype(np.int64)

  @property
  def max_size(self) -> int:
    """The largest group's size."""
    return int(np.diff(self.offsets).max())


def check_min_separation(min_separation, num_examples: int,
                         expected_batch_size: float,
                         name: str = "min_separation") -> int:
  """`min_separation` as an int, checked: `1 <= b <= floor(N / B)`.
  `name`: the argument's name in messages (the one the caller used).

  Raises:
    ValueError: not a positive integer, or so large that `q = B b / N`
      exceeds 1 (the message names the largest allowed b).
  """
  _check_positive_int(min_separation, name)
  largest = max_min_separation(num_examples, expected_batch_size)
  if min_separation > largest:
    raise ValueError(
        f"{name}={min_separation} is too large for N={num_examples} "
        f"examples and expected_batch_size B={expected_batch_size:g}: cyclic "
        f"Poisson sampling draws each group at rate q = B * {name} / N = "
        f"{expected_batch_size * min_separation / num_examples:.6g}, which "
        f"must be <= 1. The largest {name} is {largest} (floor(N / B), and "
        "at most N).")
  return int(min_separation)


def check_group_seed(group_seed, min_separation: int,
                     name: str = "min_separation") -> Optional[int]:
  """`group_seed` as an int, checked; required for b > 1.

  Raises:
    ValueError: b > 1 and `group_seed` None (the message says why the seed
      must be fixed for the run and where it comes from), or a value that
      is not an int in `[0, 2^64)`.
  """
  if group_seed is None:
    if min_separation == 1:
      return None
    raise ValueError(
        f"{name}={min_separation} (cyclic Poisson sampling) needs "
        "group_seed: each example's group is drawn uniformly at random from "
        f"range({min_separation}) by a generator keyed by group_seed, and "
        "that assignment must stay the same for the whole training run (every "
        "epoch and every resumed fit; otherwise an example could join two "
        f"steps less than {name} apart), so the seed cannot be drawn "
        "here for each sampler. A DP model's fit passes it for you: its "
        "optimizer draws the seed once from OS entropy and keeps it in its "
        "state (optimizer.dp_state.group_seed), saved with checkpoints. In "
        "a custom loop, draw it once (e.g. secrets.randbits(62)), keep it "
        "secret, save it with your checkpoint and pass the same "
        "group_seed to every sampler of the run.")
  if isinstance(group_seed, bool) or not isinstance(
      group_seed, (int, np.integer)) or not 0 <= int(group_seed) < 1 << 64:
    raise ValueError(
        f"`group_seed` must be an integer in [0, 2^64); got {group_seed!r}.")
  return int(group_seed)


def _check_group(group, num_groups: int) -> int:
  if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or (
      not 0 <= group < num_groups):
    raise ValueError(f"group must be an integer in [0, {num_groups}); got "
                     f"{group!r}.")
  return int(group)


def default_steps_per_epoch(num_examples: int, expected_batch_size: float,
                            min_separation: int = 1) -> int:
  """`b ceil(N / (B b))`: `ceil(N / B)` for b = 1, whole cycles otherwise."""
  if min_separation == 1:
    return math.ceil(num_examples / expected_batch_size)
  return min_separation * math.ceil(
      num_examples / (expected_batch_size * min_separation))


def resolve_seed(seed, secure_mode: bool) -> Optional[int]:
  """The sampler seed: `seed`, or 63 bits of OS entropy, or None (secure).

  Raises:
    ValueError: `seed` given with `secure_mode=True`, or not an int >= 0.
  """
  if secure_mode:
    if seed is not None:
      raise ValueError(
          f"A sampling seed ({seed!r}) was given together with "
          "secure_mode=True: secure mode draws every step's randomness from "
          "the OS CSPRNG, so a seed would be ignored (or, if honoured, make "
          "the sample predictable). Drop the seed, or turn secure_mode off "
          "for a reproducible (test) run.")
    return None
  if seed is None:
    return secrets.randbits(63)
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or (
      seed < 0):
    raise ValueError(f"`seed` must be a non-negative integer or None; got "
                     f"{seed!r}.")
  return int(seed)


def _os_uniforms(size: int) -> np.ndarray:
  """`size` float64 uniforms on (0, 1], 53 bits each from `os.urandom`."""
  bits = np.frombuffer(os.urandom(8 * size), np.uint64) >> np.uint64(11)
  return (bits.astype(np.float64) + 1.0) * 2.0 ** -53


def geometric_skip_indices(uniforms, num_examples: int,
                           sampling_rate: float) -> np.ndarray:
  """A Poisson sample of `range(num_examples)` by geometric skips.

  Args:
    uniforms: `uniforms(size)` returns `[size]` float64 uniforms on (0, 1].
    num_examples: N.
    sampling_rate: q in (0, 1].

  Returns:
    `[n]` sorted distinct int64 indices; each index included independently
    with probability q (module docstring: the gaps of a Bernoulli process
    are i.i.d. Geometric(q)). Expected work O(Nq + 1).
  """
  n, q = int(num_examples), float(sampling_rate)
  if q >= 1.0:
    return np.arange(n, dtype=np.int64)
  log1mq = math.log1p(-q)
  chunk = gap_chunk_size(n, q)
  parts, last = [], -1
  while last < n:
    gaps = np.floor(np.log(uniforms(chunk)) / log1mq)
    gaps = np.minimum(gaps, n).astype(np.int64)  # anything >= N ends it
    positions = last + np.cumsum(gaps + 1)
    parts.append(positions[positions < n])
    last = int(positions[-1])
  return np.concatenate(parts) if len(parts) > 1 else parts[0]


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


def max_num_groups(num_examples: int, expected_batch_size: float) -> int:
  """Deprecated name of `max_min_separation`."""
  _renamed.warn("max_num_groups", "max_min_separation", "tf_pxg.data")
  return max_min_separation(num_examples, expected_batch_size)


def check_num_groups(num_groups, num_examples: int,
                     expected_batch_size: float) -> int:
  """Deprecated name of `check_min_separation` (messages say
  `num_groups`)."""
  _renamed.warn("check_num_groups", "check_min_separation", "tf_pxg.data")
  return check_min_separation(num_groups, num_examples, expected_batch_size,
                              "num_groups")
