"""Per-example clipping: flat L2 clipping (Abadi et al. 2016) and the
clipping policies `Flat`, `Automatic` (Bu et al. 2022),
`QuantileAdaptive` (Andrew et al. 2021) and `PerLayer` (a bound per group
of variables, McMahan et al. 2018), public as `tf_pxg.clipping`.

Non-finite examples. An example whose gradient norm (or, in
`tf_pxg.GradientTape.clipped_gradient_sum`, whose per-example target, e.g.
its loss) is NaN or inf gets clip factor 0, and every weighted sum selects
its rows to exactly 0 (`tf_pxg.rules.base.scale_examples`: a select, not a
multiply, since `0 * NaN = NaN`). Its contribution to the clipped sum is
then exactly 0 and the other examples' contributions are unchanged, so the
sum's L2 sensitivity to adding or removing one example stays at most the
clip C whatever that example holds, and DP-SGD's Gaussian noise covers it.

The alternative, skipping the whole update when any example is non-finite,
is not private: whether the weights move would depend on one example (a
planted NaN-producing record reveals whether it was sampled), a change of
unbounded size that no noise covers.

Policies by name. `POLICIES` maps names to policy classes ("flat",
"automatic", "quantile_adaptive", "per_layer"); `register(name, cls)` (or
`@register(name)`) adds one, with the idiom and the errors of every part
(`tf_pxg.parts.add`), and `get(name)` builds it with its defaults (the
built-in policies' modules, `tf_pxg.parts.BUILTIN_MODULES`, are imported
first if the name is not yet known). This module imports nothing of
tf_pxg but `tf_pxg.dp.releases` and `tf_pxg.parts`, which import nothing
of tf_pxg (the tape API clips with `clip_factors`, below the DP layer,
tests/test_import_graph.py).
"""

import math
from typing import Optional

import tensorflow as tf

from tf_pxg import parts
from tf_pxg.dp import releases

# Norms below this are treated as this, so zero gradients get factor 1.
_TINY = 1e-12


def clip_factors(norms, l2_norm_clip):
  """`c_b = min(1, l2_norm_clip / ||g_b||)` for `[B]` norms; 0 where the
  norm is NaN or inf.

  Scaling example b's gradient by `c_b` leaves it unchanged when its norm is
  at most the clip and otherwise gives it norm exactly `l2_norm_clip`.
  An infinite clip gives ones for finite norms. A non-finite norm gives 0
  (by a select), and the weighted sums drop that example exactly (see the
  module doc).
  """
  norms = tf.convert_to_tensor(norms)
  clip = tf.cast(l2_norm_clip, norms.dtype)
  factors = tf.minimum(tf.ones_like(norms),
                       clip / tf.maximum(norms, tf.cast(_TINY, norms.dtype)))
  return tf.where(tf.math.is_finite(norms), factors, tf.zeros_like(factors))


# Clipping policies ------------------------------------------------------------
#
# A policy turns the `[B]` norms and the clip (a Python float or a scalar
# tensor, e.g. the adaptive clip's variable) into `[B]` factors. Each
# example's scaled gradient has norm at most the clip, so the L2
# sensitivity of the clipped sum to adding or removing one example is the
# clip whatever the policy, and the Gaussian noise `sigma * clip` covers it.


