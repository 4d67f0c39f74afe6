"""Sparsity-preserving DP-SGD for embedding tables: DP-FEST and DP-AdaFEST.

DP-SGD adds `N(0, (sigma C)^2)` to every coordinate of the clipped sum, so
an embedding table of V rows gets a dense V x D update at every step while
the batch touches at most B*L rows. Ghazi et al. (NeurIPS 2023) keep the
update sparse by noising only some rows:

* **DP-FEST** (fixed embedding selection): a fixed row set, chosen from
  public or prior information, gets the clipped sum plus Gaussian noise;
  the other rows are never updated. The release is DP-SGD's Gaussian
  mechanism on a data-independent subset of the coordinates: same
  sensitivity C, same sigma, same event.
* **DP-AdaFEST** (adaptive, their Algorithm 2): each step first releases a
  noisy row selection, then the gradient on the selected rows only.

## The selection (one step, one sampled batch)

Example b's contribution map over the rows of all the step's sparse tables
is `v_b = 1[row r is one of example b's ids]` (0/1, repeated ids count
once), clipped to `C_sel` (`selection_l2_norm_clip`):

    u_b = v_b * min(1, C_sel / ||v_b||_2),   ||v_b||_2 = sqrt(n_b),

with n_b the number of distinct rows example b touches over all sparse
tables (flat clipping across tables, as for the gradient). The released
selection is

    S = {r : sum_b u_b[r] + N(0, (sigma_sel C_sel)^2) > tau},

a Gaussian mechanism of L2 sensitivity `C_sel` (adding or removing one
example changes the sum by `u_b`, `||u_b|| <= C_sel`) followed by a
threshold (post-processing).

**Only the touched rows are noised explicitly (exact sampling).** Let T be
the rows some example of the batch touches (U = |T|, padding rows
included: their count is 0, which changes nothing below). A row outside T
has sum 0, so it is selected iff its noise exceeds tau, independently, with
probability

    p = Q(tau / (sigma_sel C_sel)) = erfc(tau / (sqrt(2) sigma_sel C_sel)) / 2.

So the untouched selected rows are a Bernoulli(p) subset of the M = V - U
untouched rows: their number is Binomial(M, p) and, given the number, the
subset is uniform (the rows are exchangeable). We sample it in the rank
space of the untouched rows, by its gaps: the ranks `0 <= r < M` of the
selected untouched rows are the partial sums of i.i.d. gaps `G_j + 1`, with
`G_j = floor(log(1 - U_j) / log(1 - p))`, U_j uniform on [0, 1), which is
Geometric(p) on {0, 1, ...}: `P(G >= k) = P(1 - U <= (1-p)^k) = (1-p)^k`.
A Bernoulli(p) sequence is exactly the sequence whose successes are
separated by i.i.d. Geometric(p) runs of failures, so the ranks below M are
distributed exactly as the untouched rows whose noisy count passes tau.
Rank r maps to the r-th untouched row, `r + #{i : t_i - i <= r}` for the
sorted touched rows t_0 < t_1 < ... (`t_i - i` untouched rows lie below
t_i). The cost is O(U + K), not O(V).

Static shapes (XLA, and a fixed memory bound) need a capacity K for the
untouched selected rows: `false_positive_capacity(V, p)` is the smallest K
with `P(Binomial(V, p) > K) <= 2^-64` by the Chernoff bound
`P(X > K) <= exp(-V KL((K+1)/V || p))`. The sampler is exact except on that
event, of probability at most 2^-64 per table and step whatever the data
(M <= V), where it keeps the first K ranks: its output is within total
variation 2^-64 of the exact mechanism, which adds at most 2^-64 per table
and step to delta (`TAIL_PROBABILITY`; 1e-15 over 10^4 steps of 10 tables,
far below any delta in use).

## The gradient on the selected rows

Given S (post-processing of a DP release, so it may steer what follows),
the step releases `(sum_b c_b g_b)[S] + N(0, (sigma_g C)^2 I_S)` with the
gradient's flat clip `c_b = min(1, C / ||g_b||)` over all trainable
variables: a Gaussian mechanism of sensitivity C on the coordinates S and
the dense variables. Rows outside S get no update at all (the optimizer
receives `tf.IndexedSlices` of the rows S only, its sparse path), so their
values are bit-for-bit unchanged under SGD.

## Cost per step

Touched rows: one sort of the B L (row, example) keys per table. The
selection: N(0, s^2) for the U touched counts, K uniforms for the
untouched ones. The update: the clipped sum's rows summed onto the
selected rows only, and noise drawn for |S| rows (not for the touched
rows that were not selected). All O(B L log(B L) + K + |S| D), not O(V):
with tau chosen for a fixed expected false-positive count V p, the step
costs the same at every V (docs/sparse_embeddings.md, measured at 10^5,
10^6, 10^7 rows). Under XLA the shapes are static: the update keeps all
N + K slots (noise drawn for all, unselected slots zeroed).

## Replicas

Under a `tf.distribute` strategy with R > 1 replicas (plain batches) the
selection is one release for the global batch: every replica all-gathers
the replicas' touched rows and counts (`merge_touched_rows`; an example's
clip weight is computed on its own replica, over all its rows, so the
merged count is the global one) and draws the selection noise from
replica 0's seed, so all replicas compute the same S with the noise added
once; each replica adds its independent share N(0, (sigma_g C)^2 / R) to
its own sum on S, and the optimizer's all-reduce adds the shares. Poisson
(accumulated) steps under a strategy are refused (not tested yet).

## Accounting

Both releases see the same Poisson-sampled batch. Scaled to sensitivity 1
they are Gaussians with noise multipliers sigma_g and sigma_sel; the
adaptive composition of Gaussian mechanisms is itself a Gaussian mechanism
with (Dong, Roth and Su 2022, Corollary 3.3; in Renyi DP the divergences add
in 1/sigma^2)

    sigma^-2 = sigma_g^-2 + sigma_sel^-2,

exactly (the pair is mu-GDP with mu^2 = mu_g^2 + mu_sel^2, and the second
mechanism's coordinates may depend on the first's output). The pair is
therefore dominated by one Gaussian with multiplier sigma on the sampled
batch, and Poisson subsampling applies to it as to a single Gaussian (the
subsampled mechanism's dominating pair is built from the base mechanism's,
Zhu, Dong and Wang 2022, Theorem 10): one step is

    PoissonSampledDpEvent(q, GaussianDpEvent(sigma)).

As with adaptive clipping's count (`tf_pxg.accounting.
split_noise_multipliers`, Andrew et al. 2021, Theorem 1) the run is
accounted with the model's `noise_multiplier` sigma, unchanged, and the
gradient gets `sigma_g = (sigma^-2 - sigma_sel^-2)^-1/2`
(`DPAdaFEST.gradient_noise_multiplier`): `PrivacyCallback`'s epsilon is the
composed epsilon. Accounting the two releases as two independently
Poisson-sampled Gaussians, composed, would under-count: both see the same
batch, and that composition is smaller (MNIST-like q = 256/60000, sigma =
1.1, sigma_sel = 4, 2000 steps: RDP epsilon 0.98 against 1.05 for the
same-batch pair; tests/test_sparse_embeddings.py).

References:
  Ghazi, Huang, Kamath, Kumar, Manurangsi, Sinha and Zhang,
    "Sparsity-Preserving Differentially Private Training of Large Embedding
    Models", NeurIPS 2023, arXiv:2311.08357 (DP-FEST, DP-AdaFEST: Alg. 2).
  Dong, Roth and Su, "Gaussian Differential Privacy", JRSS-B 2022.
  Zhu, Dong and Wang, "Optimal Accounting of Differential Privacy via
    Characteristic Function", AISTATS 2022.
  Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning
    with Adaptive Clipping", NeurIPS 2021.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_pxg.dp import mechanisms
from tf_pxg.dp import releases
from tf_pxg.dp import noise as dp_noise

__all__ = [
    "DPAdaFEST",
    "DPFEST",
    "Selection",
    "SparseStep",
    "TAIL_PROBABILITY",
    "TouchedRows",
    "dense_adaptive_rows",
    "false_positive_capacity",
    "false_positive_rate",
    "fixed_selection",
    "gather_ids",
    "merge_touched_rows",
    "noisy_selected_rows",
    "sample_untouched_rows",
    "select_rows",
    "touched_rows",
]

#: Per table and step, the probability bound of the capacity overflow that
#: makes the untouched-row sampler inexact (module docstring).
TAIL_PROBABILITY = 2.0**-64

# Ops through which a table's value reaches a gather unchanged.
_PASS_THROUGH = ("ReadVariableOp", "Identity", "Cast")
_GATHERS = ("GatherV2", "ResourceGather")
# One stateless algorithm in eager, graph and XLA code (the automatic
# choice differs under XLA): the same seed gives the same draw everywhere.
_ALG = "philox"


# ---------------------------------------------------------------------------
# Closed forms.
# ---------------------------------------------------------------------------


def false_positive_rate(threshold: float, stddev: float) -> float:
  """`P(N(0, stddev^2) > threshold)`: an untouched row's selection chance.

  `Q(threshold / stddev) = erfc(threshold / (sqrt(2) stddev)) / 2`; with
  `stddev == 0`, 1 if `threshold < 0` else 0.
  """
  if stddev < 0 or not math.isfinite(stddev):
    raise ValueError(f"stddev must be finite and >= 0; got {stddev!r}.")
  if stddev == 0:
    return 1.0 if threshold < 0 else 0.0
  return 0.5 * math.erfc(threshold / (math.sqrt(2.0) * stddev))


def _kl_bernoulli(a: float, p: float) -> float:
  """KL(Bernoulli(a) || Bernoulli(p)) for 0 < p < a <= 1."""
  out = a * math.log(a / p)
  if a < 1:
    out += (1 - a) * (math.log1p(-a) - math.log1p(-p))
  else:
    out -= math.log1p(-p)
  return out


def false_positive_capacity(num_rows: int, rate: float,
                            tail: float = TAIL_PROBABILITY) -> int:
  """The smallest K with `P(Binomial(num_rows, rate) > K) <= tail`.

  By the Chernoff bound `P(X >= k) <= exp(-n KL(k/n || p))` for k/n > p (a
  valid upper bound, so the true overflow probability is at most `tail`).

  Args:
    num_rows: n, the table's rows V (the untouched rows are at most V).
    rate: p in [0, 1].
    tail: the overflow probability allowed, in (0, 1).

  Returns:
    K, an int in [0, num_rows].
  """
  if rate <= 0:
    return 0
  if rate >= 1:
    return int(num_rows)
  n = int(num_rows)
  log_tail = math.log(tail)

  def ok(k):  # P(X > k) = P(X >= k + 1) <= exp(-n KL((k+1)/n || p))
    a = (k + 1) / n
    return a >= 1 or (a > rate and -n * _kl_bernoulli(a, rate) <= log_tail)

  lo, hi = max(0, int(math.floor(n * rate))), n
  while lo < hi:
    mid = (lo + hi) // 2
    if ok(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


# ---------------------------------------------------------------------------
# The ids each example gathers from a table (from the recorded tape).
# ---------------------------------------------------------------------------


def gather_ids(tape, variable, batch_size) -> Optional[List[tf.Tensor]]:
  """The ids `[B, L_u]` of each gather of `variable` recorded on `tape`.

  Follows the table's resource handle through `ReadVariableOp`, `Identity`
  and `Cast` to `GatherV2`/`ResourceGather` ops that take it as their
  params (input 0; what Keras' `Embedding` and `tf.gather`/`tf.nn.
  embedding_lookup` record). Each use's ids are reshaped to `[B, -1]`:
  the batch must be axis 0 of the ids (possibly merged with following
  axes, example-major), as the gather rule requires.

  Args:
    tape: the `tf_pxg.GradientTape` that recorded the forward pass.
    variable: a trainable table.
    batch_size: B (int or scalar tensor).

  Returns:
    One int64 `[B, L_u]` tensor per gather of the table, or None if the
    table's value reaches any other op (e.g. a tied output projection): it
    is then not a sparse table.
  """
  # The recorded id of the (Keras or tf) variable's handle, inside a
  # tf.function its captured placeholder, and the recorded operations.
  recorded = tape.recorded_uses(variable)
  if recorded is None:
    return None
  handle, entries = recorded
  derived = {handle}
  uses = []
  for entry in entries:
    touches = [i for i, t in enumerate(entry.input_ids) if t in derived]
    if not touches:
      continue
    if entry.op_type in _PASS_THROUGH and touches == [0]:
      derived.update(entry.output_ids[:1])
    elif entry.op_type in _GATHERS and touches == [0]:
      ids = tf.cast(entry.inputs[1], tf.int64)
      uses.append(tf.reshape(ids, tf.stack([batch_size, -1])))
    else:
      return None
  return uses or None


# ---------------------------------------------------------------------------
# The selection.
# ---------------------------------------------------------------------------


class TouchedRows(NamedTuple):
  """The rows a batch touches in one table, as fixed-size arrays.

  Attributes:
    rows: `[N]` int64, the distinct touched rows in increasing order in the
      first `num` slots, then `V + j` in slot j (sentinels, increasing).
    counts: `[N]` float32, `sum_b u_b[row]` (0 in the sentinel slots).
    valid: `[N]` bool, `j < num`.
    num: scalar int64, U.
  """
  rows: tf.Tensor
  counts: tf.Tensor
  valid: tf.Tensor
  num: tf.Tensor


def _sorted_pairs(ids):
  """`[B, L]` ids -> the sorted distinct-pair view of one table.

  One sort of the keys `id * B + b` (int64; ids < 2^40 and B < 2^23 keep
  them exact) orders the (row, example) pairs by row, then example, so
  that a pair's first occurrence and a row's first occurrence are both
  "differs from its predecessor": one sort replaces a sort per example and
  an argsort of the flat ids (half the selection's time at B L = 5376).

  Returns:
    `(row [N], example [N], pair_first [N] bool, row_first [N] bool)`,
    N = B L, in key order.
  """
  batch = tf.cast(tf.shape(ids)[0], tf.int64)
  example = tf.range(batch, dtype=tf.int64)[:, None]
  keys = tf.sort(tf.reshape(ids * batch + example, [-1]))
  row = keys // tf.maximum(batch, 1)
  example = keys - row * batch
  head = tf.ones([1], tf.bool)
  pair_first = tf.concat([head, tf.not_equal(keys[1:], keys[:-1])], 0)
  row_first = tf.concat([head, tf.not_equal(row[1:], row[:-1])], 0)
  return row, example, pair_first, row_first


def touched_rows(ids_per_table: Sequence[Sequence[tf.Tensor]],
                 num_rows: Sequence[int], selection_l2_norm_clip: float,
                 mask: Optional[tf.Tensor] = None) -> List[TouchedRows]:
  """Each table's touched rows and clipped contribution counts.

  Example b's 0/1 contribution map over the rows of all tables is clipped
  jointly to `selection_l2_norm_clip` (module docstring): weight
  `w_b = mask_b min(1, C_sel / sqrt(n_b))`, n_b its distinct rows over
  all tables; a row's count is the sum of the weights of the examples
  touching it. Cost: one sort of the B L ids per table, O(B L log(B L)),
  independent of V.

  Args:
    ids_per_table: per table, its uses' int64 ids, each `[B, L_u]`.
    num_rows: per table, V (static).
    selection_l2_norm_clip: C_sel > 0.
    mask: optional `[B]` 0/1 (Poisson padding rows weigh 0).

  Returns:
    One `TouchedRows` per table, of static size N = B * sum_u L_u when the
    shapes are static.
  """
  tables = []
  distinct = None
  for uses in ids_per_table:
    ids = tf.concat(list(uses), axis=1) if len(uses) > 1 else uses[0]
    ids = tf.cast(ids, tf.int64)
    row, example, pair_first, row_first = _sorted_pairs(ids)
    n = tf.math.unsorted_segment_sum(tf.cast(pair_first, tf.float32),
                                     example, tf.shape(ids)[0])
    distinct = n if distinct is None else distinct + n
    tables.append((row, example, pair_first, row_first))
  clip = tf.cast(selection_l2_norm_clip, tf.float32)
  weight = tf.where(distinct > 0,
                    tf.minimum(1.0, clip * tf.math.rsqrt(
                        tf.maximum(distinct, 1.0))), 0.0)
  if mask is not None:
    weight = weight * tf.cast(mask, tf.float32)
  out = []
  for (row, example, pair_first, row_first), vocab in zip(tables, num_rows):
    contrib = tf.where(pair_first, tf.gather(weight, example), 0.0)
    size = tf.size(row, out_type=tf.int64)
    seg = tf.cumsum(tf.cast(row_first, tf.int64)) - 1
    num = tf.reduce_sum(tf.cast(row_first, tf.int64))
    slots = tf.range(size, dtype=tf.int64)
    valid = slots < num
    counts = tf.math.unsorted_segment_sum(contrib, seg, size)
    # Each segment's first key is at a row_first position: scatter there.
    rows = tf.math.unsorted_segment_sum(
        tf.where(row_first, row, tf.zeros_like(row)), seg, size)
    rows = tf.where(valid, rows, tf.cast(vocab, tf.int64) + slots)
    out.append(TouchedRows(rows, counts, valid, num))
  return out


def sample_untouched_rows(touched: TouchedRows, num_rows: int, rate: float,
                          capacity: int, seed: tf.Tensor):
  """The untouched rows whose noisy count passes the threshold, exactly.

  Each of the `M = num_rows - U` untouched rows is selected independently
  with probability `rate`; sampled through Geometric(rate) gaps in the rank
  space of the untouched rows (module docstring), O(capacity).

  Args:
    touched: the table's `TouchedRows`.
    num_rows: V.
    rate: p, `false_positive_rate(tau, sigma_sel C_sel)`.
    capacity: K (static), e.g. `false_positive_capacity(V, p)`.
    seed: a stateless seed, `[2]` int.

  Returns:
    `(rows [K] int64, valid [K] bool)`: the selected untouched rows in
    increasing order in the valid slots (row 0 in the others).
  """
  if capacity == 0 or rate <= 0:
    return tf.zeros([0], tf.int64), tf.zeros([0], tf.bool)
  m = tf.cast(num_rows, tf.int64) - touched.num
  if rate >= 1:
    ranks = tf.range(capacity, dtype=tf.int64)
  else:
    u = tf.random.stateless_uniform([capacity], seed=seed, dtype=tf.float64,
                                  alg=_ALG)
    gaps = tf.floor(tf.math.log1p(-u) / math.log1p(-rate))
    # Positions beyond V (and float64's exact integers) cannot be selected.
    gaps = tf.minimum(gaps, float(num_rows))
    ranks = tf.cast(tf.cumsum(gaps + 1.0) - 1.0, tf.int64)
  valid = ranks < m
  ranks = tf.where(valid, ranks, tf.zeros_like(ranks))
  # The r-th untouched row is r + #{i : t_i - i <= r}.
  below = touched.rows - tf.range(tf.size(touched.rows, out_type=tf.int64))
  rows = ranks + tf.searchsorted(below, ranks, side="right",
                                 out_type=tf.int64)
  return tf.where(valid, rows, tf.zeros_like(rows)), valid


class Selection(NamedTuple):
  """The rows selected in one table, as fixed-size arrays.

  Attributes:
    rows: `[N + K]` int64 rows; the first N slots are increasing (DP-AdaFEST:
      the touched rows with their sentinels, then the sampled untouched
      rows; DP-FEST: the fixed rows, N = K').
    selected: `[N + K]` bool: whether the slot's row is selected.
    gradient_rows: `[N]`, the increasing first slots, onto which the
      clipped sum's rows are mapped (a row not among them is dropped).
  """
  rows: tf.Tensor
  selected: tf.Tensor
  gradient_rows: tf.Tensor


def select_rows(touched: TouchedRows, num_rows: int, threshold: float,
                stddev: float, capacity: int, seed: tf.Tensor) -> Selection:
  """DP-AdaFEST's selection for one table: `count + N(0, stddev^2) > tau`.

  The touched rows' counts are noised explicitly; the untouched rows that
  pass are sampled by `sample_untouched_rows` (exact up to the capacity
  overflow, module docstring).

  Args:
    touched: from `touched_rows`.
    num_rows: V.
    threshold: tau.
    stddev: sigma_sel * C_sel (0: no noise, deterministic threshold).
    capacity: K for the untouched rows (static).
    seed: a stateless `[2]` seed (two sub-seeds are derived).

  Returns:
    The table's `Selection`.
  """
  seeds = tf.random.experimental.stateless_split(
      tf.cast(seed, tf.int64), num=2, alg=_ALG)
  noise = tf.random.stateless_normal(tf.shape(touched.counts), seed=seeds[0],
                                     stddev=stddev, dtype=tf.float32,
                                     alg=_ALG)
  passed = tf.logical_and(touched.valid, touched.counts + noise > threshold)
  rate = false_positive_rate(threshold, stddev)
  fp_rows, fp_valid = sample_untouched_rows(touched, num_rows, rate,
                                            capacity, seeds[1])
  return Selection(tf.concat([touched.rows, fp_rows], 0),
                   tf.concat([passed, fp_valid], 0), touched.rows)


def fixed_selection(rows) -> Selection:
  """DP-FEST's selection: the fixed rows (sorted, distinct), all selected."""
  rows = tf.constant(rows, tf.int64)
  return Selection(rows, tf.ones(tf.shape(rows), tf.bool), rows)


def noisy_selected_rows(clipped_sum: tf.IndexedSlices, selection: Selection,
                        stddev, seed: tf.Tensor, scale=None,
                        compact: bool = True) -> tf.IndexedSlices:
  """`scale * (clipped_sum + N(0, stddev^2))` on the selected rows only.

  Args:
    clipped_sum: the table's clipped gradient sum, `IndexedSlices`
      (repeated indices add up); rows not in `selection.gradient_rows` are
      dropped.
    selection: the table's `Selection`.
    stddev: the noise std on each selected entry (one replica's share).
    seed: a stateless `[2]` seed.
    scale: optional factor (1 / the batch divisor).
    compact: keep only the selected slots (dynamic shape; eager and graph
      mode). Without (XLA), every slot is returned and an unselected slot
      holds value 0 at the index of a selected row (row 0 if none): adding
      0 leaves its row bit-for-bit unchanged under SGD.

  Returns:
    `tf.IndexedSlices` over the selected rows, values of `clipped_sum`'s
    dtype, dense shape that of the table.
  """
  values = clipped_sum.values
  dtype = values.dtype
  width = tf.shape(values)[1:]
  grid = selection.gradient_rows
  n = tf.size(grid)
  flat = tf.reshape(values, tf.concat([[-1], [tf.reduce_prod(width)]], 0))
  index = tf.cast(clipped_sum.indices, tf.int64)
  pos = tf.minimum(tf.searchsorted(grid, index, side="left",
                                   out_type=tf.int32), n - 1)
  # A row outside the grid (DP-FEST: not a fixed row) gets slot -1, which
  # unsorted_segment_sum drops.
  pos = tf.where(tf.equal(tf.gather(grid, pos), index), pos, -1)
  keep = selection.selected
  if compact:
    # Only the selected slots are summed and noised: the noise is drawn
    # for |S| rows, not for the N + K slots (most touched rows are not
    # selected; drawing their noise was most of the step's cost).
    slot = tf.cumsum(tf.cast(keep, tf.int32)) - 1
    slot = tf.where(keep, slot, -1)
    pos = tf.where(pos >= 0, tf.gather(slot, tf.maximum(pos, 0)), -1)
    out_rows = tf.boolean_mask(selection.rows, keep)
    rows_sum = tf.math.unsorted_segment_sum(flat, pos, tf.size(out_rows))
  else:
    rows_sum = tf.math.unsorted_segment_sum(flat, pos, n)
    total = tf.size(selection.rows)
    rows_sum = tf.concat(
        [rows_sum, tf.zeros(tf.stack([total - n, tf.shape(flat)[1]]),
                            dtype)], 0)
  noise = tf.random.stateless_normal(tf.shape(rows_sum), seed=seed,
                                     dtype=tf.float32, alg=_ALG)
  noisy = rows_sum + tf.cast(noise * tf.cast(stddev, tf.float32), dtype)
  if scale is not None:
    noisy = noisy * tf.cast(scale, dtype)
  if compact:
    out_values = noisy
  else:
    first = tf.argmax(tf.cast(keep, tf.int32), output_type=tf.int32)
    pad = tf.where(tf.reduce_any(keep), selection.rows[first],
                   tf.constant(0, tf.int64))
    out_rows = tf.where(keep, selection.rows, pad)
    out_values = tf.where(keep[:, None], noisy, tf.zeros_like(noisy))
  out_values = tf.reshape(out_values, tf.concat([[-1], width], 0))
  return tf.IndexedSlices(out_values, out_rows, clipped_sum.dense_shape)


# ---------------------------------------------------------------------------
# The settings.
# ---------------------------------------------------------------------------


def _check_real(name, value, minimum=0.0, strict=False):
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or
      not math.isfinite(value) or value < minimum or
      (strict and value == minimum)):
    bound = ">" if strict else ">="
    raise ValueError(f"{name} must be a finite number {bound} {minimum}; "
                     f"got {value!r}.")
  return float(value)


class _SparseRows(mechanisms.NoiseMechanism):
  """What DP-FEST and DP-AdaFEST share: which tables are sparse, and the
  step's sparse release.

  As a `tf_pxg.dp.mechanisms.NoiseMechanism` (`noise_mechanism=` of a DP
  model or `DPOptimizer`): `prepare` (called by the train step after the
  clipped sums, before the logical step's accumulation) reads the ids each
  example gathers from the tape; `add` noises the sparse tables' selected
  rows and gives the other variables DP-SGD's dense noise
  (`IndependentGaussian`). `side_multipliers` is the selection's share of
  the accounted sigma; `dp_event` is DP-SGD's with the accounted sigma
  (module docstring).
  """

  stateful = False
  supports_xla = True

  def prepare(self, tape, variables, *, state=None, batch_size, mask=None,
              step_end=None, xla=False):
    """Reads the step's sparse tables from `tape` (see `SparseStep`), before
    it computes the clipped sums; the following `add` in the same trace
    uses it. A custom loop calls `prepare` after the forward pass, then
    `tape.clipped_gradient_sum`, then `add`. `state` (a
    `tf_pxg.dp.step_state.StepState`) holds the counts accumulator of
    Poisson steps (`step_end` given)."""
    self._pending = SparseStep(self, state, tape, variables, batch_size,
                               mask, step_end, xla)
    return self._pending

  def add(self, clipped_sum, state, step, *, noise_multiplier, l2_norm_clip,
          num_replicas, source, normalizer=None, write=None):
    del step, write
    self._check_step(num_replicas, source)
    pending = getattr(self, "_pending", None)
    if pending is None:
      raise ValueError(
          f"{self!r}.add needs the recorded batch: call prepare(tape, ...) "
          "first, before the tape's gradient (the Keras train step "
          "does).")
    sums = list(clipped_sum)
    scale = (None if normalizer is None else
             1.0 / tf.cast(normalizer, tf.float64))
    stddev = dp_noise.replica_noise_stddev(
        (noise_multiplier or 0.0) * tf.cast(l2_norm_clip, tf.float32),
        num_replicas)
    out = pending.privatize(sums, gradient_stddev=stddev, seed_source=source,
                            num_replicas=num_replicas, scale=scale)
    if pending.accumulated:
      # The step's noise sits in a conditional whose other branch is
      # dense: a dense update that is 0 off the selected rows (adding 0
      # leaves those rows bit-for-bit unchanged under SGD).
      out = [dp_noise.densify(g) if i in pending.indices else g
             for i, g in enumerate(out)]
    rest = [i for i in range(len(sums)) if i not in pending.indices]
    if rest:
      dense, _ = mechanisms.IndependentGaussian().add(
          [sums[i] for i in rest], None, None,
          noise_multiplier=noise_multiplier, l2_norm_clip=l2_norm_clip,
          num_replicas=num_replicas, source=source, normalizer=normalizer)
      for i, g in zip(rest, dense):
        out[i] = g
    return out, state

  def dp_event(self, noise_multiplier):
    """One participation: the selection and the gradient together are one
    Gaussian with the accounted sigma (module docstring)."""
    return dp_accounting.GaussianDpEvent(noise_multiplier)

  def sparse_tables(self, tape, variables, batch_size):
    """`{index: ids per use}` for the variables updated sparsely: those
    that only gathers read on `tape` (their clipped sum is then
    `IndexedSlices`). Call it before the tape computes a gradient (a
    non-persistent tape drops its recording then)."""
    tables = {}
    for i, v in enumerate(variables):
      uses = gather_ids(tape, v, batch_size)
      if uses is not None:
        tables[i] = uses
    return tables

  def _check_sum(self, s, variable, uses):
    """The table's clipped sum has one row per recorded id."""
    if not isinstance(s, tf.IndexedSlices):
      return
    count = sum(u.shape.num_elements() or 0 for u in uses)
    if (s.indices.shape.num_elements() is not None and
        all(u.shape.is_fully_defined() for u in uses) and
        count != s.indices.shape.num_elements()):
      raise ValueError(
          f"{type(self).__name__}: the clipped sum of '{variable.name}' has "
          f"{s.indices.shape.num_elements()} rows but its recorded gathers "
          f"have {count} ids: the table is read by an op this selection "
          "does not follow. Read embedding tables only through gathers "
          "(keras.layers.Embedding, tf.gather).")

  def _selections(self, tables, variables, mask, seed):
    raise NotImplementedError

  def _check_step(self, num_replicas, seed_source):
    del num_replicas  # R > 1: `SparseStep.privatize` selects globally.
    if not isinstance(seed_source, tf.random.Generator):
      raise NotImplementedError(
          f"{type(self).__name__} draws from a tf.random.Generator; the "
          f"noise source is {type(seed_source).__name__} (secure mode is "
          "not supported for sparse embedding noise yet).")

  def gradient_noise_multiplier(self, noise_multiplier: float,
                                *other_multipliers: float) -> float:
    """sigma_g for the accounted sigma, given the releases' sensitivity-1
    multipliers (the selection's first; the split is
    `tf_pxg.dp.releases.gradient_noise_multiplier`, the plan's)."""
    return releases.gradient_noise_multiplier(noise_multiplier, [
        releases.MechanismRelease(
            f"{self!r}'s selection", m,
            "Raise selection_noise_multiplier above noise_multiplier (a few "
            "times it leaves most of the budget to the gradient).")
        for m in other_multipliers], repr(self))


class DPAdaFEST(_SparseRows):
  """DP-AdaFEST: each step's rows chosen by a noisy, thresholded count.

  Ghazi et al. 2023, Algorithm 2 (module docstring). Give it to a DP model
  as `noise_mechanism=DPAdaFEST(...)`: every trainable table that only
  gathers read (`keras.layers.Embedding`, `tf.gather`) is updated on the
  selected rows only; the other variables keep dense noise.

  Args:
    threshold: tau, in units of the clipped count (an example adds at most
      `selection_l2_norm_clip` in L2 over all rows).
    selection_noise_multiplier: sigma_sel: the count's noise std is
      `sigma_sel * selection_l2_norm_clip`. Its share of the accounted
      sigma is `sigma_sel^-2` (`gradient_noise_multiplier`); it must
      exceed the model's `noise_multiplier`. 0 only for a non-private run
      (noise_multiplier 0).
    selection_l2_norm_clip: C_sel > 0, the clip of each example's 0/1 row
      map over all sparse tables together.
    tail: the capacity overflow bound per table and step (module docstring).

  Raises:
    ValueError: an argument out of range.
  """

  def __init__(self, threshold: float, selection_noise_multiplier: float,
               selection_l2_norm_clip: float = 1.0,
               tail: float = TAIL_PROBABILITY):
    self.threshold = _check_real("threshold", threshold, -math.inf)
    self.selection_noise_multiplier = _check_real(
        "selection_noise_multiplier", selection_noise_multiplier)
    self.selection_l2_norm_clip = _check_real(
        "selection_l2_norm_clip", selection_l2_norm_clip, strict=True)
    self.tail = _check_real("tail", tail, strict=True)

  @property
  def selection_stddev(self) -> float:
    return self.selection_noise_multiplier * self.selection_l2_norm_clip

  @property
  def false_positive_rate(self) -> float:
    """An untouched row's probability of being selected."""
    return false_positive_rate(self.threshold, self.selection_stddev)

  def capacity(self, num_rows: int) -> int:
    return false_positive_capacity(num_rows, self.false_positive_rate,
                                   self.tail)

  def side_multipliers(self) -> tuple:
    """The selection's sensitivity-1 multiplier, for the sigma split."""
    return (self.selection_noise_multiplier,)

  def _selections(self, tables, variables, mask, seeds):
    order = sorted(tables)
    vocab = [int(variables[i].shape[0]) for i in order]
    touched = touched_rows([tables[i] for i in order], vocab,
                           self.selection_l2_norm_clip, mask)
    return [select_rows(t, v, self.threshold, self.selection_stddev,
                        self.capacity(v), s)
            for t, v, s in zip(touched, vocab, seeds)]

  def get_config(self) -> dict:
    return {"threshold": self.threshold,
            "selection_noise_multiplier": self.selection_noise_multiplier,
            "selection_l2_norm_clip": self.selection_l2_norm_clip,
            "tail": self.tail}

  def __repr__(self):
    return "DPAdaFEST(" + ", ".join(
        f"{k}={v!r}" for k, v in self.get_config().items()) + ")"

  def __eq__(self, other):
    return (type(other) is type(self) and
            self.get_config() == other.get_config())

  def __hash__(self):
    return hash(tuple(self.get_config().items()))


def _table_key(variable) -> str:
  return getattr(variable, "path", None) or variable.name


class DPFEST(_SparseRows):
  """DP-FEST: a fixed, public set of rows per table gets the noisy update.

  Ghazi et al. 2023 (module docstring). The rows must come from public or
  prior information (never from the private training data): then the
  release is DP-SGD's Gaussian mechanism on fixed coordinates, accounted as
  DP-SGD (no budget share). Rows outside the set are never updated.

  Args:
    rows: `{table: row ids}`, the table named by its variable's `path`
      (Keras 3, e.g. "model/embedding/embeddings") or a trailing part of
      it ("embedding/embeddings"), or its `name`.

  Raises:
    ValueError: a row set that is empty, not integers, or out of range
      (checked when the step is built); a sparse table without a set.
  """

  def __init__(self, rows: Mapping[str, Sequence[int]]):
    self.rows: Dict[str, np.ndarray] = {}
    for key, value in dict(rows).items():
      arr = np.unique(np.asarray(value).reshape(-1))
      if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"DPFEST: the rows of '{key}' must be a non-empty "
                         f"set of integer row ids; got {value!r}.")
      self.rows[str(key)] = arr.astype(np.int64)

  def side_multipliers(self) -> tuple:
    return ()

  def _selections(self, tables, variables, mask, seeds):
    del mask, seeds
    out = []
    for i in sorted(tables):
      key, vocab = _table_key(variables[i]), int(variables[i].shape[0])
      # A key names the table by its path or a trailing part of it
      # ("table/embeddings" for "dp_sequential/table/embeddings").
      match = [k for k in self.rows if key == k or key.endswith("/" + k)]
      if len(match) == 1:
        key = match[0]
      if key not in self.rows:
        raise ValueError(
            f"DPFEST has no row set for the sparse table '{key}' (it has "
            f"{sorted(self.rows)}). Give one for every table that only "
            "gathers read.")
      rows = self.rows[key]
      if rows[0] < 0 or rows[-1] >= vocab:
        raise ValueError(f"DPFEST: the rows of '{key}' must be in "
                         f"[0, {vocab}); got {rows[0]}..{rows[-1]}.")
      out.append(fixed_selection(rows))
    return out

  def get_config(self) -> dict:
    return {"rows": {k: v.tolist() for k, v in self.rows.items()}}

  def __repr__(self):
    return "DPFEST(" + ", ".join(
        f"{k}: {len(v)} rows" for k, v in self.rows.items()) + ")"


# ---------------------------------------------------------------------------
# The train step's stage (tf_pxg.keras._train_step.dp_gradients).
# ---------------------------------------------------------------------------


def dense_adaptive_rows(total: tf.Tensor, counts: tf.Tensor, threshold: float,
                        selection_stddev: float, gradient_stddev, seed,
                        scale=None, compact: bool = True,
                        gradient_seed=None):
  """DP-AdaFEST on dense accumulated sums (a logical step of several
  physical batches): every row's count noised and thresholded, O(V).

  Exactly the mechanism of `select_rows` + `noisy_selected_rows` (no
  sampler needed: all rows are noised). With `compact`, `IndexedSlices` of
  the selected rows; without (XLA), a dense tensor that is 0 on the rows
  not selected (a 0 update leaves them bit-for-bit unchanged under SGD).
  `seed` draws the selection noise and, unless `gradient_seed` is given
  (a replica's own seed, when `seed` is common to the replicas), the
  gradient noise.
  """
  seeds = tf.random.experimental.stateless_split(
      tf.cast(seed, tf.int64), num=2, alg=_ALG)
  if gradient_seed is not None:
    seeds = tf.stack([seeds[0], tf.cast(gradient_seed, tf.int64)])
  noisy = counts + tf.random.stateless_normal(
      tf.shape(counts), seed=seeds[0], stddev=selection_stddev,
      dtype=counts.dtype, alg=_ALG)
  selected = noisy > threshold
  dtype = total.dtype
  if compact:
    rows = tf.cast(tf.reshape(tf.where(selected), [-1]), tf.int64)
    values = tf.gather(total, rows)
  else:
    rows, values = None, total
  noise = tf.random.stateless_normal(tf.shape(values), seed=seeds[1],
                                     dtype=tf.float32, alg=_ALG)
  values = values + tf.cast(noise * tf.cast(gradient_stddev, tf.float32),
                            dtype)
  if scale is not None:
    values = values * tf.cast(scale, dtype)
  if compact:
    return tf.IndexedSlices(values, rows, tf.shape(total, out_type=tf.int64))
  keep = tf.reshape(selected, [-1] + [1] * (total.shape.rank - 1))
  return tf.where(keep, values, tf.zeros_like(values))


def _dense_counts(touched: TouchedRows, num_rows: int) -> tf.Tensor:
  """A table's `[V]` counts from its `TouchedRows` (sentinels dropped)."""
  rows = tf.where(touched.valid, touched.rows, tf.zeros_like(touched.rows))
  counts = tf.where(touched.valid, touched.counts,
                    tf.zeros_like(touched.counts))
  return tf.scatter_nd(rows[:, None], counts, [num_rows])


def _counts_accumulator(state, num_rows: Sequence[int]):
  """The run's accumulator of the selection counts of a logical step (one
  `[V]` float32 sum per sparse table), kept in its `StepState`.

  Raises:
    ValueError: no `StepState` (Poisson batches outside a DPOptimizer).
  """
  if state is None:
    raise ValueError(
        "DP-AdaFEST on Poisson batches accumulates its selection counts "
        "over a logical step in the DPOptimizer's step state: compile the "
        "model with a tf_pxg.keras.DPOptimizer (a DP model's compile does "
        "so).")
  return state.accumulator(
      "sparse_selection_counts",
      [tf.TensorSpec([v], tf.float32) for v in num_rows])


class SparseStep:
  """One DP step's sparse-table stage, in two calls around the noise.

  The constructor (after the forward pass, before the tape's gradient)
  finds the sparse tables and their touched rows (for a Poisson step:
  their selection counts, accumulated in the run's `StepState`);
  `privatize` (after the step's accumulation, where the noise goes)
  returns their noisy rows and which sums it took, so that the dense noise
  skips them.
  """

  def __init__(self, config: "_SparseRows", state, tape, variables,
               batch_size, mask=None, step_end=None, xla: bool = False):
    self.config = config
    self.tables = config.sparse_tables(tape, variables, batch_size)
    self.order = sorted(self.tables)
    self.variables = variables
    self.vocab = [int(variables[i].shape[0]) for i in self.order]
    self.xla = xla
    self.accumulated = step_end is not None
    self.touched = None
    self.counts = None
    if not self.order or isinstance(config, DPFEST):
      return
    self.touched = touched_rows([self.tables[i] for i in self.order],
                                self.vocab, config.selection_l2_norm_clip,
                                mask)
    if self.accumulated:
      self.counts = _counts_accumulator(state, self.vocab).step(
          [_dense_counts(t, v) for t, v in zip(self.touched, self.vocab)],
          step_end, branchless=xla)

  @property
  def indices(self) -> set:
    """The positions (in `variables`) of the sparse tables."""
    return set(self.order)

  def privatize(self, sums, *, gradient_stddev, seed_source,
                num_replicas=1, scale=None):
    """`sums` with the sparse tables' entries replaced by their noisy,
    scaled rows (`IndexedSlices`, or under XLA with accumulation a dense
    tensor that is 0 off the selected rows).

    With R > 1 replicas (called in the replica context, `gradient_stddev`
    the replica's share sigma_g C / sqrt(R)): DP-AdaFEST's selection is
    computed once for the global batch on every replica (the replicas'
    touched rows all-gathered and merged, `merge_touched_rows`; the
    selection noise drawn from replica 0's seed), so all replicas hold the same S and its noise is added once;
    each replica then noises its own sum on S with its share, and the
    optimizer's all-reduce adds the shares: N(0, (sigma_g C)^2) in all.

    Raises:
      NotImplementedError: R > 1 outside a replica context or with
        accumulated (Poisson) steps, or a noise source that is not a
        `tf.random.Generator` (secure mode).
    """
    if not self.order:
      return list(sums)
    self.config._check_step(num_replicas, seed_source)  # pylint: disable=protected-access
    for i in self.order:
      self.config._check_sum(sums[i], self.variables[i], self.tables[i])  # pylint: disable=protected-access
    out = list(sums)
    seeds = tf.unstack(seed_source.make_seeds(2 * len(self.order)), axis=1)
    if isinstance(self.config, DPFEST):
      # Fixed rows: each replica adds its share of the noise to its sum on
      # them (the all-reduce adds the shares), as for a dense variable.
      selections = self.config._selections(  # pylint: disable=protected-access
          self.tables, self.variables, None, None)
      for i, sel, seed in zip(self.order, selections, seeds[1::2]):
        s = sums[i]
        if not isinstance(s, tf.IndexedSlices):  # accumulated: dense
          s = tf.IndexedSlices(tf.gather(s, sel.rows), sel.rows,
                               tf.shape(s, out_type=tf.int64))
        out[i] = noisy_selected_rows(s, sel, gradient_stddev, seed,
                                     scale=scale, compact=not self.xla)
      return out
    config = self.config
    replica = _replica_context(num_replicas, type(config).__name__)
    # The selection is one release for the global batch: its seeds are
    # common to the replicas (replica 0's), its touched rows and counts
    # the replicas' merged, so that every replica computes the same S with the noise
    # added once. The gradient noise's seeds stay the replica's own: each
    # adds an independent share N(0, (sigma_g C)^2 / R).
    select_seeds = _common(replica, tf.stack(seeds[::2]))
    touched, counts = self.touched, self.counts
    if replica is not None and self.accumulated:
      # The all-reduce of the replicas' accumulated counts would make it
      # exact, but the counts accumulator's replica-local variables
      # under a strategy are not tested yet: refused rather than assumed.
      raise NotImplementedError(
          f"{type(config).__name__} with {num_replicas} replicas and "
          "Poisson (or accumulated) steps is not supported yet: use plain "
          "batches under the strategy (fit(sampling='shuffled'), "
          "train_on_batch, strategy.run(model.train_step)), or one "
          "replica.")
    if replica is not None:
      touched = [merge_touched_rows(_all_gather(replica, t), v)
                 for t, v in zip(touched, self.vocab)]
    for k, (i, v) in enumerate(zip(self.order, self.vocab)):
      if self.accumulated:
        out[i] = dense_adaptive_rows(
            tf.convert_to_tensor(sums[i]), counts[k], config.threshold,
            config.selection_stddev, gradient_stddev, select_seeds[k],
            scale=scale, compact=not self.xla,
            gradient_seed=None if replica is None else seeds[2 * k + 1])
        continue
      sel = select_rows(touched[k], v, config.threshold,
                        config.selection_stddev, config.capacity(v),
                        select_seeds[k])
      out[i] = noisy_selected_rows(sums[i], sel, gradient_stddev,
                                   seeds[2 * k + 1], scale=scale,
                                   compact=not self.xla)
    return out


def _replica_context(num_replicas, name):
  """The replica context of an R > 1 step (None for one replica).

  Raises:
    NotImplementedError: R > 1 outside a replica context (the selection
      must see every replica's batch).
  """
  if num_replicas <= 1:
    return None
  ctx = tf.distribute.get_replica_context()
  if ctx is None or ctx.num_replicas_in_sync != num_replicas:
    raise NotImplementedError(
        f"{name} with {num_replicas} replicas must run in the strategy's "
        "replica context (strategy.run, or Keras' fit under the strategy "
        "scope): the row selection sums every replica's counts.")
  return ctx


def _common(replica, value):
  """`value` of replica 0 on every replica (None: one replica)."""
  if replica is None:
    return value
  first = tf.equal(replica.replica_id_in_sync_group, 0)
  return replica.all_reduce(tf.distribute.ReduceOp.SUM,
                            tf.where(first, value, tf.zeros_like(value)))


def _all_gather(replica, touched: TouchedRows) -> TouchedRows:
  """The replicas' `TouchedRows` of one table, concatenated (`[R N]`)."""
  gather = lambda t: replica.all_gather(t, axis=0)  # noqa: E731
  # (all_gather takes no bool.)
  valid = tf.cast(gather(tf.cast(touched.valid, tf.int32)), tf.bool)
  return TouchedRows(gather(touched.rows), gather(touched.counts), valid,
                     replica.all_reduce(tf.distribute.ReduceOp.SUM,
                                        touched.num))


def merge_touched_rows(parts: TouchedRows, num_rows: int) -> TouchedRows:
  """One table's `TouchedRows` from the concatenated `TouchedRows` of
  several batches (the replicas' shares of a global batch).

  A row's count is the sum of its counts in the parts (the clip weight of
  an example is computed where the example is, over all its rows: the
  sum is the global batch's count). O(R N log(R N)), independent of V.

  Args:
    parts: `TouchedRows` whose fields are the parts' concatenated (each
      part's valid slots first, `num` ignored).
    num_rows: V.

  Returns:
    The merged `TouchedRows`, of the same static size.
  """
  size = tf.size(parts.rows, out_type=tf.int64)
  slots = tf.range(size, dtype=tf.int64)
  vocab = tf.cast(num_rows, tf.int64)
  # Distinct sentinels above every real row: sorted after them.
  keys = tf.where(parts.valid, parts.rows, vocab + slots)
  order = tf.argsort(keys, stable=True)
  keys = tf.gather(keys, order)
  counts = tf.gather(tf.where(parts.valid, parts.counts,
                              tf.zeros_like(parts.counts)), order)
  new = tf.concat([tf.ones([1], tf.bool),
                   tf.not_equal(keys[1:], keys[:-1])], 0)
  seg = tf.cumsum(tf.cast(new, tf.int64)) - 1
  num = tf.reduce_sum(tf.cast(tf.logical_and(new, keys < vocab), tf.int64))
  valid = slots < num
  counts = tf.math.unsorted_segment_sum(counts, seg, size)
  rows = tf.math.unsorted_segment_max(keys, seg, size)
  rows = tf.where(valid, rows, vocab + slots)
  counts = tf.where(valid, counts, tf.zeros_like(counts))
  return TouchedRows(rows, counts, valid, num)
