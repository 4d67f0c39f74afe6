"""The DP mechanism's state held by a `DPOptimizer`: adaptive clip, noise
buffers.

`DPState` is a `tf.Module` (so `tf.train.Checkpoint` of the optimizer
tracks its variables) whose variables the `DPOptimizer` also lists in
`variables` (so Keras' `.keras` saving stores them). It is built with the
optimizer, in the strategy scope Keras builds optimizers in:

- `clip`: float32 scalar, the current clip of `QuantileAdaptive`
  clipping (initialised to `l2_norm_clip`; `ONLY_FIRST_REPLICA`
  aggregation: every replica computes the same update from the all-reduced
  noisy count);
- `noise`: the noise mechanism's state (`NoiseMechanism.init_state`, e.g.
  `tf_pxg.dp.correlated.NoiseBuffers` for BandMF with b > 1, `ON_READ`/
  `SUM`: each replica holds its share), None for a stateless mechanism;
- `group_seed`: int64, for a mechanism whose event needs cyclic
  participation in b > 1 groups (`min_separation`), drawn from OS entropy when the optimizer
  is created: it keys cyclic Poisson sampling's assignment of examples to
  the b groups (`tf_pxg.data.PoissonSampler(group_seed=...)`), which must
  stay the same for the whole run, resumed fits included. It is read in
  Python only (by `fit`'s sampler), never in the train step;
- `releases`: one float32 scalar per stateful side release of the plan's
  `side_releases` (`tf_pxg.dp.releases.SideRelease.initial_state`, then
  `next_state` of each applied step's noisy release; `ONLY_FIRST_REPLICA`,
  like the clip, which is the adaptive count's state);

The privacy ledger is not here: it belongs to the weights, so it is held
by the model (`tf_pxg.keras._ledger`), which every weights path carries.
"""

from __future__ import annotations

import secrets
from typing import Any, Optional

import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.dp import mechanisms


class DPState(tf.Module):
  """Variables of the clipping policy and noise mechanism (see module doc)."""

  def __init__(self):
    super().__init__(name="dp_state")
    self.clip: Optional[tf.Variable] = None
    self.noise: Any = None  # the noise mechanism's state
    self._noise_keys = None  # ids of the variables `noise` was made for
    # The tracked list of the state's variables, assigned once built (not
    # an empty list before: a checkpoint restored before the build binds
    # its saved list to the object it finds, and a list assigned later
    # would then never be restored; see `build`).
    self._noise_buffers = None
    self.releases = {}  # side release name -> its state variable
    self.group_seed: Optional[tf.Variable] = None

  def init_group_seed(self, noise_mechanism):
    """Creates `group_seed` (OS entropy) for cyclic participation in
    b > 1 groups (BandMF)."""
    if min_separation(noise_mechanism) > 1 and self.group_seed is None:
      with tf.init_scope():
        self.group_seed = tf.Variable(
            secrets.randbits(62), dtype=tf.int64, trainable=False,
            name="dp_group_seed")

  def build(self, var_list, plan):
    """Creates what the plan's clipping policy, side releases and noise
    mechanism need (once; the noise state again for other variables)."""
    clipping, noise_mechanism = plan.clipping, plan.noise_mechanism
    l2_norm_clip = plan.l2_norm_clip
    # The user's side releases and a policy's stateful releases other
    # than the one clip (`PerLayer`'s adaptive bounds: one per group).
    policy_releases = tuple(getattr(clipping, "state_releases",
                                    lambda: ())())
    for release in tuple(plan.side_releases) + policy_releases:
      if release.name not in self.releases:
        self.releases[release.name] = tf.Variable(
            float(release.initial_state(l2_norm_clip)), dtype=tf.float32,
            trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            name=f"dp_{release.name}")
    if clipping is not None and clipping.adaptive and self.clip is None:
      self.clip = tf.Variable(
          float(l2_norm_clip), dtype=tf.float32, trainable=False,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
          name="dp_l2_norm_clip")
    keys = [id(v) for v in var_list]
    if self._noise_keys != keys:
      mech = mechanisms.from_setting(noise_mechanism)
      self.noise = mech.init_state(var_list)
      self._noise_keys = keys
      self._noise_buffers = mech.state_variables(self.noise)
    check_restored(self)

  @property
  def variables(self) -> list:
    out = [] if self.clip is None else [self.clip]
    out += [] if self.group_seed is None else [self.group_seed]
    return (out + list(self._noise_buffers or ()) +
            list(self.releases.values()))

  def release_states(self, releases) -> tuple:
    """The state variable of each of the step's `releases` (the adaptive
    count's is the clip; None for the stateless `NoisyLoss`)."""
    def state(release):
      if not release.stateful:
        return None
      if release.drives_clip:
        return self.clip
      return self.releases[release.name]
    return tuple(state(r) for r in releases)


def check_restored(state: "DPState") -> None:
  """Refuses DP state that a checkpoint restore left unbound.

  A `tf.train.Checkpoint` restored before the optimizer is built (deferred
  restoration, as `CheckpointManager` users do) binds each saved DP state
  variable when `build` creates it. A saved value that nothing took (the
  plan's mechanism, clipping or side releases differ from the saved run's)
  would let the run go on from a fresh state (a noise stream restarted,
  an adaptive clip reset) under a ledger that continues the old one: so
  the build raises, before the first step.

  Raises:
    ValueError: naming each unbound saved value and what to do.
  """
  pending = _compat.deferred_restore_names(state)
  for name in ("_noise_buffers", "releases"):
    container = getattr(state, name, None)
    if container is not None:
      pending += [f"{name}/{n}" for n in
                  _compat.deferred_restore_names(container)]
  if pending:
    raise ValueError(
        f"DPOptimizer: a checkpoint restored into this optimizer holds DP "
        f"state {', '.join(sorted(pending))} that its plan does not create "
        "(it was saved by a run with another noise mechanism, clipping "
        "policy or side releases), so it would stay unbound and the run "
        "would continue from a fresh state. Restore into a DPOptimizer with "
        "the saved run's settings, or compile a new DPOptimizer (a fresh "
        "noise state: the privacy ledger then starts a new run).")


def min_separation(noise_mechanism) -> int:
  """b of the cyclic participation the mechanism's ε needs (BandMF's
  bands); 1 for None (DP-SGD)."""
  return int(mechanisms.from_setting(noise_mechanism).min_separation)


#: Saved-config (de)serialisation of a noise mechanism setting.
serialize_mechanism = mechanisms.serialize
deserialize_mechanism = mechanisms.deserialize