class ClippingPolicy:
  """How per-example gradients are scaled before they are summed.

  The protocol (every member tf_pxg reads, with the defaults of a
  non-adaptive policy): `factors(norms, clip)`, returning `[B]` factors
  with `factor_b * ||g_b|| <= clip` for every finite norm and 0 for a
  non-finite one, `side_releases(expected_batch_size)` and
  `get_config()`. An adaptive policy (`adaptive` True) moves the clip: its
  clip is a `tf.Variable` held by the `tf_pxg.keras.DPOptimizer`
  (initialised to the plan's `l2_norm_clip`), the state of the one side
  release it returns with `drives_clip` True (a
  `tf_pxg.dp.releases.SideRelease`: a noisy statistic of each step's
  batch, its `next_state` the next clip, e.g. `QuantileCount`); the plan
  splits σ over the policy's releases with the others'. A grouped policy
  (`grouped` True: `PerLayer`) clips each group of variables to its own
  bound instead (`assign`, `group_bounds`, `group_factors`, read by
  `tf_pxg.GradientTape.group_clipped_gradient_sum`; `noise_scales` by
  the step's noise). The policies are small, immutable settings objects.

  Attributes:
    name: the policy's registered name (`serialize` saves it; `register`
      sets it on the class).
    adaptive: whether the clip moves (a variable, driven by one of its
      `side_releases`).
  """

  name = "policy"
  adaptive = False

  def factors(self, norms, clip):
    """`[B]` factors for `[B]` norms and the clip (class docstring)."""
    raise NotImplementedError

  def side_releases(self, expected_batch_size: Optional[float]) -> tuple:
    """The private side releases each step makes for this policy (a tuple
    of `tf_pxg.dp.releases.SideRelease`; how many must not depend on
    `expected_batch_size`, B of the run's sampler, None for a plain
    batch). Default: none."""
    del expected_batch_size
    return ()

  def get_config(self) -> dict:
    """The constructor's arguments (JSON-able)."""
    return {}

  def __eq__(self, other):
    return type(self) is type(other) and self.get_config() == other.get_config()

  def __hash__(self):
    return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
    return f"{type(self).__name__}({args})"


#: Names -> policy classes (`register` adds one; module docstring).
POLICIES = {}
_KIND = "clipping policy"


def _not_a_policy(cls) -> Optional[str]:
  if isinstance(cls, type) and issubclass(cls, ClippingPolicy):
    return None
  return "not a subclass of tf_pxg.clipping.ClippingPolicy."


def register(name: str, policy_class: Optional[type] = None, *,
             override: bool = False):
  """Registers a `ClippingPolicy` class under `name` in `POLICIES` (the
  idiom of every part, `tf_pxg.parts.add`) and sets its `name`, which
  `serialize` saves. Usable as a decorator, `@register("my_policy")`.

  Raises:
    ValueError: `name` is taken by another class (pass `override=True`),
      or the class is not a `ClippingPolicy` subclass.
  """
  def add(cls):
    parts.add(POLICIES, _KIND, name, cls, override=override,
              check=_not_a_policy)
    cls.name = name
    return cls
  return add if policy_class is None else add(policy_class)


@register("flat")
class Flat(ClippingPolicy):
  """Flat L2 clipping to a fixed norm C (Abadi et al. 2016): the default."""

  def factors(self, norms, clip):
    return clip_factors(norms, clip)


@register("automatic")
class Automatic(ClippingPolicy):
  """Automatic clipping (Bu et al. 2022): `factor_b = R / (||g_b|| + gamma)`.

  Every example is normalised (no clip threshold to tune); its scaled
  gradient has norm `R ||g_b|| / (||g_b|| + gamma) < R`, so the sensitivity
  is R, the model's (or DPOptimizer's) `l2_norm_clip`, and the noise std is
  `noise_multiplier * R`. With plain SGD, R only rescales the learning rate;
  `R = 1` is the paper's choice. A non-finite norm gets factor 0.

  Args:
    stability: gamma > 0, the stability constant (default 0.01, the paper's).

  References:
    Bu, Wang, Zha, Karypis, "Automatic Clipping: Differentially Private Deep
    Learning Made Easier and Stronger", NeurIPS 2023 (arXiv 2206.07136).
  """

  def __init__(self, stability: float = 0.01):
    stability = float(stability)
    if not (math.isfinite(stability) and stability > 0):
      raise ValueError(f"Automatic clipping: stability must be finite and "
                       f"> 0; got {stability!r}.")
    self.stability = stability

  def factors(self, norms, clip):
    norms = tf.convert_to_tensor(norms)
    clip = tf.cast(clip, norms.dtype)
    factors = clip / (norms + tf.cast(self.stability, norms.dtype))
    return tf.where(tf.math.is_finite(norms), factors, tf.zeros_like(factors))

  def get_config(self):
    return {"stability": self.stability}


