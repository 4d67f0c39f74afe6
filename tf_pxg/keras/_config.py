"""A DP model's Keras config: its DP settings saved with `get_config` and
restored by `from_config` (`ConfigMixin`, a base of
`tf_pxg.keras.models._DPTrainingMixin`).

The settings are the model's request (`_dp_request`, a
`tf_pxg.dp.plan.DPPlan` validated in one place, `DPPlan.validated`);
Keras' own config methods are the next class in the model's MRO.
"""

from __future__ import annotations

import keras

from tf_pxg.dp import plan as dp_plan

# The two DP settings that are always in the config (None when the
# optimizer holds them).
DP_CONFIG_KEYS = ("l2_norm_clip", "noise_multiplier")


class ConfigMixin:
  """`get_config` / `from_config` with the DP settings."""

  def get_config(self):
    config = super().get_config()
    request = self._dp_request
    config["l2_norm_clip"] = request.l2_norm_clip
    config["noise_multiplier"] = request.noise_multiplier
    config["secure_mode"] = self.secure_mode
    if request.unprotected_training_metrics:
      config["unprotected_training_metrics"] = True
    if request.noisy_loss is not None:
      config["noisy_loss"] = request.noisy_loss.get_config()
    if request.side_releases:
      config["side_releases"] = [keras.saving.serialize_keras_object(r)
                                 for r in request.side_releases]
    if request.sampling is not None:
      config["sampling"] = request.sampling_name  # raises if unnamed
    if not request.is_default_mechanism:
      from tf_pxg.dp import clipping as policies  # noqa: PLC0415
      from tf_pxg.keras import _dp_state  # noqa: PLC0415
      config["clipping"] = policies.serialize(request.clipping)
      config["noise_mechanism"] = _dp_state.serialize_mechanism(
          request.noise_mechanism)
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    dp = {k: config.pop(k, None) for k in DP_CONFIG_KEYS}
    secure_mode = bool(config.pop("secure_mode", False))
    sampling = config.pop("sampling", None)
    unprotected = bool(config.pop("unprotected_training_metrics", False))
    noisy_loss = config.pop("noisy_loss", None)
    if noisy_loss is not None:
      from tf_pxg.dp.noisy_loss import NoisyLoss  # noqa: PLC0415
      noisy_loss = NoisyLoss.from_config(noisy_loss)
    side_releases = tuple(
        keras.saving.deserialize_keras_object(r, custom_objects=custom_objects)
        for r in config.pop("side_releases", ()))
    from tf_pxg.keras import _dp_state  # noqa: PLC0415
    request = dp_plan.DPPlan.validated(
        cls.__name__, dp["l2_norm_clip"], dp["noise_multiplier"],
        required=False, clipping=config.pop("clipping", None),
        noise_mechanism=_dp_state.deserialize_mechanism(
            config.pop("noise_mechanism", None)),
        secure_mode=secure_mode, sampling=sampling, noisy_loss=noisy_loss,
        side_releases=side_releases, unprotected_training_metrics=unprotected)
    model = super().from_config(config, custom_objects=custom_objects)
    model._dp_request = request
    return model
