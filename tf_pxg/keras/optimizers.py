"""`DPOptimizer`: any Keras optimizer carrying DP-SGD settings.

The optimizer holds `l2_norm_clip` and `noise_multiplier`; the private
gradient itself (per-example clipping, noise, division by the batch size) is
computed by a DP model's `train_step` (`tf_pxg.keras.DPModel`,
`DPSequential`, `make_dp_model_class`, `make_private`), which then applies it
with the wrapped optimizer. Like `keras.optimizers.LossScaleOptimizer`, the
wrapper delegates its variables, `iterations`, `learning_rate` and `build` to
the inner optimizer, so checkpoints and `optimizer.iterations` (the step
count privacy accounting uses) are the inner optimizer's.

Calling `apply`/`apply_gradients` directly (as a plain `keras.Model` does)
raises: those gradients were not clipped per example, so applying them would
silently give no privacy.
"""

from __future__ import annotations

import keras

from tf_pxg import _compat
from tf_pxg.keras import _validation


@keras.saving.register_keras_serializable(package="tf_pxg")
class DPOptimizer(keras.optimizers.Optimizer):
  """Wraps a Keras optimizer with DP-SGD settings (Abadi et al. 2016).

  Args:
    inner_optimizer: the Keras optimizer that applies the private gradient.
    l2_norm_clip: each example's gradient (over all trainable variables
      together) is scaled to L2 norm at most this; `float('inf')` disables
      clipping.
    noise_multiplier: Gaussian noise of std `noise_multiplier * l2_norm_clip`
      is added to the sum of clipped gradients once per global step.
    secure_mode: the model that compiles with this optimizer draws its
      noise keys (and sampler randomness) from the OS CSPRNG every step and
      sums four Gaussians per coordinate (`tf_pxg.dp.secure`); the model
      must not have a `seed`. Saved in the config.
    name: optimizer name.

  Raises:
    ValueError/TypeError: invalid settings, or base-optimizer arguments
      (`clipnorm`, `weight_decay`, ...) passed to the wrapper (set them on the
      inner optimizer).

  Use it with a DP model (`DPModel`, `DPSequential`, `make_private(...)`,
  `make_dp_model_class(...)`), which takes its settings from it when it has
  none of its own.

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  """

  def __init__(self, inner_optimizer, l2_norm_clip, noise_multiplier,
               name=None, secure_mode=False, **kwargs):
    if kwargs:
      raise ValueError(
          f"DPOptimizer does not take `{'`, `'.join(kwargs)}`; set them on "
          "the inner optimizer.")
    if isinstance(inner_optimizer, DPOptimizer):
      raise ValueError("DPOptimizer cannot wrap another DPOptimizer.")
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
      raise TypeError(
          "`inner_optimizer` must be a keras.optimizers.Optimizer instance; "
          f"got {inner_optimizer!r}.")
    clip = _validation.validate_l2_norm_clip(l2_norm_clip)
    noise = _validation.validate_noise_multiplier(noise_multiplier)
    if not isinstance(secure_mode, bool):
      raise TypeError("DPOptimizer: secure_mode must be True or False; got "
                      f"{secure_mode!r}.")
    super().__init__(learning_rate=0.0, name=name or "dp_optimizer")
    self.inner_optimizer = inner_optimizer
    self.l2_norm_clip = clip
    self.noise_multiplier = noise
    self.secure_mode = secure_mode

  @_compat.no_automatic_dependency_tracking
  def build(self, var_list):
    self.inner_optimizer.build(var_list)
    super().build(var_list)

  @property
  def variables(self):
    return _compat.optimizer_own_variables(self) + self.inner_optimizer.variables

  @property
  def learning_rate(self):
    return self.inner_optimizer.learning_rate

  @learning_rate.setter
  def learning_rate(self, learning_rate):
    self.inner_optimizer.learning_rate = learning_rate

  @property
  def iterations(self):
    return self.inner_optimizer.iterations

  def apply(self, grads, trainable_variables=None):
    raise RuntimeError(
        "DPOptimizer.apply was called with gradients that were not clipped "
        "per example (e.g. by a plain keras.Model's train_step); applying "
        "them would give no privacy. Train with a DP model: "
        "tf_pxg.keras.DPModel / DPSequential, tf_pxg.keras.make_private("
        "model), or a class from tf_pxg.keras.make_dp_model_class(cls).")

  def stateless_apply(self, optimizer_variables, grads, trainable_variables):
    self.apply(grads, trainable_variables)

  def scale_loss(self, loss):
    return self.inner_optimizer.scale_loss(loss)

  def finalize_variable_values(self, var_list):
    self.inner_optimizer.finalize_variable_values(var_list)

  def get_config(self):
    return {
        "name": self.name,
        "inner_optimizer":
            keras.saving.serialize_keras_object(self.inner_optimizer),
        "l2_norm_clip": self.l2_norm_clip,
        "noise_multiplier": self.noise_multiplier,
        "secure_mode": self.secure_mode,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    inner = keras.saving.deserialize_keras_object(
        config.pop("inner_optimizer"), custom_objects=custom_objects)
    return cls(inner, **config)


def DPSGD(l2_norm_clip: float, noise_multiplier: float,
          secure_mode: bool = False,
          **sgd_kwargs) -> DPOptimizer:  # noqa: N802  (optimizer-class style)
  """DP-SGD: `DPOptimizer(keras.optimizers.SGD(**sgd_kwargs), ...)`."""
  return DPOptimizer(keras.optimizers.SGD(**sgd_kwargs), l2_norm_clip,
                     noise_multiplier, secure_mode=secure_mode)


def DPAdam(l2_norm_clip: float, noise_multiplier: float,
           secure_mode: bool = False,
           **adam_kwargs) -> DPOptimizer:  # noqa: N802
  """DP-Adam: `DPOptimizer(keras.optimizers.Adam(**adam_kwargs), ...)`."""
  return DPOptimizer(keras.optimizers.Adam(**adam_kwargs), l2_norm_clip,
                     noise_multiplier, secure_mode=secure_mode)
