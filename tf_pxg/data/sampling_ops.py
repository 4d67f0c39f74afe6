"""Poisson sampling and layout as TensorFlow ops (no Python per step).

The `tf.data` stream of `tf_pxg.data.poisson_dataset` is built from these:

- `step_indices(key, N, q)`: one logical step's sorted indices by geometric
  skips (the O(B) algorithm and its derivation: `tf_pxg.data.poisson`),
  drawn with stateless RNG ops from a `[2]` int64 key.
- `step_key(seed, step)` / `urandom_keys()`: the per-step key, a pure
  function of `(seed, step)`, or (secure mode) 128 fresh bits per step read
  from the OS CSPRNG (`/dev/urandom`) by a `tf.data` file reader.
- `layout(indices, ...)`: the step's `[m, P]` index and mask matrices, the
  same layout as `PoissonSampler.layout`.
- `group_step_indices(key, step, members, offsets, q)`: cyclic Poisson
  sampling (`PoissonSampler(min_separation=b, group_seed=...)`): step `step`
  samples only group `g = step mod b`, i.e. the geometric skips run over
  the positions k of the group's member list
  `members[offsets[g]:offsets[g + 1]]` (the sampler's `GroupIndex`, held
  as constant tensors) and map back to `members[offsets[g] + k]`.
- `index_stream(...)`: a dataset of `(indices [P], mask [P], step_end)`
  physical batches, to be gathered from tensors held once.

The functions tf_pxg hands to `tf.data` (`map`, `flat_map`, `filter`) are
TF ops as written, with no Python control flow over tensors, so they are
traced without autograph (`as_written`): its conversion of this module's
functions cost about 2.6 s of the first pipeline a process builds and a
third of every later one (0.8 s → 0.5 s per `index_stream`, measured on
2026-12-07). A sampler's own `step_indices` (the sampler protocol: user
code) is still converted as `tf.data` does by default.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import tensorflow as tf

from tf_pxg.data import participation
from tf_pxg.data._gaps import gap_chunk_size

_URANDOM = "/dev/urandom"


def as_written(fn):
  """`fn` for `tf.data.Dataset.map`/`flat_map`/`filter`, traced without
  autograph's conversion (`tf.autograph.experimental.do_not_convert`): only
  for tf_pxg's own functions, which use TF control flow explicitly."""
  return tf.autograph.experimental.do_not_convert(fn)


def step_key(seed: int, step) -> tf.Tensor:
  """The `[2]` int64 stateless key of logical step `step` under `seed`."""
  base = tf.constant([seed >> 32, seed & 0xFFFFFFFF], tf.int64)
  return tf.cast(tf.random.experimental.stateless_fold_in(
      base, tf.cast(step, tf.int64)), tf.int64)


def urandom_keys() -> tf.data.Dataset:
  """An endless dataset of `[2]` int64 keys, 128 bits each from the OS CSPRNG.

  `/dev/urandom` read as a text file (it never ends) gives random lines;
  dropping each line's last byte (the reader strips a `\\r` before `\\n`)
  leaves i.i.d. bytes uniform on the 255 values other than `\\n`, so a key
  of 16 such bytes carries 16 log2(255) = 127.9 bits of OS entropy. No
  Python runs per element.

  Raises:
    ValueError: no `/dev/urandom` on this system (then use the numpy
      `PoissonSampler(secure_mode=True)`, which reads `os.urandom`).
  """
  if not os.path.exists(_URANDOM):
    raise ValueError(
        "secure_mode's tf.data stream reads the OS CSPRNG from /dev/urandom, "
        "which this system does not have. Use PoissonSampler(secure_mode="
        "True) with your own input pipeline (it reads os.urandom).")
  lines = tf.data.TextLineDataset(_URANDOM).filter(
      as_written(lambda line: tf.strings.length(line) >= 17))

  def to_key(line):
    raw = tf.io.decode_raw(tf.strings.substr(line, 0, 16), tf.uint8)
    words = tf.reshape(tf.cast(raw, tf.int64), [2, 8])
    shifts = tf.constant([56, 48, 40, 32, 24, 16, 8, 0], tf.int64)
    # Two 64-bit words (wrapping into int64 is fine for a key).
    return tf.reduce_sum(tf.bitwise.left_shift(words, shifts), axis=1)

  return lines.map(as_written(to_key))


