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
- `noise`: `tf_pxg.dp.correlated.NoiseBuffers` for BandMF with b > 1
  (`ON_READ`/`SUM`: each replica holds its share);
- `group_seed`: int64, for b > 1, drawn from OS entropy when the optimizer
  is created: it keys cyclic Poisson sampling's assignment of examples to
  the b groups (`tf_pxg.data.PoissonSampler(group_seed=...)`), which must
  stay the same for the whole run, resumed fits included. It is read in
  Python only (by `fit`'s sampler), never in the train step.
"""

from __future__ import annotations

import importlib
import secrets
from typing import Optional

import tensorflow as tf

from tf_pxg.dp import correlated


class DPState(tf.Module):
  """Variables of the clipping policy and noise mechanism (see module doc)."""

  def __init__(self):
    super().__init__(name="dp_state")
    self.clip: Optional[tf.Variable] = None
    self.noise: Optional[correlated.NoiseBuffers] = None
    self._noise_buffers = []  # tracked list of the buffers' variables
    self.group_seed: Optional[tf.Variable] = None

  def init_group_seed(self, noise_mechanism):
    """Creates `group_seed` (OS entropy) for BandMF with b > 1."""
    if num_bands(noise_mechanism) > 1 and self.group_seed is None:
      with tf.init_scope():
        self.group_seed = tf.Variable(
            secrets.randbits(62), dtype=tf.int64, trainable=False,
            name="dp_group_seed")

  def build(self, var_list, clipping, noise_mechanism, l2_norm_clip):
    """Creates what `clipping` and `noise_mechanism` need (once)."""
    if clipping is not None and clipping.adaptive and self.clip is None:
      self.clip = tf.Variable(
          float(l2_norm_clip), dtype=tf.float32, trainable=False,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
          name="dp_l2_norm_clip")
    bands = num_bands(noise_mechanism)
    if bands > 1 and (self.noise is None or
                      not self.noise.matches(var_list)):
      self.noise = correlated.NoiseBuffers(var_list, bands)
      self._noise_buffers = list(self.noise.buffers)

  @property
  def variables(self) -> list:
    out = [] if self.clip is None else [self.clip]
    out += [] if self.group_seed is None else [self.group_seed]
    return out + ([] if self.noise is None else list(self.noise.buffers))


def num_bands(noise_mechanism) -> int:
  """b of a BandMF mechanism; 1 for None (DP-SGD)."""
  return 1 if noise_mechanism is None else int(noise_mechanism.num_bands)


def serialize_mechanism(noise_mechanism) -> Optional[dict]:
  if noise_mechanism is None:
    return None
  return {"class_name": type(noise_mechanism).__name__,
          "config": noise_mechanism.get_config()}


def deserialize_mechanism(config):
  """The mechanism of `serialize_mechanism`'s dict (or an instance/None)."""
  if config is None or not isinstance(config, dict):
    return config
  mf = importlib.import_module("tf_pxg.mf")
  cls = getattr(mf, config.get("class_name", ""), None)
  if cls is None:
    raise ValueError(f"Unknown noise mechanism {config!r}; expected a "
                     "tf_pxg.mf class such as BandedToeplitz.")
  return cls.from_config(config["config"])