@register("quantile_adaptive")
class QuantileAdaptive(ClippingPolicy):
  """Adaptive clipping to a private quantile of the norms (Andrew et al. 2021).

  Each step clips at the current C_t (flat clipping) and also releases a
  noisy count: every example of the step contributes
  `1[||g_b|| <= C_t] - 1/2` (sensitivity 1/2), and the sum gets
  `N(0, count_stddev^2)` noise once per global step. With the step's
  divisor n (the expected batch size qN of a Poisson step, the batch size of
  a plain batch), `b~ = noisy_count / n + 1/2` estimates the fraction of
  examples within the clip, and

    C_{t+1} = C_t * exp(-learning_rate * (b~ - target_quantile)),

  the geometric update, so C moves towards the `target_quantile` quantile of
  the norms. C_t lives in a `tf.Variable` (no retracing; saved with the
  optimizer; logged as `l2_norm_clip`). The initial C is the model's (or
  DPOptimizer's) `l2_norm_clip`.

  Privacy (Andrew et al., Theorem 1). The step releases the clipped sum with
  noise `sigma_g C_t` (sensitivity C_t) and the count with noise
  `count_stddev` (sensitivity 1/2): two Gaussian mechanisms on the same
  sample, whose composition is exactly one Gaussian mechanism with
  `sigma^-2 = sigma_g^-2 + (2 count_stddev)^-2` (Renyi divergences of
  Gaussians add in 1/sigma^2, and so do their subsampled versions, as the
  pair is one Gaussian in a space with an extra coordinate). The model's
  `noise_multiplier` is that accounted sigma; the gradient noise uses
  `sigma_g = (sigma^-2 - (2 count_stddev)^-2)^-1/2`
  (`tf_pxg.accounting.split_noise_multipliers`), so the ε that
  `tf_pxg.accounting` and `PrivacyCallback` report for `noise_multiplier`
  covers both releases. Requires `2 count_stddev > sigma` when sigma > 0.

  Args:
    target_quantile: gamma in [0, 1], the fraction of examples that should
      be unclipped (default 0.5, the median).
    learning_rate: eta > 0 of the geometric update (default 0.2).
    count_stddev: the count's noise std; default `expected_batch_size / 20`
      (Andrew et al.'s choice), resolved when `fit` knows the expected batch
      size (give it explicitly for `train_on_batch` or custom loops).

  References:
    Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning
    with Adaptive Clipping", NeurIPS 2021 (arXiv 1905.03871).
  """

  adaptive = True

  def __init__(self, target_quantile: float = 0.5,
               learning_rate: float = 0.2,
               count_stddev: Optional[float] = None):
    target_quantile = float(target_quantile)
    learning_rate = float(learning_rate)
    if not 0.0 <= target_quantile <= 1.0:
      raise ValueError(f"QuantileAdaptive: target_quantile must be in "
                       f"[0, 1]; got {target_quantile!r}.")
    if not (math.isfinite(learning_rate) and learning_rate > 0):
      raise ValueError(f"QuantileAdaptive: learning_rate must be finite and "
                       f"> 0; got {learning_rate!r}.")
    if count_stddev is not None:
      count_stddev = float(count_stddev)
      if not (math.isfinite(count_stddev) and count_stddev >= 0):
        raise ValueError(f"QuantileAdaptive: count_stddev must be finite and "
                         f">= 0; got {count_stddev!r}.")
    self.target_quantile = target_quantile
    self.learning_rate = learning_rate
    self.count_stddev = count_stddev

  def factors(self, norms, clip):
    return clip_factors(norms, clip)

  def side_releases(self, expected_batch_size: Optional[float]) -> tuple:
    """Its count (`QuantileCount`), whose state is the clip."""
    return (QuantileCount(self, self.resolve_count_stddev(
        expected_batch_size)),)

  def resolve_count_stddev(self, expected_batch_size: Optional[float]) -> float:
    """`count_stddev`, or `expected_batch_size / 20` when not given."""
    if self.count_stddev is not None:
      return self.count_stddev
    if expected_batch_size is None:
      raise ValueError(
          "QuantileAdaptive clipping needs count_stddev (the noise std of "
          "the unclipped-example count) outside a Poisson `fit`, where the "
          "expected batch size B is unknown; pass e.g. "
          "QuantileAdaptive(count_stddev=B / 20).")
    return float(expected_batch_size) / 20.0

  def unclipped_count(self, norms, clip, mask=None):
    """`sum_b mask_b (1[||g_b|| <= C] - 1/2)`, float32 (sensitivity 1/2).

    A non-finite norm counts as clipped (-1/2), a data-independent rule
    whose contribution is still bounded by 1/2. `mask` excludes padding
    rows (0) of a Poisson physical batch.
    """
    norms = tf.cast(norms, tf.float32)
    within = tf.cast(norms <= tf.cast(clip, tf.float32), tf.float32) - 0.5
    if mask is not None:
      within = within * tf.cast(mask, tf.float32)
    return tf.reduce_sum(within)

  def next_clip(self, clip, noisy_count, normalizer):
    """`C exp(-eta (noisy_count / n + 1/2 - gamma))`, float32."""
    fraction = noisy_count / tf.cast(normalizer, tf.float32) + 0.5
    return tf.cast(clip, tf.float32) * tf.exp(
        -self.learning_rate * (fraction - self.target_quantile))

  def get_config(self):
    return {"target_quantile": self.target_quantile,
            "learning_rate": self.learning_rate,
            "count_stddev": self.count_stddev}