def step_indices(key, num_examples, sampling_rate: float,
                 alg: str = "philox",
                 max_examples: Optional[int] = None) -> tf.Tensor:
  """One Poisson sample of `range(N)` by geometric skips, as TF ops.

  Args:
    key: `[2]` int64 stateless key of the step.
    num_examples: N, a Python int or a scalar int64 tensor (a cyclic
      group's size, which depends on the step).
    sampling_rate: q in (0, 1].
    alg: the stateless RNG algorithm (TensorFlow's name, e.g. "philox").
    max_examples: with a tensor `num_examples`, a Python int bound on it
      (sizes the rounds of gaps); ignored for an int N.

  Returns:
    `[n]` int64 sorted distinct indices, each included independently with
    probability q (see `tf_pxg.data.poisson`). Expected work O(Nq + 1):
    `gap_chunk_size` gaps per round, one round except with probability
    below 1e-8.
  """
  q = float(sampling_rate)
  if isinstance(num_examples, tf.Tensor):
    if max_examples is None:
      raise ValueError("step_indices with a tensor num_examples needs "
                       "max_examples, a Python int bound on it.")
    n = tf.cast(num_examples, tf.int64)
    n_float = tf.cast(n, tf.float64)
    chunk = gap_chunk_size(int(max_examples), q)
  else:
    n = int(num_examples)
    n_float = float(n)
    chunk = gap_chunk_size(n, q)
  if q >= 1.0:
    return tf.range(n, dtype=tf.int64)
  log1mq = tf.constant(math.log1p(-q), tf.float64)
  key = tf.cast(key, tf.int64)

  def body(round_, last, found):
    seed = tf.random.experimental.stateless_fold_in(key, round_, alg=alg)
    u = 1.0 - tf.random.stateless_uniform([chunk], seed, dtype=tf.float64,
                                          alg=alg)  # (0, 1]
    gaps = tf.minimum(tf.floor(tf.math.log(u) / log1mq), n_float)
    positions = last + tf.cumsum(tf.cast(gaps, tf.int64) + 1)
    found = tf.concat([found, tf.boolean_mask(positions, positions < n)], 0)
    return round_ + 1, positions[-1], found

  _, _, found = tf.while_loop(
      lambda r, last, f: last < n, body,
      (tf.constant(0, tf.int64), tf.constant(-1, tf.int64),
       tf.zeros([0], tf.int64)),
      shape_invariants=(tf.TensorShape([]), tf.TensorShape([]),
                        tf.TensorShape([None])))
  return found


def group_step_indices(key, step, members, offsets, sampling_rate: float,
                       alg: str = "philox",
                       max_group_size: Optional[int] = None) -> tf.Tensor:
  """Cyclic Poisson sampling of one step, as TF ops.

  Step `step` (a scalar int tensor, the global logical step) samples group
  `g = step mod b` (b = `len(offsets) - 1`), whose members are
  `members[offsets[g]:offsets[g + 1]]` (ascending; the sampler's
  `GroupIndex.member_indices` and `offsets`): a Poisson sample of the
  positions k in that list at rate q by `step_indices`, mapped back to
  `members[offsets[g] + k]`. O(B) per step.

  Args:
    key: `[2]` int64 stateless key of the step.
    step: scalar int, the global logical step.
    members: `[N]` int32 or int64 tensor, the examples sorted by group.
    offsets: `[b + 1]` int64 tensor, group g's slice of `members`.
    sampling_rate: q.
    alg: the stateless RNG algorithm.
    max_group_size: a Python int bound on the group sizes (sizes the rounds
      of gaps, `gap_chunk_size(max_group_size, q)`); default `len(members)`.

  Returns:
    `[n]` int64 sorted distinct indices, all members of group g.
  """
  offsets = tf.cast(offsets, tf.int64)
  b = tf.shape(offsets, out_type=tf.int64)[0] - 1
  group = tf.math.floormod(tf.cast(step, tf.int64), b)
  first = offsets[group]
  size = offsets[group + 1] - first
  if max_group_size is None:
    max_group_size = int(members.shape[0])
  positions = step_indices(key, size, sampling_rate, alg,
                           max_examples=int(max_group_size))
  return tf.cast(tf.gather(members, first + positions), tf.int64)


