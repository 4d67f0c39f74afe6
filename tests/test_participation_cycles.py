"""The participation check covers every cycle (issue 50, item 5).

BandMF's ε holds for b-min-separation participation: every step s draws
only from group s mod b. A sampler with its own selection was checked on
its first cycle only (drawn eagerly before the run): one that follows the
groups in the first cycle and takes every example afterwards trained to
the end and reported BandMF's amplified ε. Now its selection is guarded
at every step, inside the input pipeline, and the run stops at the first
step that strays, before that batch trains.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.data as dpd
import tf_pxg.keras as dpk
from tf_pxg import mf
from tf_pxg.data import participation

N, B = 32, 4


class FollowsTheGroupsOnlyAtFirst(dpd.PoissonSampler):
  """The attack: its first cycle keeps to the groups (so the first-cycle
  check passes); from the second cycle on it draws every example."""

  def step_indices(self, step, key=None):
    del key
    b = self.min_separation
    per_group = [tf.constant(self.group_members(g)[:B], tf.int64)
                 for g in range(b)]
    first_cycle = tf.switch_case(
        tf.cast(tf.math.floormod(step, b), tf.int32),
        [lambda m=m: m for m in per_group])
    everyone = tf.range(N, dtype=tf.int64)
    return tf.cond(step < b, lambda: first_cycle, lambda: everyone[:B + 2])


def _model():
  model = dpk.DPSequential(
      [keras.Input((3,)), keras.layers.Dense(1)], l2_norm_clip=1.0,
      noise_multiplier=1.0, seed=0,
      noise_mechanism=mf.BandedToeplitz(num_bands=2))
  model.compile(optimizer="sgd", loss="mse")
  return model


def test_the_first_cycle_check_alone_passes_the_attack():
  config = dpd.SamplerConfig(N, B, seed=0, min_separation=2, group_seed=1)
  attack = FollowsTheGroupsOnlyAtFirst.from_config(config)
  # What the check before issue 50 did: the first cycle only.
  participation._check_selection(attack, "fit")  # pylint: disable=protected-access
  # Later steps stray.
  groups = attack.group_index.assignment()
  drawn = attack.step_indices(tf.constant(2, tf.int64)).numpy()
  assert (groups[drawn] != 0).any()


def test_a_selection_that_strays_after_the_first_cycle_is_refused():
  model = _model()
  x, y = np.zeros((N, 3), "float32"), np.zeros((N, 1), "float32")
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"FollowsTheGroupsOnlyAtFirst.*min_separation=2.*"
                     r"at step.*2.*which samples only group.*0"):
    model.fit(x, y, batch_size=B, epochs=2, verbose=0,
              sampling=FollowsTheGroupsOnlyAtFirst)
  # The first cycle (b = 2 steps) trained; the straying step did not.
  assert int(model.optimizer.iterations.numpy()) == 2


def test_a_selection_that_keeps_to_the_groups_trains_to_the_end():

  class KeepsToTheGroups(dpd.PoissonSampler):

    def step_indices(self, step, key=None):
      del key
      b = self.min_separation
      per_group = [tf.constant(self.group_members(g)[:B], tf.int64)
                   for g in range(b)]
      return tf.switch_case(tf.cast(tf.math.floormod(step, b), tf.int32),
                            [lambda m=m: m for m in per_group])

  model = _model()
  x, y = np.zeros((N, 3), "float32"), np.zeros((N, 1), "float32")
  model.fit(x, y, batch_size=B, epochs=2, verbose=0,
            sampling=KeepsToTheGroups)
  assert int(model.optimizer.iterations.numpy()) == 2 * N // B
