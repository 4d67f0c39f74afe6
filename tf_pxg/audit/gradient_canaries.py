"""Gradient canaries: per-example gradients set directly, inside the train step.

White-box canaries for auditing the DP mechanism itself (Steinke, Nasr and
Jagielski 2023, §6; Andrew et al. 2024). Canary i is a unit of the data set
whose per-example gradient is *given*: `g_i = norm · u_i`, with `u_i` a unit
direction in the flat space of the model's trainable variables (in
`model.trainable_variables` order):

* `direction="dirac"`: `u_i = ±e_j` on a random coordinate j (distinct
  coordinates for distinct canaries; needs m ≤ the parameter count);
* `direction="random"`: `u_i` uniform on the sphere (dense; m may exceed
  the parameter count, at the price of cross-talk `<u_i, u_k> ~ 1/√d`).

**Signs.** A canary's gradient flips sign from step to step (`signs`,
replayed by the scorer), so that the real examples' slow drift along its
direction does not add up in its score.

**Where they enter.** `attach` sets `add_gradient_canaries` as the DP step's
clipped-sum hook (in the DPOptimizer's `tf_pxg.dp.step_state.StepState`;
keras does not import audit), and the train step's clip stage
(`tf_pxg.dp.step.clip`) calls it right after the real examples'
clipped sum:
each sampled canary's gradient is scaled by the model's own clipping policy
(`factor(norm, clip)`, so `norm ≥ C` gives a contribution of norm exactly C
under flat clipping, and the full `norm` when clipping is broken), added to
the sums, and from there follows the real path: logical-step accumulation,
the noise (independent or BandMF's correlated noise), the division by the
batch size, the strategy's all-reduce (only replica 0 adds canaries, so each
is added once per step) and the optimizer. Nothing is copied. Under
adaptive clipping the canaries do not enter the noisy unclipped count
(their norm is given, not data): they audit the gradient release only.

**Sampling: what the accountant assumes.** DP-SGD's ε is for a unit that
joins each logical step independently with probability q (Poisson; with
BandMF's b bands: only the steps of its group, i mod b, each with
probability q). A canary that is "in" is sampled exactly that way, with the
coins drawn per logical step from a stateless generator keyed by (seed,
`optimizer.iterations`), so it is a unit of the accounted mechanism and the
claimed ε covers it. (Adding it at every step would audit a different, far
less private mechanism — T unsubsampled Gaussian releases — and flag a
correct run.) A canary that is "out" is never added. The sampling
probability is given, not read from the batch: pass the q the accountant
uses (`tf_pxg.accounting.sampling_probability`).

**Cost when unused.** Without canaries the hook is None (`detach` clears
it) and the train step does not call it; `add_gradient_canaries` itself
returns the sums unchanged, at trace time, when the model has no canaries
attached. The traced step is then the same graph as without the hook.

**How this differs from input canaries** (`CanaryCallback.out_of_distribution`,
`mislabelled`): an input canary is an example; its influence on the released
model depends on what the network makes of it (its gradient norm, how much
of it survives training), so its scores measure memorisation by this model
and give lower bounds far below ε for a correct run. A gradient canary
skips the model: its clipped contribution lands in the noisy sum with its
full sensitivity, which is DP-SGD's worst case, so its scores measure the
mechanism (clip, noise, sampling, accounting) and the bound of a correct
run can approach the claimed ε.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from tf_pxg import _renamed

__all__ = ["GradientCanaries", "add_gradient_canaries", "attach", "detach",
           "signs"]

_DIRECTIONS = ("dirac", "random")


class GradientCanaries:
  """m gradient canaries: directions, norm, inclusion, sampling.

  Args:
    m: the number of canaries.
    norm: each canary's gradient norm (≥ the clip, so that clipping acts on
      it: a run without clipping then shows a contribution of `norm`).
    sampling_probability: q, per logical step, as accounted.
    min_separation: b of BandMF's cyclic sampling (1: DP-SGD); `num_bands`
      is its deprecated name.
    direction: "dirac" or "random" (module docstring).
    seed: seeds inclusion, directions and sampling (tests); default OS
      entropy.

  Attributes:
    included: bool `[m]`, each True with probability 1/2.
    groups: int `[m]`, each canary's cyclic group (all 0 for b = 1).
  """

  num_bands = _renamed.alias("num_bands", "min_separation")

  def __init__(self, m: int, norm: float, sampling_probability: float, *,
               min_separation: int = 1, direction: str = "dirac",
               seed: Optional[int] = None, num_bands=_renamed.NOT_GIVEN):
    min_separation, arg = _renamed.argument(
        min_separation, num_bands, new="min_separation", old="num_bands",
        where="GradientCanaries", default=1)
    if m < 2:
      raise ValueError(f"need at least 2 gradient canaries; got m={m}.")
    if not (math.isfinite(norm) and norm > 0):
      raise ValueError(f"norm must be finite and > 0; got {norm!r}.")
    if not 0 < sampling_probability <= 1:
      raise ValueError(f"sampling_probability must be in (0, 1] (the q the "
                       f"accountant uses); got {sampling_probability!r}.")
    if direction not in _DIRECTIONS:
      raise ValueError(f"direction must be one of {_DIRECTIONS}; got "
                       f"{direction!r}.")
    if min_separation < 1:
      raise ValueError(f"{arg} must be >= 1; got {min_separation!r}.")
    self.m, self.norm = int(m), float(norm)
    self.sampling_probability = float(sampling_probability)
    self.min_separation, self.direction = int(min_separation), direction
    self._rng = np.random.default_rng(seed)
    self.included = self._rng.random(m) < 0.5
    self.groups = self._rng.integers(0, min_separation, m)
    self.sampling_seed = int(self._rng.integers(0, 2**31 - 1))
    self.sign_seed = int(self._rng.integers(0, 2**31 - 1))
    self.indices = self.values = None   # set by `directions`
    self.traced = False                 # set when a train step includes them
    self.tf_values = None               # random directions, as a variable

  def directions(self, num_params: int):
    """Draws the directions in a space of `num_params` coordinates (once).

    Dirac: `indices` and `values` `[m, 1]` (coordinate, sign); random:
    `indices` None and `values` the `[m, num_params]` unit rows.
    """
    if self.values is not None:
      if self._num_params != num_params:
        raise ValueError(f"these canaries were drawn for {self._num_params} "
                         f"parameters; the model has {num_params}.")
      return self.indices, self.values
    self._num_params = num_params
    if self.direction == "dirac":
      if self.m > num_params:
        raise ValueError(f"{self.m} Dirac canaries need as many distinct "
                         f"coordinates; the model has {num_params} (use "
                         "direction='random' or fewer canaries).")
      self.indices = self._rng.choice(num_params, self.m,
                                      replace=False)[:, None]
      self.values = self._rng.choice([-1.0, 1.0], (self.m, 1))
    else:  # dense [m, num_params] float32: m d values
      self.indices = None
      v = self._rng.standard_normal((self.m, num_params), dtype=np.float32)
      self.values = v / np.linalg.norm(v, axis=1, keepdims=True)
    return self.indices, self.values

  def project(self, flat_deltas: np.ndarray) -> np.ndarray:
    """`[T, num_params]` (or `[num_params]`) flat vectors → their
    projections on the canary directions, `[T, m]` (or `[m]`)."""
    x = np.asarray(flat_deltas, dtype=np.float64)
    if self.direction == "dirac":
      return x[..., self.indices[:, 0]] * self.values[:, 0]
    return (x.astype(np.float32) @ self.values.T).astype(np.float64)


def attach(model, canaries: GradientCanaries):
  """Makes `model`'s train step add `canaries` (it is re-traced)."""
  num_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
  canaries.directions(num_params)
  if canaries.direction == "random" and canaries.tf_values is None:
    import tensorflow as tf  # noqa: PLC0415
    # A variable, not a constant: m d floats need not live in the graph.
    canaries.tf_values = tf.Variable(canaries.values, trainable=False,
                                     name="gradient_canary_directions")
  state = _step_state(model)
  state.audit = canaries
  # The train step calls this hook (it does not import audit).
  state.clipped_sum_hook = functools.partial(add_gradient_canaries, model)
  _retrace(model)