def layout(indices, physical_batch_size: int, accumulation_steps: int,
           num_replicas: int):
  """A step's `[m, P]` indices and mask, `PoissonSampler.layout`'s layout.

  `m = max(k, ceil(n / P))`; example `c` goes to physical batch `c mod m`,
  slot `(j mod R) * P/R + j div R` with `j = c div m`. Padding rows hold
  index 0 and mask 0.

  Returns:
    `(indices [m, P] int64, mask [m, P] float32, step_end [m] bool)`.
  """
  p, k, r = physical_batch_size, accumulation_steps, num_replicas
  indices = tf.cast(indices, tf.int64)
  n = tf.shape(indices, out_type=tf.int64)[0]
  m = tf.maximum(tf.constant(k, tf.int64), (n + p - 1) // p)
  c = tf.range(n)
  j = c // m
  slot = (j % r) * (p // r) + j // r
  where = tf.stack([c % m, slot], axis=1)
  shape = tf.stack([m, tf.constant(p, tf.int64)])
  idx = tf.scatter_nd(where, indices, shape)
  mask = tf.scatter_nd(where, tf.ones([n], tf.float32), shape)
  return idx, mask, tf.equal(tf.range(m), m - 1)


def index_stream(sampler: "tf_pxg.data.PoissonSampler",
                 start_step: Optional[int] = None,
                 num_steps: Optional[int] = None) -> tf.data.Dataset:
  """Physical batches of indices: `(indices [P], mask [P], step_end)`.

  Args:
    sampler: gives N, q, P, k, R, the seed and `secure_mode`.
    start_step: key the steps `start_step, start_step + 1, ...` (a pure
      function of `(seed, step)`: every iteration yields the same steps,
      and a stream can be resumed at any step). None: each iteration draws
      a fresh epoch nonce (from a seeded `tf.data` random stream that
      re-randomises per iteration), so re-iterating yields fresh steps,
      reproducibly given the seed.
    num_steps: logical steps per iteration; None for endless.

  In secure mode every step's 128-bit key is read from the OS CSPRNG (no
  seed, nothing shared between steps); `start_step` then only counts (and
  places the cycle of `min_separation`).

  Cyclic sampling (`sampler.min_separation` = b > 1): the stream's step
  `start_step + t` samples group `(start_step + t) mod b`
  (`group_step_indices` over the sampler's member lists, the same groups
  as its numpy path: one `group_assignment` under `sampler.group_seed`),
  so a stream resumed at `start_step` continues the cycle. With
  `start_step=None` every iteration counts its steps from 0 (group 0
  first); so that consecutive iterations continue the cycle, `num_steps`
  must then be a multiple of b (or None).

  Raises:
    ValueError: `start_step=None` with b > 1 and `num_steps` not a
      multiple of b.
  """
  n, q, b = (sampler.num_examples, sampler.sampling_rate,
             sampler.min_separation)
  p, k, r = (sampler.physical_batch_size, sampler.accumulation_steps,
             sampler.num_replicas)
  alg = "philox"
  if b > 1 and start_step is None and num_steps is not None and (
      num_steps % b):
    raise ValueError(
        f"Cyclic Poisson sampling with min_separation={b}: a stream without "
        f"start_step restarts the cycle at group 0 on every iteration, so "
        f"its num_steps (steps_per_epoch) must be a multiple of {b}; got "
        f"{num_steps}. Pass start_step (the global step, e.g. "
        "optimizer.iterations), repeat=True, or steps_per_epoch a multiple "
        f"of {b}.")
  offset = 0 if start_step is None else int(start_step)
  steps = (tf.data.Dataset.range(num_steps) if num_steps is not None else
           tf.data.Dataset.range(2 ** 62))
  if sampler.secure_mode:
    keys = tf.data.Dataset.zip((steps, urandom_keys())).map(
        as_written(lambda t, key: (t + offset, key)))
  elif start_step is not None:
    keys = steps.map(as_written(
        lambda t: (t + start_step, step_key(sampler.seed, t + start_step))))
  else:
    nonces = tf.data.Dataset.random(
        seed=sampler.seed % (2 ** 63), rerandomize_each_iteration=True
    ).batch(2).take(1)

    def epoch(nonce):
      base = step_key(sampler.seed, 0) + nonce
      return steps.map(as_written(lambda t: (t, tf.cast(
          tf.random.experimental.stateless_fold_in(base, t), tf.int64))))

    keys = nonces.flat_map(as_written(epoch))

  def batches_of(indices):
    idx, mask, end = layout(indices, p, k, r)
    return tf.data.Dataset.from_tensor_slices((idx, mask, end))

  # A sampler's own selection, checked at every step against the cyclic
  # groups it states (tf_pxg.data.participation.guarded_selection).
  select = participation.guarded_selection(
      sampler, f"{type(sampler).__name__}'s stream")
  if select is not None:
    # The sampler protocol: a sampler with its own selection (e.g.
    # `tf_pxg.data.balls_in_bins`) maps (global step, key) to indices;
    # None is the (cyclic) Poisson selection below.
    if start_step is None:
      raise ValueError(
          f"{type(sampler).__name__} selects by the global step: pass "
          "start_step (e.g. optimizer.iterations) or repeat=True.")
    return keys.flat_map(lambda step, key: batches_of(select(step, key)))
  if b == 1:
    return keys.flat_map(as_written(
        lambda step, key: batches_of(step_indices(key, n, q, alg))))
  groups = sampler.group_index
  # The member lists are held once, as the data is in `poisson_dataset`,
  # and handed to every step.
  held = tf.data.Dataset.from_tensors(
      (tf.constant(groups.member_indices), tf.constant(groups.offsets))
  ).repeat()
  max_size = groups.max_size

  def group_batches(step_key_, members_offsets):
    (step, key), (members, offsets) = step_key_, members_offsets
    return batches_of(group_step_indices(key, step, members, offsets, q,
                                         alg, max_group_size=max_size))

  return tf.data.Dataset.zip((keys, held)).flat_map(as_written(group_batches))
