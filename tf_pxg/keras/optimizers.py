"""`DPOptimizer`: any Keras optimizer carrying the run's DP plan.

The optimizer owns the frozen `tf_pxg.dp.plan.DPPlan` (`l2_norm_clip`,
`noise_multiplier`, clipping policy, noise mechanism, secure mode, the
sampling choice and the accountant): the one place the DP configuration
lives, saved in its config; a DP model reads it from the optimizer it is
compiled with. The private
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

import inspect

import keras

from tf_pxg import _compat
from tf_pxg.data import samplers
from tf_pxg.dp import clipping as clipping_policies
from tf_pxg.dp import plan as dp_plan
from tf_pxg.dp import step_state as step_state_lib
from tf_pxg.keras import _dp_state as dp_state


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
    clipping: a `tf_pxg.clipping` policy: None or `Flat()` (clip to
      `l2_norm_clip`), `Automatic()` (normalise, sensitivity
      `l2_norm_clip`), `QuantileAdaptive(...)` (`l2_norm_clip` is the
      initial clip; the current one is the variable `current_l2_norm_clip`,
      saved with the optimizer). Saved in the config.
    noise_mechanism: None (DP-SGD: independent noise every step) or a
      `tf_pxg.mf.BandedToeplitz(num_bands=b)` (BandMF correlated noise,
      `tf_pxg.dp.correlated`: `b - 1` model-sized noise buffers, which are
      optimizer state, saved in checkpoints). b = 1 is DP-SGD exactly. Its
      ε holds with `fit`'s cyclic Poisson sampling (b groups, rate
      `B b / N`), which the model then uses; `PrivacyCallback` accounts
      for it. Saved in the config.
    sampling: how `fit` draws batches: None (not chosen here: `fit`'s own
      `sampling=` argument decides, "poisson" by default), a name of
      `tf_pxg.data.samplers.SAMPLINGS` ("poisson", "shuffled", or one
      added with `samplers.register`, e.g. "balls_in_bins" by
      `tf_pxg.data.balls_in_bins`) or such a sampler class. It is the plan's `sampling` (a class); `fit` builds
      the instance from the data (`model.dp_plan.sampler`), and a `fit`
      given a different `sampling=` raises. An instance is refused here
      (pass it to `fit`). Saved in the config by name: a class without one
      (e.g. made by `BallsInBinsSampler.configured(...)`) raises at
      `get_config`; register it first.
    noisy_loss: a `tf_pxg.keras.NoisyLoss(bound, noise_multiplier)`: the
      logged training `loss`, a private side release covered by ε (the
      gradient's noise takes the rest of σ; `tf_pxg.dp.noisy_loss`).
      Saved in the config.
    side_releases: more private side releases made on each step's batch,
      a sequence of stateful `tf_pxg.dp.releases.SideRelease`s (each
      logged under its name; its state, like the adaptive clip, is held
      here and saved). Saved in the config (register the class with
      `keras.saving.register_keras_serializable`).
    unprotected_training_metrics: also log the compiled loss and metrics
      of each private batch, un-noised and not covered by ε, under
      `unprotected_<name>` keys (default False; a debugging opt-in that a
      model's constructor or `fit(unprotected_training_metrics=...)` may
      also set here). The privacy ledger records it in the run's
      settings. Saved in the config.
    accountant: "rdp" (default) or "pld": what `PrivacyCallback` and
      `model.epsilon()` compute ε with (the callback reads it here; it
      has no accountant of its own). Saved in the config.
    name: optimizer name.

  Raises:
    ValueError/TypeError: invalid settings (an unknown `sampling` or
      `accountant`, a sampler instance, shuffled sampling with BandMF/BLT
      noise), or base-optimizer arguments (`clipnorm`, `weight_decay`,
      ...) passed to the wrapper (set them on the inner optimizer).

  Use it with a DP model (`DPModel`, `DPSequential`, `make_private(...)`,
  `make_dp_model_class(...)`), which takes its settings from it when it has
  none of its own.

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  """

  def __init__(self, inner_optimizer, l2_norm_clip, noise_multiplier,
               name=None, secure_mode=False, clipping=None,
               noise_mechanism=None, sampling=None, accountant="rdp",
               noisy_loss=None, side_releases=(),
               unprotected_training_metrics=False, **kwargs):
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
    plan = dp_plan.DPPlan.validated(
        "DPOptimizer", l2_norm_clip, noise_multiplier, required=True,
        clipping=clipping, noise_mechanism=noise_mechanism,
        secure_mode=secure_mode, sampling=sampling, accountant=accountant,
        noisy_loss=noisy_loss, side_releases=side_releases,
        unprotected_training_metrics=unprotected_training_metrics)
    plan.check_budget()
    super().__init__(learning_rate=0.0, name=name or "dp_optimizer")
    self.inner_optimizer = inner_optimizer
    self._plan = plan
    # The mechanism's state (adaptive clip, noise buffers): tf.Variables in
    # a tf.Module, so tf.train.Checkpoint tracks them; `variables` lists
    # them for Keras' saving.
    self.dp_state = dp_state.DPState()
    self.dp_state.init_group_seed(noise_mechanism)
    # What the DP step keeps between physical batches and never saves
    # (tf_pxg.dp.step_state): set past Keras' attribute tracking.
    object.__setattr__(self, "step_state", step_state_lib.StepState())

  # The plan (one frozen object; the attributes below read it) -------------

  @property
  def plan(self) -> dp_plan.DPPlan:
    """The run's frozen `DPPlan`."""
    return self._plan

  @property
  def l2_norm_clip(self) -> float:
    return self._plan.l2_norm_clip

  @property
  def noise_multiplier(self) -> float:
    return self._plan.noise_multiplier

  @property
  def secure_mode(self) -> bool:
    return self._plan.secure_mode

  @property
  def clipping(self):
    return self._plan.clipping

  @property
  def noise_mechanism(self):
    return self._plan.noise_mechanism

  @property
  def sampling(self):
    """The sampling choice: a sampler class, or None (`fit` decides)."""
    return self._plan.sampling

  @property
  def accountant(self) -> str:
    return self._plan.accountant

  def _take_request(self, request: dp_plan.DPPlan, where: str) -> None:
    """Takes a DP model's request at `compile` (`DPPlan.absorb`: it must
    agree with this plan, or fill what this plan leaves open, e.g. secure
    mode, the sampling, the side releases); raises naming both values."""
    self._plan = self._plan.absorb(request, where)

  def _set_unprotected_metrics(self, value: bool) -> None:
    """Turns the unprotected training metrics on or off (a model created
    with `unprotected_training_metrics=True` at `compile`, or
    `fit(unprotected_training_metrics=...)`); the ledger's next run
    records it."""
    self._plan = self._plan.replace(unprotected_training_metrics=value)

  @_compat.no_automatic_dependency_tracking
  def build(self, var_list):
    # The DP state first: it refuses saved state its plan does not create
    # (`_dp_state.check_restored`), and then nothing is marked built.
    self.dp_state.build(var_list, self._plan)
    self.inner_optimizer.build(var_list)
    super().build(var_list)

  @property
  def variables(self):
    return (_compat.optimizer_own_variables(self) +
            self.inner_optimizer.variables + self.dp_state.variables)

  @property
  def noise_buffer_bytes(self) -> int:
    """Bytes of BandMF's noise buffers per replica ((b - 1) times the
    trainable variables'; 0 for DP-SGD or before the optimizer is built)."""
    noise = self.dp_state.noise
    return 0 if noise is None else noise.nbytes

  @property
  def current_l2_norm_clip(self):
    """The clip in use: the adaptive clip's current value (a float) with
    `QuantileAdaptive`, else `l2_norm_clip`."""
    var = self.dp_state.clip
    return self.l2_norm_clip if var is None else float(var.numpy())

  @property
  def learning_rate(self):
    return self.inner_optimizer.learning_rate

  @learning_rate.setter
  def learning_rate(self, learning_rate):
    self.inner_optimizer.learning_rate = learning_rate

  @property
  def iterations(self):
    return self.inner_optimizer.iterations

  def step_count(self) -> int:
    """The logical steps applied so far (`iterations`, read in Python)."""
    return int(self.iterations.numpy())

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
    """The config; the sampling choice by its `SAMPLINGS` name.

    Raises:
      ValueError: the sampling class has no registered name
        (`tf_pxg.data.samplers.register`).
    """
    return {
        "name": self.name,
        "inner_optimizer":
            keras.saving.serialize_keras_object(self.inner_optimizer),
        "l2_norm_clip": self.l2_norm_clip,
        "noise_multiplier": self.noise_multiplier,
        "secure_mode": self.secure_mode,
        "clipping": clipping_policies.serialize(self.clipping),
        "noise_mechanism": dp_state.serialize_mechanism(self.noise_mechanism),
        "sampling": self._plan.sampling_name,
        "accountant": self.accountant,
        "noisy_loss": (None if self._plan.noisy_loss is None else
                       self._plan.noisy_loss.get_config()),
        "side_releases": [keras.saving.serialize_keras_object(r)
                          for r in self._plan.side_releases],
        "unprotected_training_metrics":
            self._plan.unprotected_training_metrics,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    inner = keras.saving.deserialize_keras_object(
        config.pop("inner_optimizer"), custom_objects=custom_objects)
    config["clipping"] = clipping_policies.get(config.get("clipping"))
    config["noise_mechanism"] = dp_state.deserialize_mechanism(
        config.get("noise_mechanism"))
    if config.get("noisy_loss") is not None:
      from tf_pxg.dp.noisy_loss import NoisyLoss  # noqa: PLC0415
      config["noisy_loss"] = NoisyLoss.from_config(config["noisy_loss"])
    config["side_releases"] = tuple(
        keras.saving.deserialize_keras_object(r, custom_objects=custom_objects)
        for r in config.get("side_releases", ()))
    name = config.get("sampling")
    if name is not None and name not in samplers.known_names():
      raise ValueError(
          f"DPOptimizer.from_config: the plan was saved with sampling="
          f"{name!r}, which is not a registered sampling in this process "
          f"(known: {samplers.known_names()}). Import the module that "
          "registers it (e.g. tf_pxg.data.balls_in_bins for "
          "'balls_in_bins'), or register the class, "
          f"tf_pxg.data.samplers.register({name!r}, cls), then load.")
    return cls(inner, **config)


def dp_optimizer_of(optimizer):
  """The `DPOptimizer` a model is compiled with: `optimizer` itself, or
  the one inside a `keras.optimizers.LossScaleOptimizer` (mixed
  precision); None for anything else (not compiled, a plain optimizer)."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    optimizer = optimizer.inner_optimizer
  return optimizer if isinstance(optimizer, DPOptimizer) else None


#: The `DPOptimizer` arguments `DPSGD` and `DPAdam` take besides the clip
#: and sigma (the rest go to the inner optimizer).
# The DPOptimizer's own keyword arguments (its signature is the one list;
# `name` and the rest go to the inner optimizer).
_DP_ARGS = tuple(
    p for p in inspect.signature(DPOptimizer.__init__).parameters
    if p not in ("self", "inner_optimizer", "l2_norm_clip",
                 "noise_multiplier", "name", "kwargs"))


def _wrapping(inner_class, l2_norm_clip, noise_multiplier,
              kwargs) -> DPOptimizer:
  dp_args = {k: kwargs.pop(k) for k in _DP_ARGS if k in kwargs}
  return DPOptimizer(inner_class(**kwargs), l2_norm_clip, noise_multiplier,
                     **dp_args)


def DPSGD(l2_norm_clip: float, noise_multiplier: float,
          **kwargs) -> DPOptimizer:  # noqa: N802  (optimizer-class style)
  """DP-SGD: `DPOptimizer(keras.optimizers.SGD(**sgd_kwargs), ...)`; the
  `DPOptimizer` arguments (`secure_mode`, `clipping`, `noise_mechanism`,
  `sampling`, `accountant`, `noisy_loss`, `side_releases`,
  `unprotected_training_metrics`) go to it, the rest to `SGD`."""
  return _wrapping(keras.optimizers.SGD, l2_norm_clip, noise_multiplier,
                   kwargs)


def DPAdam(l2_norm_clip: float, noise_multiplier: float,
           **kwargs) -> DPOptimizer:  # noqa: N802
  """DP-Adam: `DPOptimizer(keras.optimizers.Adam(**adam_kwargs), ...)`;
  the `DPOptimizer` arguments as in `DPSGD`."""
  return _wrapping(keras.optimizers.Adam, l2_norm_clip, noise_multiplier,
                   kwargs)
