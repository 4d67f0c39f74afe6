"""The framework-free stages of a DP step: clip, accumulate, privatize.

A DP step over one physical batch is, after the forward pass (a framework's
job: `tf_pxg.keras._train_step.forward_losses` for Keras, a custom loop's
own code under a `tf_pxg.GradientTape`):

1. `clip`: per-example clipping in one backward pass
   (`tf_pxg.GradientTape.clipped_gradient_sum` with the plan's policy), and
   the side releases' statistics on the same batch;
2. `accumulate`: a Poisson logical step's running totals over its physical
   batches (`tf_pxg.dp.step_state.StepState`); a plain batch passes;
3. `privatize`: the noise, once per logical step: the noise mechanism on
   the gradient sums with σ_g, each side release's Gaussian on its sum.

What they compose is `StepParts`, built from the one `tf_pxg.dp.plan.DPPlan`
(`DPPlan.step_noise` derives the multipliers; `StepParts.stateless` for a
custom loop whose plan keeps no state). The Keras DP step
(`tf_pxg.keras._train_step`) and a custom loop run these same functions;
what is Keras' (the compiled loss, the step limit, the optimizer's apply)
stays there. Derivations: the clipping (`tf_pxg.dp.clipping`), the noise
once per logical step divided by the expected batch size
(`tf_pxg.dp.accumulation`), the side releases' share of σ
(`tf_pxg.dp.releases`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tf_pxg.dp import noise as dp_noise
from tf_pxg.dp import releases as releases_lib

__all__ = ["Clipped", "StepParts", "accumulate", "clip", "privatize"]


class StepParts(NamedTuple):
  """The DP plan's parts one step composes; always all present (the
  default clipping is `Flat`, the default mechanism `IndependentGaussian`).

  Built from the plan (`tf_pxg.dp.plan.DPPlan.step_noise` derives the
  multipliers): by a DP model from its `DPOptimizer`'s plan and state, or
  by `stateless` for a custom loop; the stages read nothing else.

  Attributes:
    clipping: the `tf_pxg.clipping` policy.
    clip: the clip in use: the plan's `l2_norm_clip` (a float), or the
      adaptive clip's state variable.
    noise_multiplier: σ, the accounted multiplier (0: no noise, the side
      releases are then not noised either).
    gradient_noise_multiplier: σ_g, the gradient's share of σ after the
      side releases' (`tf_pxg.dp.releases`).
    noise: the `tf_pxg.dp.mechanisms.NoiseMechanism`; the step calls its
      `prepare` and `add` and nothing else about it.
    noise_state: its state (held by the `DPOptimizer`), or None.
    step_index: the step counter (a Keras optimizer's `iterations`), which
      a stateful mechanism indexes its noise by; None for a stateless one.
    releases: the step's own `tf_pxg.dp.releases.SideRelease`s.
    release_states: their state variables (held by the `DPOptimizer`), one
      per release, None for a stateless one (`NoisyLoss`).
    step_state: the run's `tf_pxg.dp.step_state.StepState` (the
      `DPOptimizer`'s): the logical step's accumulators and an audit's
      clipped-sum hook.
  """
  clipping: Any
  clip: Any
  noise_multiplier: float
  gradient_noise_multiplier: float
  noise: Any
  noise_state: Any
  step_index: Any
  releases: tuple = ()
  release_states: tuple = ()
  step_state: Any = None

  def clip_value(self):
    """The clip as a tensor or float (the variable's value if adaptive)."""
    return (self.clip.read_value() if isinstance(self.clip, tf.Variable)
            else self.clip)


  @classmethod
  def stateless(cls, plan, expected_batch_size: Optional[float] = None
                ) -> "StepParts":
    """The parts of a plan that keeps no state (flat or automatic clipping,
    a stateless mechanism, no side releases), for a custom loop; B is the
    expected batch size of its Poisson sampler (None: plain batches).

    Raises:
      ValueError: the plan keeps state (an adaptive clip, BandMF's
        buffers, a side release's state): train it with a
        `tf_pxg.keras.DPOptimizer`, which holds that state.
    """
    noise = plan.mechanism
    step_noise = plan.step_noise(expected_batch_size)
    if plan.clipping.adaptive or noise.stateful or step_noise.releases:
      raise ValueError(
          f"StepParts.stateless: the plan (clipping={plan.clipping!r}, "
          f"noise_mechanism={plan.noise_mechanism!r}, side releases "
          f"{step_noise.releases!r}) keeps state between steps; a "
          "tf_pxg.keras.DPOptimizer holds it (DPModel / make_private), or "
          "use flat clipping, independent noise and no side releases.")
    return cls(plan.clipping, plan.l2_norm_clip, plan.noise_multiplier or 0.0,
               step_noise.gradient, noise, None, None)


class Clipped(NamedTuple):
  """The clip stage's result: this physical batch's clipped sums (one per
  variable, then one per side release) and the per-example norms."""
  sums: list
  norms: tf.Tensor
  finite: tf.Tensor


def clip(tape, target, losses, variables, info, parts: StepParts, *,
         gradient_scale=None, xla: bool = False) -> Clipped:
  """Stage 1: per-example clipping in one backward pass
  (`tape.clipped_gradient_sum` with the plan's policy), then the side
  releases' statistics on the same batch (un-noised sums, appended after
  the variables' sums).

  Args:
    tape: the `tf_pxg.GradientTape` that recorded the forward pass.
    target: `[B]` what the backward pass differentiates (`losses`, or the
      losses times a loss scale).
    losses: `[B]` per-example (per-unit) losses, padding rows constant.
    variables: the trainable variables.
    info: the batch's `tf_pxg.data.BatchInfo` (`BatchInfo.plain(B)` for a
      plain batch).
    parts: the `StepParts`.
    gradient_scale: the loss scale `target / losses`, or None.
    xla: the step is compiled with XLA (a mechanism's `prepare` reads it).
  """
  clip_value = parts.clip_value()
  # A mechanism may read the recorded batch before the gradient drops it
  # (sparse embedding rows: the ids each example gathers,
  # tf_pxg.dp.sparse_selection); a no-op for the others.
  parts.noise.prepare(
      tape, variables, state=parts.step_state,
      batch_size=tf.shape(losses)[0],
      mask=None if info.is_plain else info.mask, step_end=info.step_end,
      xla=xla)
  # A non-finite example's clip factor is 0 there: nothing to check here.
  group_norms = group_scales = None
  if getattr(parts.clipping, "grouped", False):
    # Per-layer clipping: its adaptive bounds' states (the groups' quantile
    # estimates, `tf_pxg.clipping.GroupQuantileCount`) set the bounds.
    states = [state.read_value() for r, state in
              zip(parts.releases, parts.release_states)
              if getattr(r, "policy", None) is parts.clipping and
              hasattr(r, "key")]
    group_scales = tf.stack(states) if states else None
    sums, norms, group_norms = tape.group_clipped_gradient_sum(
        target, variables, clip_value, parts.clipping,
        gradient_scale=gradient_scale, group_scales=group_scales)
  else:
    sums, norms = tape.clipped_gradient_sum(
        target, variables, clip_value, clipping=parts.clipping,
        gradient_scale=gradient_scale)
  # An embedding's sum stays `IndexedSlices` up to the noise, which adds
  # its rows inside the fused noise loop (tf_pxg.dp.threefry).
  sums = [tf.zeros_like(v) if s is None else s
          for s, v in zip(sums, variables)]
  # Audits only: gradient canaries join the clipped sum through the hook
  # `tf_pxg.audit.gradient_canaries.attach` sets in the step state (none
  # attached: `sums` unchanged at trace time).
  hook = None if parts.step_state is None else \
      parts.step_state.clipped_sum_hook
  if hook is not None:
    sums = hook(sums, variables, None if info.is_plain else info, clip_value,
                parts.clipping)
  finite = tf.logical_and(tf.math.is_finite(losses),
                          tf.math.is_finite(norms))
  batch = releases_lib.ReleaseBatch(losses, norms, clip_value,
                                    tf.cast(info.mask, tf.float32), finite,
                                    group_norms, group_scales)
  statistics = [r.statistic(batch) for r in parts.releases]
  return Clipped(sums + statistics, norms, finite)


def accumulate(clipped: Clipped, info, variables, parts: StepParts, *,
               xla: bool = False) -> list:
  """Stage 2: a Poisson logical step's running totals over its physical
  batches (the `StepState`'s gradient accumulator, made for `variables`
  and the step's side releases); a plain batch is a whole step, passed
  through.

  Raises:
    ValueError: a Poisson batch without a `StepState` (a custom loop over
      Poisson batches needs one: `tf_pxg.dp.step_state.StepState()`).
  """
  if info.is_plain:
    return clipped.sums
  if parts.step_state is None:
    raise ValueError(
        "accumulate: a Poisson physical batch (a sampler's BatchInfo) "
        "accumulates its logical step in a StepState; give the StepParts "
        "one (parts._replace(step_state=tf_pxg.dp.step_state.StepState())) "
        "and keep it for the run.")
  accumulator = parts.step_state.accumulator("gradient", variables,
                                             len(parts.releases))
  return accumulator.step([dp_noise.densify(s) for s in clipped.sums],
                          info.step_end, branchless=xla)


def privatize(parts: StepParts, totals: list, info, generator, *,
              write=None, num_replicas: int = 1, xla: bool = False,
              variables=None):
  """Stage 3: the noise, drawn once per logical step (at its end, or at
  every physical batch under XLA, used only at the end): `noise.add` on
  the gradient sums with σ_g, and each side release's Gaussian on its
  sum. Under R replicas each adds its `1/sqrt(R)` share (the all-reduce
  sums them: `tf_pxg.dp.noise.replica_noise_stddev`).

  The divisor is known here for a Poisson step (qN) or the only replica's
  plain batch: the mechanism divides in its noise pass (one pass over the
  weights fewer); otherwise the caller divides by the all-reduced batch
  size. With no noise the sums are not divided here (the caller divides
  them where it applies them).

  Args:
    parts: the `StepParts`.
    totals: the logical step's sums (`accumulate`'s).
    info: the batch's `BatchInfo`.
    generator: the noise generator (`tf_pxg.dp.noise.make_generator`); the
      mechanism picks the source it draws from (secure mode: OS keys).
    write: scalar bool, whether this step is applied (a stateful
      mechanism writes its state only then; data-independent), or None.
    num_replicas: R.
    xla: the step is compiled with XLA (selects instead of conditionals).
    variables: the trainable variables of `totals`' sums, which a
      policy's noise allocation reads (`tf_pxg.clipping.PerLayer`'s
      "per_group" noise: the mechanism adds σ_g·C to `a_v` times each sum,
      divided by `a_v` after, so variable v gets σ_g·C / a_v); unused
      otherwise.

  Returns:
    `(noisy sums, the divisor left to the caller or None, the noisy side
    releases)`.
  """
  draw = None if xla else info.step_end
  source = parts.noise.noise_source(generator)
  count = len(parts.releases)
  sums, tail = totals[:len(totals) - count], totals[len(totals) - count:]
  clip_value = parts.clip_value()
  released = tuple(
      _noisy_scalar(value, r.stddev(clip_value) if parts.noise_multiplier
                    else None, source, num_replicas, draw)
      for r, value in zip(parts.releases, tail))
  divide = bool(parts.noise_multiplier) and (not info.is_plain or
                                             num_replicas == 1)
  normalizer = info.normalizer if divide else None

  allocation = getattr(parts.clipping, "noise_scales", None)
  scales = None
  if allocation is not None and parts.noise_multiplier:
    if variables is None and parts.clipping.noise_allocation != "isotropic":
      raise ValueError(
          f"privatize: {parts.clipping!r} allocates the noise per group of "
          "variables; pass variables= (the variables of the sums).")
    scales = allocation(variables) if variables is not None else None

  def noisy():
    scaled = sums if scales is None else [
        _scaled(g, a) for g, a in zip(sums, scales)]
    out = parts.noise.add(
        scaled, parts.noise_state, parts.step_index,
        noise_multiplier=parts.gradient_noise_multiplier,
        l2_norm_clip=clip_value, num_replicas=num_replicas, source=source,
        normalizer=normalizer, write=write)[0]
    if scales is None:
      return out
    return [_scaled(g, 1.0 / a) for g, a in zip(out, scales)]

  if draw is None:
    out = noisy()
  else:
    out = tf.cond(draw, noisy, lambda: [
        tf.cast(dp_noise.densify(g), parts.noise.noise_dtype(g.dtype))
        for g in sums])
  return out, None if divide else info.normalizer, released


def _scaled(g, a: float):
  """`a * g` for a dense tensor or `IndexedSlices` (`g` itself if a = 1)."""
  if a == 1.0:
    return g
  if isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(g.values * tf.cast(a, g.values.dtype), g.indices,
                            g.dense_shape)
  return g * tf.cast(a, g.dtype)


def _noisy_scalar(value, stddev, generator, replicas, draw):
  """`value + N(0, stddev^2 / R)`: this replica's share of a noisy released
  scalar, e.g. the count (drawn only when `draw` is true or None). A
  `stddev` of None or a Python 0 adds nothing (no noise: σ = 0); a tensor
  (a release in units of an adaptive clip) always adds."""
  if stddev is None or (not tf.is_tensor(stddev) and not stddev):
    return value
  share = dp_noise.replica_noise_stddev(stddev, replicas)
  add = lambda: dp_noise.add_gaussian_noise(  # noqa: E731
      [tf.reshape(value, [1])], share, generator=generator)[0][0]
  if draw is None:
    return add()
  return tf.cond(draw, add, lambda: tf.identity(value))