def _source_path(source, index: int) -> str:
  """A source's name for grouping: a Keras variable's `path`
  ("sequential/dense/kernel"), else a `tf.Variable`'s name without ":0",
  else `source_<index>`."""
  for attr in ("path", "name"):
    value = getattr(source, attr, None)
    if isinstance(value, str) and value:
      return value.split(":")[0]
  return f"source_{index}"


@register("per_layer")
class PerLayer(ClippingPolicy):
  """Per-layer (group-wise) clipping: each group of variables is clipped to
  its own bound C_g (McMahan et al. 2018; Opacus' "per_layer" clipping).

  The sources (the trainable variables) are split into G groups:
  `groups="layer"` (the default: variables whose paths agree up to the last
  "/" — a Keras layer's kernel and bias), `"variable"` (each variable its
  own group) or a callable `groups(variable) -> key` (variables with equal
  keys form one group; for `.keras` saving, a function registered with
  `keras.saving.register_keras_serializable`). Example b's gradient
  restricted to group g, `g_{b,g}`, is scaled by

    c_{b,g} = min(1, C_g / ||g_{b,g}||)     (0 for every g when any group's
                                            norm of b is NaN or inf),

  so `||c_{b,g} g_{b,g}|| <= C_g`. The G norms come from the engine's one
  backward pass (`PerExampleBackprop.group_sq_norms`, the same ghost-norm
  terms as flat clipping's, summed per group) and the sums from one
  weighted pass with each interface's group's factors
  (`PerExampleBackprop.group_weighted_sums`; a parameter tensor that feeds
  sources of several groups is materialised per example).

  Bounds. `bounds` gives relative weights w_g (None: all equal; a dict
  from group key to weight, where a key may also be the end of a group's
  path after a "/", e.g. "dense" for "sequential/dense"). They are scaled
  so that the plan's `l2_norm_clip` C is the total:

    C_g = C w_g / sqrt(sum_h w_h^2),   hence   sqrt(sum_g C_g^2) = C.

  Sensitivity. Adding or removing one example moves group g's clipped sum
  by at most C_g, on disjoint coordinates, so the whole clipped sum moves
  by at most sqrt(sum_g C_g^2) = C in L2: the flat clipping's sensitivity,
  and everything downstream (accounting, accumulation, replicas, side
  releases' split of sigma) is unchanged.

  Noise (`noise_allocation`):

  * "isotropic" (default; Opacus' choice): std sigma C on every
    coordinate, one Gaussian mechanism of sensitivity C and multiplier
    sigma, exactly as flat clipping's noise (the same program);
  * "per_group": std sigma_g = sigma C_g sqrt(G) on group g's coordinates
    (noise proportional to the group's bound, as in McMahan et al.'s
    per-layer DP-FedAvg). Scaling group g by 1/sigma_g gives noise of std
    1 and a sensitivity of C_g / sigma_g = 1 / (sigma sqrt(G)) per group,
    so the total sensitivity is sqrt(sum_g C_g^2 / sigma_g^2) =
    sqrt(G / (sigma^2 G)) = 1 / sigma: one Gaussian mechanism with noise
    multiplier sigma (sum_g C_g^2 / sigma_g^2 = 1 / sigma^2), accounted as
    the flat step. The step adds it through the plan's noise mechanism by
    scaling group g's sum by a_g = C / (C_g sqrt(G)) before the mechanism
    adds sigma C and by 1 / a_g after (`noise_scales`); with equal bounds
    a_g = 1 and the two allocations coincide.

  A noise mechanism that acts on the sums' values beyond adding noise
  (sparse selection's thresholds) sees group g scaled by a_g under
  "per_group".

  Automatic bounds (`target_quantile` given). Each group g keeps a private
  estimate s_g of the `target_quantile` γ of its per-example norms
  (Andrew et al. 2021, one per group): every step releases, per group,
  the count `sum_b (1[||g_{b,g}|| <= s_g] - 1/2)` (sensitivity 1/2) with
  Gaussian noise of std `count_stddev` (`GroupQuantileCount`), and
  `s_g <- s_g exp(-learning_rate (noisy_count / n + 1/2 - γ))`. The step
  clips at `C_g = C s_g / sqrt(sum_h s_h^2)`: bounds in the ratio of the
  groups' private quantiles, the total still the plan's C (so the
  gradient's sensitivity and noise are those above, "isotropic" only).
  The G counts are G Gaussian mechanisms on the same batch, each of
  multiplier 2 count_stddev, so they take their share of the accounted
  σ in the plan's one split (`tf_pxg.dp.releases`):
  `σ_g^-2 = σ^-2 - G (2 count_stddev)^-2`, and ε (for σ) covers the
  bounds; the update of s_g is post-processing. s_g starts at
  `C w_g / sqrt(sum w^2)` and is optimizer state (saved, logged as
  `clip_<group>`). `bounds` must name every group (its keys are the G
  groups, known before the model is built).

  Args:
    groups: "layer", "variable" or a callable (above).
    bounds: None or a dict of relative weights (above), each finite > 0.
    noise_allocation: "isotropic" or "per_group".
    target_quantile: None (fixed bounds) or γ in [0, 1] (automatic
      bounds, above).
    learning_rate: the update's rate (automatic bounds; default 0.2).
    count_stddev: each count's noise std (automatic bounds; default
      `expected_batch_size / 20`, as `QuantileAdaptive`).

  References:
    McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private
    Recurrent Language Models", ICLR 2018 (per-layer clipping, Sec. 3).
    Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning
    with Adaptive Clipping", NeurIPS 2021 (arXiv 1905.03871).
  """

  grouped = True

  def __init__(self, groups="layer", bounds=None,
               noise_allocation: str = "isotropic",
               target_quantile: Optional[float] = None,
               learning_rate: float = 0.2,
               count_stddev: Optional[float] = None):
    if isinstance(groups, dict):  # a serialised callable
      import keras  # noqa: PLC0415  (only for a saved function)
      groups = keras.saving.deserialize_keras_object(groups)
    if not (groups in ("layer", "variable") or callable(groups)):
      raise ValueError(f"PerLayer: groups must be 'layer', 'variable' or a "
                       f"callable variable -> key; got {groups!r}.")
    if bounds is not None:
      if not isinstance(bounds, dict):
        raise ValueError(f"PerLayer: bounds must be None or a dict of "
                         f"group -> relative weight; got {bounds!r}.")
      checked = {}
      for key, w in bounds.items():
        w = float(w)
        if not (math.isfinite(w) and w > 0):
          raise ValueError(f"PerLayer: the weight of group {key!r} must be "
                           f"finite and > 0; got {w!r}.")
        checked[str(key)] = w
      bounds = checked
    if noise_allocation not in ("isotropic", "per_group"):
      raise ValueError(f"PerLayer: noise_allocation must be 'isotropic' or "
                       f"'per_group'; got {noise_allocation!r}.")
    if target_quantile is not None:
      # The adaptive rule's checks (and its update, `next_clip`).
      self._quantile = QuantileAdaptive(target_quantile, learning_rate,
                                        count_stddev)
      if not bounds:
        raise ValueError(
            "PerLayer: adaptive bounds (target_quantile) need bounds= naming "
            "the groups, {group: initial relative weight}, so that the "
            "count releases (one per group) are known before the model is "
            "built.")
      if noise_allocation != "isotropic":
        raise ValueError(
            "PerLayer: adaptive bounds (target_quantile) take "
            "noise_allocation='isotropic' (noise sigma * C; per-group "
            "noise would follow the moving bounds).")
      target_quantile = self._quantile.target_quantile
      learning_rate = self._quantile.learning_rate
      count_stddev = self._quantile.count_stddev
    else:
      self._quantile = None
      learning_rate, count_stddev = float(learning_rate), count_stddev
    self.groups = groups
    self.bounds = bounds
    self.noise_allocation = noise_allocation
    self.target_quantile = target_quantile
    self.learning_rate = learning_rate
    self.count_stddev = count_stddev

  # Groups ---------------------------------------------------------------

  def group_keys(self, sources) -> list:
    """One group key (a string) per source, in order."""
    keys = []
    for i, v in enumerate(sources):
      if callable(self.groups):
        keys.append(str(self.groups(v)))
        continue
      path = _source_path(v, i)
      if self.groups == "variable":
        keys.append(f"{path}#{i}" if path in keys else path)
      else:
        keys.append(path.rsplit("/", 1)[0] if "/" in path else path)
    return keys

  def assign(self, sources):
    """`(group index per source, the G group keys in order)`. With
    adaptive bounds the groups are `bounds`' keys, in their order, each
    matching exactly one of the sources' groups (module docstring)."""
    keys = self.group_keys(sources)
    names = list(dict.fromkeys(keys))
    if self._quantile is not None:
      own = list(self.bounds)
      match = {n: self._bound_key(n, names) for n in names}
      used = list(match.values())
      if sorted(used) != sorted(own):
        raise ValueError(
            f"PerLayer: adaptive bounds need one bounds key per group; the "
            f"groups {names!r} match the keys {used!r}, bounds has {own!r}.")
      return [own.index(match[k]) for k in keys], own
    index = {k: g for g, k in enumerate(names)}
    return [index[k] for k in keys], names

  def _bound_key(self, name, names):
    hit = [k for k in self.bounds if k == name or name.endswith("/" + k)]
    if not hit:
      raise ValueError(
          f"PerLayer: no bound for the group {name!r}; bounds has "
          f"{sorted(self.bounds)!r}, the groups are {names!r}.")
    return max(hit, key=len)

  def weights(self, names) -> list:
    """w_g per group key (the `bounds` entry for the key or the key's
    last "/"-separated parts; 1.0 for all when `bounds` is None)."""
    if self.bounds is None:
      return [1.0] * len(names)
    return [self.bounds[self._bound_key(name, names)] for name in names]

  def group_bounds(self, names, clip, scales=None):
    """C_g = C w_g / sqrt(sum w^2), a `[G]` float32 tensor; with adaptive
    bounds, `scales` (the `[G]` private quantile estimates s_g) replace
    the weights: C_g = C s_g / sqrt(sum s^2)."""
    if scales is not None:
      scales = tf.cast(scales, tf.float32)
      return tf.cast(clip, tf.float32) * scales / tf.maximum(
          tf.norm(scales), _TINY)
    w = self.weights(names)
    total = math.sqrt(sum(x * x for x in w))
    rel = tf.constant([x / total for x in w], tf.float32)
    return rel * tf.cast(clip, tf.float32)

  def noise_scales(self, sources):
    """a_g = sqrt(sum w^2) / (w_g sqrt(G)) per source (Python floats) for
    "per_group" noise; None for "isotropic" (no scaling)."""
    if self.noise_allocation == "isotropic":
      return None
    if self._quantile is not None:
      raise ValueError(
          "PerLayer: adaptive bounds (target_quantile) take isotropic "
          "noise (noise_allocation='isotropic'): per-group noise would "
          "follow the moving bounds.")
    index, names = self.assign(sources)
    w = self.weights(names)
    total = math.sqrt(sum(x * x for x in w))
    a = [total / (x * math.sqrt(len(w))) for x in w]
    return [a[g] for g in index]

  # Factors --------------------------------------------------------------

  def group_factors(self, group_norms, bounds):
    """`[G, B]` factors `min(1, C_g / ||g_{b,g}||)` for `[G, B]` norms and
    `[G]` bounds; example b's column is 0 where any of its norms is not
    finite (a non-finite example is dropped from every group)."""
    group_norms = tf.convert_to_tensor(group_norms)
    bounds = tf.cast(bounds, group_norms.dtype)[:, None]
    f = tf.minimum(tf.ones_like(group_norms),
                   bounds / tf.maximum(group_norms,
                                       tf.cast(_TINY, group_norms.dtype)))
    finite = tf.reduce_all(tf.math.is_finite(group_norms), axis=0)
    return tf.where(finite[None, :], f, tf.zeros_like(f))

  def factors(self, norms, clip):
    """Flat factors for a `[B]` global norm (what a statistic of a single
    vector, e.g. a gradient canary, is clipped with: a vector within C is
    within the total bound)."""
    return clip_factors(norms, clip)

  # Adaptive bounds ------------------------------------------------------

  def side_releases(self, expected_batch_size: Optional[float]) -> tuple:
    """With adaptive bounds: one `GroupQuantileCount` per group (the
    order of `bounds`); else none."""
    if self._quantile is None:
      return ()
    std = self._quantile.resolve_count_stddev(expected_batch_size)
    return tuple(GroupQuantileCount(self, g, key, std)
                 for g, key in enumerate(self.bounds))

  def state_releases(self) -> tuple:
    """The releases whose state the `DPOptimizer` holds (the groups'
    quantile estimates), for building it before the batch size is
    known."""
    if self._quantile is None:
      return ()
    return tuple(GroupQuantileCount(self, g, key, 1.0)
                 for g, key in enumerate(self.bounds))

  def initial_scales(self, l2_norm_clip: float) -> list:
    """s_{g,0} = C w_g / sqrt(sum w^2): the initial bounds."""
    w = list(self.bounds.values())
    total = math.sqrt(sum(x * x for x in w))
    return [float(l2_norm_clip) * x / total for x in w]

  def get_config(self):
    groups = self.groups
    if callable(groups):
      import keras  # noqa: PLC0415  (only for a saved function)
      groups = keras.saving.serialize_keras_object(groups)
    config = {"groups": groups, "bounds": self.bounds,
              "noise_allocation": self.noise_allocation}
    if self._quantile is not None:
      config.update(target_quantile=self.target_quantile,
                    learning_rate=self.learning_rate,
                    count_stddev=self.count_stddev)
    return config

  def __hash__(self):
    return hash((type(self).__name__, repr(self.get_config())))