def detach(model):
  """Removes the canaries (the next `fit` traces a step without them)."""
  state = _step_state(model, required=False)
  if state is not None and state.audit is not None:
    state.audit = state.clipped_sum_hook = None
    _retrace(model)


def _step_state(model, required: bool = True):
  """The `tf_pxg.dp.step_state.StepState` of the DPOptimizer `model` is
  compiled with, where the canaries and the step's hook are kept.

  Raises:
    ValueError: (`required`) the model has no DPOptimizer.
  """
  from tf_pxg.keras import optimizers  # noqa: PLC0415
  optimizer = optimizers.dp_optimizer_of(getattr(model, "optimizer", None))
  if optimizer is None:
    if not required:
      return None
    raise ValueError(
        f"gradient canaries go into the DP train step of a tf_pxg DP model "
        f"compiled with DP settings; {getattr(model, 'name', model)!r} has "
        "no DPOptimizer (compile a DPModel, DPSequential, make_private(...) "
        "or make_dp_model_class(...) model first).")
  return optimizer.step_state


def _retrace(model):
  # Keras builds the train function when `fit` starts (after the callbacks'
  # `set_model`) unless one exists: dropping it makes the next `fit` trace
  # a step that sees the current canaries.
  model.train_function = None


def add_gradient_canaries(model, sums, variables, info, clip, clipping=None):
  """The train step's hook: `sums` plus this step's sampled canaries.

  Called by `dp_gradients` right after the real examples' clipped sum
  (module docstring). Returns `sums` itself when `model` has no canaries.

  Args:
    model: the Keras model being trained.
    sums: the clipped sums, one per variable (dense or `IndexedSlices`).
    variables: `model.trainable_variables`.
    info: the Poisson batch's `tf_pxg.data.BatchInfo`, or None (a plain
      batch: one step).
    clip: the clip in use (float or scalar tensor).
    clipping: the `tf_pxg.dp.clipping` policy (None: flat).

  Returns:
    The sums with the canaries added at the physical batch that ends a
    logical step.
  """
  state = _step_state(model, required=False)
  canaries = None if state is None else state.audit
  if canaries is None:
    return sums
  import tensorflow as tf  # noqa: PLC0415
  from tf_pxg.dp import clipping as dp_clipping  # noqa: PLC0415
  from tf_pxg.dp import noise as dp_noise  # noqa: PLC0415

  canaries.traced = True
  optimizer = model.optimizer
  optimizer = getattr(optimizer, "inner_optimizer", optimizer)
  step = tf.cast(optimizer.iterations, tf.int64)
  add = _sampled(canaries, step)
  if info is not None:  # once per logical step: at the batch that ends it
    add = tf.logical_and(add, info.step_end)
  replica = tf.distribute.get_replica_context()
  if replica is not None:  # the all-reduce sums replicas: add on one only
    add = tf.logical_and(add, tf.equal(replica.replica_id_in_sync_group, 0))
  policy = clipping if clipping is not None else dp_clipping.Flat()
  norms = tf.fill([canaries.m], tf.constant(canaries.norm, tf.float32))
  scale = policy.factors(norms, tf.cast(clip, tf.float32)) * norms
  coef = tf.where(add, scale * signs(canaries, step),
                  tf.zeros_like(scale))                          # [m]
  flat = _scatter(canaries, coef, sum(int(np.prod(v.shape))
                                      for v in variables))
  out, start = [], 0
  for s, v in zip(sums, variables):
    size = int(np.prod(v.shape))
    piece = tf.reshape(flat[start:start + size], v.shape)
    out.append(dp_noise.densify(s) + tf.cast(piece, v.dtype))
    start += size
  return out


