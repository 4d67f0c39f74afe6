"""Deferred restore restores all DP state (issue 50, item 2).

`tf.train.Checkpoint.restore` before the optimizer is built (what
`CheckpointManager` users do) binds each saved variable when the object
that owns it is created. Before issue 50, BandMF's noise buffers were
never bound that way (the DP state's empty list took the saved list's
place, the buffers built later went unrestored): the resumed run's
correlated noise restarted from zero under a ledger that continued the old
stream. Now every DP state variable (noise buffers, clip, side releases,
group seed) binds, and saved DP state that the plan does not create is
refused when the optimizer is built, before the first step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import mf

N = 64


def _data():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((N, 3)).astype("float32"),
          rng.integers(0, 2, N).astype("int32"))


def _model(**dp):
  model = dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(2)],
                           l2_norm_clip=1.0, noise_multiplier=1.0, **dp)
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return model


def _saved(tmp_path, **dp):
  model = _model(**dp)
  x, y = _data()
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                       str(tmp_path), max_to_keep=1)
  manager.save()
  return model, manager.latest_checkpoint


def test_deferred_restore_binds_the_bandmf_noise_buffers(tmp_path):
  a, path = _saved(tmp_path, noise_mechanism=mf.BandedToeplitz(2))
  b = _model(noise_mechanism=mf.BandedToeplitz(2))
  assert not b.optimizer.built  # deferred: the buffers do not exist yet
  status = tf.train.Checkpoint(model=b).restore(path)
  b.optimizer.build(b.trainable_variables)
  status.assert_consumed()
  saved = a.optimizer.dp_state.noise.buffers
  restored = b.optimizer.dp_state.noise.buffers
  assert np.abs(saved[0].numpy()).max() > 0
  for u, v in zip(saved, restored):
    np.testing.assert_array_equal(u.numpy(), v.numpy())  # were all zero
  assert int(b.optimizer.dp_state.group_seed.numpy()) == int(
      a.optimizer.dp_state.group_seed.numpy())
  # The run goes on on the restored stream: one run, every step, its
  # sampler's BandMF event.
  steps = int(a.optimizer.iterations.numpy())
  x, y = _data()
  b.fit(x, y, batch_size=8, epochs=1, verbose=0)
  total = int(b.optimizer.iterations.numpy())
  assert total == 2 * steps
  runs = b.privacy_ledger.runs()
  assert [r["steps"] for r in runs] == [total]
  sampler = b.dp_plan.sampler
  want = sampler.dp_event(b.dp_plan.mechanism, 1.0, total)
  assert b.privacy_ledger.event() == want


def test_saved_dp_state_the_plan_does_not_create_is_refused(tmp_path):
  # Saved with BandMF, restored into a DP-SGD optimizer: the buffers would
  # stay unbound. Refused when the optimizer is built, before any step.
  _, path = _saved(tmp_path, noise_mechanism=mf.BandedToeplitz(2))
  b = _model()
  tf.train.Checkpoint(model=b).restore(path)
  restored = [v.numpy() for v in b.trainable_variables]
  with pytest.raises(ValueError, match=r"_noise_buffers/0.*not create.*"
                     r"another noise mechanism"):
    b.optimizer.build(b.trainable_variables)
  x, y = _data()
  with pytest.raises(ValueError, match="_noise_buffers"):
    b.fit(x, y, batch_size=8, epochs=1, verbose=0)
  assert not b.optimizer.built  # no step was taken
  for v, w in zip(b.trainable_variables, restored):
    np.testing.assert_array_equal(v.numpy(), w)


def test_deferred_restore_binds_the_adaptive_clip(tmp_path):
  from tf_pxg.dp import clipping  # pylint: disable=import-outside-toplevel
  policy = clipping.QuantileAdaptive(target_quantile=0.5, learning_rate=0.5,
                                     count_stddev=4.0)
  a, path = _saved(tmp_path, clipping=policy)
  b = _model(clipping=policy)
  status = tf.train.Checkpoint(model=b).restore(path)
  b.optimizer.build(b.trainable_variables)
  status.assert_consumed()
  assert b.optimizer.current_l2_norm_clip == a.optimizer.current_l2_norm_clip
  assert a.optimizer.current_l2_norm_clip != 1.0


def test_deferred_restore_binds_the_blt_state(tmp_path):
  from tf_pxg.dp import blt  # pylint: disable=import-outside-toplevel
  mech = blt.BLT(num_steps=64, min_separation=2, num_buffers=3)
  a, path = _saved(tmp_path, noise_mechanism=mech)
  b = _model(noise_mechanism=mech)
  status = tf.train.Checkpoint(model=b).restore(path)
  b.optimizer.build(b.trainable_variables)
  status.assert_consumed()
  saved, restored = a.optimizer.dp_state.noise, b.optimizer.dp_state.noise
  assert np.abs(saved[0].numpy()).max() > 0
  for u, v in zip(saved, restored):
    np.testing.assert_array_equal(u.numpy(), v.numpy())