class _NoisyCount(releases.SideRelease):
  """A count of examples whose term is `1[...] - 1/2`: sensitivity 1/2 to
  adding or removing one example, noise std `count_stddev`, so its noise
  multiplier (std / sensitivity) is `2 count_stddev` (Andrew et al.
  2021)."""

  def __init__(self, count_stddev: float):
    self.count_stddev = float(count_stddev)
    self.noise_multiplier = 2.0 * self.count_stddev

  def sensitivity(self, clip) -> float:
    del clip
    return 0.5

  def stddev(self, clip) -> float:
    del clip
    return self.count_stddev


class QuantileCount(_NoisyCount):
  """Adaptive clipping's unclipped count (`tf_pxg.clipping.QuantileAdaptive`,
  Andrew et al. 2021): `sum_b mask_b (1[||g_b|| <= C_t] - 1/2)`,
  sensitivity 1/2, noise std `count_stddev` (multiplier `2 count_stddev`).
  Its state is the clip itself: `C_{t+1} = policy.next_clip(C_t, estimate)`
  (logged as `l2_norm_clip`), the clip the next step uses.

  Args:
    policy: the `QuantileAdaptive` policy.
    count_stddev: the count's noise std (resolved from the run's expected
      batch size when the policy does not fix it).
  """

  name = "l2_norm_clip"
  drives_clip = True

  def __init__(self, policy, count_stddev: float):
    self.policy = policy
    super().__init__(count_stddev)

  def statistic(self, batch: releases.ReleaseBatch) -> tf.Tensor:
    return self.policy.unclipped_count(batch.norms, batch.clip, batch.mask)

  def initial_state(self, l2_norm_clip: float) -> float:
    return float(l2_norm_clip)

  def next_state(self, state, estimate):
    return self.policy.next_clip(state, estimate, 1.0)

  def overuse_hint(self, noise_multiplier: float) -> str:
    return (f"{self.policy!r}: 2 * count_stddev ({self.noise_multiplier!r}) "
            f"must exceed noise_multiplier ({noise_multiplier!r}), else the "
            "count alone would use the whole budget; raise count_stddev "
            "(Andrew et al. use B / 20).")

  def get_config(self) -> dict:
    return {"policy": self.policy, "count_stddev": self.count_stddev}