def signs(canaries, step):
  """float32 `[m]` of ±1: each canary's sign at logical step `step`.

  A canary's gradient at step t is `sign_t · norm · u_i`, the sign drawn
  from a stateless generator keyed by (seed, t) that the scorer replays.
  Any gradient of norm ≤ C at each step is a legitimate unit for DP-SGD's
  guarantee (it holds for adaptively chosen gradients), so the claim covers
  it. The score multiplies step t's projection by the same sign: the
  canary's own contributions add up, while the real examples' gradient
  along u_i — a slow drift that does not follow the signs — averages out
  instead of adding to the sum (on the digits CNN at ε = 8 this drift was
  about 0.6 of the noise over a run).
  """
  import tensorflow as tf  # noqa: PLC0415
  bits = tf.random.stateless_uniform(
      [canaries.m], seed=tf.stack([tf.constant(canaries.sign_seed, tf.int64),
                                   tf.cast(step, tf.int64)]))
  return tf.where(bits < 0.5, -1.0, 1.0)


def _sampled(canaries, step):
  """bool `[m]`: the included canaries that Poisson sampling puts in logical
  step `step` (coins from (seed, step); BandMF: only the step's group)."""
  import tensorflow as tf  # noqa: PLC0415
  coins = tf.random.stateless_uniform(
      [canaries.m], seed=tf.stack([tf.constant(canaries.sampling_seed,
                                               tf.int64), step]))
  take = tf.logical_and(coins < canaries.sampling_probability,
                        tf.constant(canaries.included))
  if canaries.min_separation > 1:
    group = tf.math.floormod(step, canaries.min_separation)
    take = tf.logical_and(take, tf.equal(
        tf.constant(canaries.groups, tf.int64), group))
  return take


def _scatter(canaries, coef, num_params):
  """`Σ_i coef_i u_i` as a flat `[num_params]` float32 vector."""
  import tensorflow as tf  # noqa: PLC0415
  if canaries.direction == "random":
    return tf.tensordot(coef, canaries.tf_values, 1)
  values = tf.constant(canaries.values[:, 0], tf.float32)
  return tf.scatter_nd(tf.constant(canaries.indices, tf.int64),
                       values * coef, [num_params])