class GroupQuantileCount(_NoisyCount):
  """Adaptive per-group bounds' count for group g (`PerLayer` with
  `target_quantile`): `sum_b mask_b (1[||g_{b,g}|| <= s_g] - 1/2)`,
  sensitivity 1/2, noise std `count_stddev` (multiplier
  `2 count_stddev`), its state s_g, the group's private γ-quantile
  estimate: `s_{g,t+1} = s_g exp(-eta (noisy_count / n + 1/2 - gamma))`
  (Andrew et al. 2021, per group). The G counts are G releases of the
  plan's one σ split (`tf_pxg.dp.releases`): σ_g⁻² = σ⁻² − G (2
  count_stddev)⁻², so ε covers them.

  Args:
    policy: the `PerLayer` policy.
    index: g, the group's place in `policy.bounds`.
    key: the group's `bounds` key (its log name is `clip_<key>`).
    count_stddev: the count's noise std.
  """

  def __init__(self, policy, index: int, key: str, count_stddev: float):
    self.policy = policy
    self.index = int(index)
    self.key = key
    self.name = "clip_" + "".join(ch if ch.isalnum() else "_" for ch in key)
    super().__init__(count_stddev)

  def statistic(self, batch: releases.ReleaseBatch) -> tf.Tensor:
    norms = tf.cast(batch.group_norms[self.index], tf.float32)
    scale = tf.cast(batch.group_scales[self.index], tf.float32)
    within = tf.cast(norms <= scale, tf.float32) - 0.5
    return tf.reduce_sum(within * tf.cast(batch.mask, tf.float32))

  def initial_state(self, l2_norm_clip: float) -> float:
    return self.policy.initial_scales(l2_norm_clip)[self.index]

  def next_state(self, state, estimate):
    return self.policy._quantile.next_clip(state, estimate, 1.0)  # noqa: SLF001

  def overuse_hint(self, noise_multiplier: float) -> str:
    return (f"{self.policy!r}: its {len(self.policy.bounds)} counts with "
            f"2 * count_stddev = {self.noise_multiplier!r} use the whole "
            f"budget of noise_multiplier={noise_multiplier!r} (they need "
            "2 * count_stddev > noise_multiplier * sqrt(G)); raise "
            "count_stddev.")

  def get_config(self) -> dict:
    return {"policy": self.policy, "index": self.index, "key": self.key,
            "count_stddev": self.count_stddev}

  def __hash__(self):
    return hash((type(self).__name__, self.index, self.key,
                 self.count_stddev))


def known_names() -> tuple:
  """The registered names (`POLICIES`' keys, the built-ins loaded)."""
  parts.load_builtins(_KIND)
  return tuple(POLICIES)


def get(identifier) -> ClippingPolicy:
  """A `ClippingPolicy` from None (flat), a registered name ("flat",
  "automatic", "quantile_adaptive", "norm_tracking", "per_layer", or one
  added with
  `register`; the built-ins' modules are imported first if the name is
  not yet known), a `{"class_name": ..., "config": ...}` dict (from
  `serialize`) or an instance.

  Raises:
    ValueError: anything else (the message lists the names).
  """
  if identifier is None:
    return Flat()
  if isinstance(identifier, ClippingPolicy):
    return identifier
  name = (identifier.get("class_name") if isinstance(identifier, dict) else
          identifier if isinstance(identifier, str) else None)
  if name is not None and name in known_names():
    config = identifier.get("config", {}) if isinstance(identifier,
                                                        dict) else {}
    return POLICIES[name](**config)
  names = ", ".join(repr(n) for n in known_names())
  raise ValueError(
      f"Unknown clipping policy {identifier!r}: use None or one of {names} "
      "(registered with tf_pxg.clipping.register), or an instance of a "
      "tf_pxg.clipping.ClippingPolicy such as Flat, Automatic or "
      "QuantileAdaptive.")


def serialize(policy: ClippingPolicy) -> dict:
  """A JSON-able dict that `get` turns back into `policy`."""
  return {"class_name": policy.name, "config": policy.get_config()}
