"""`DPPlan`: the DP configuration of a training run, frozen, in one place.

The plan holds everything the privacy guarantee is computed from: the clip
`l2_norm_clip`, the noise multiplier sigma, the clipping policy
(`tf_pxg.clipping`), the noise mechanism setting (`None`, a
`tf_pxg.mf.BandedToeplitz`, or a `tf_pxg.dp.mechanisms.NoiseMechanism`),
secure mode, the sampling, the accountant ("rdp" or "pld"), and the
private side releases made with the gradient on the same batch (the noisy
training loss, `noisy_loss`, and any others, `side_releases`; a
`QuantileAdaptive` policy's count and a sparse mechanism's selection are
the policy's and the mechanism's). `step_noise` derives the step's noise
multipliers from them: the one place σ is split
(`tf_pxg.dp.releases.gradient_noise_multiplier`).

The sampling has two fields, because a sampler instance is built from the
data and the model (N, the replicas, the cyclic groups) and so cannot be
part of a configuration made before the data is seen:

- `sampling`, the *choice*: None (not chosen: `fit(sampling=...)` decides,
  "poisson" by default) or a sampler class (a name of
  `tf_pxg.data.samplers.SAMPLINGS` is resolved to its class, so "poisson"
  and `PoissonSampler` are one choice). It is saved with the owner, by
  name (`samplers.sampling_name`).
- `sampler`, the run's instance: always None in the owner's plan; a DP
  model's `dp_plan` fills in the `tf_pxg.data.samplers.Sampler` its last
  `fit` built (of the class `sampling` names, when it names one). Not
  saved.

`tf_pxg.keras.PrivacyCallback` reads the sampler and the accountant from
`model.dp_plan` and composes `sampler.dp_event(mechanism, ...)`, the
mechanism being `plan.mechanism`. The plan is immutable
(`dataclasses.replace` makes a changed copy) and owned by ONE object: the
`tf_pxg.keras.DPOptimizer` (its natural owner, which also holds the
mechanism's state and saves the plan in its config). A DP model reads the
plan of the optimizer it is compiled with; the settings given to a model's
constructor are only a request that `compile` hands to the optimizer (it
wraps a plain optimizer, or checks that a DPOptimizer's plan agrees and
raises if not), never a second copy the step reads; `fit(sampling=...)`
that differs from the plan's `sampling` raises rather than overriding it.
jax-privacy's `DPExecutionPlan` and Opacus' `DPOptimizer` are the anchors.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple, Optional, Tuple

from tf_pxg import _renamed
from tf_pxg.data import participation
from tf_pxg.data import samplers
from tf_pxg.dp import clipping as clipping_policies
from tf_pxg.dp import mechanisms
from tf_pxg.dp import releases as releases_lib

__all__ = ["ACCOUNTANTS", "DPPlan", "StepNoise"]

#: The accountants `tf_pxg.accounting` offers.
ACCOUNTANTS = ("rdp", "pld")


def _validate_l2_norm_clip(value, owner: str = "l2_norm_clip") -> float:
  """`l2_norm_clip` as a float: positive, not NaN; `inf` means no clipping."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"`{owner}` must be a positive number (float('inf') for "
                    f"no clipping); got {value!r} of type "
                    f"{type(value).__name__}.")
  value = float(value)
  if math.isnan(value) or value <= 0:
    raise ValueError(
        f"`{owner}` must be > 0 (the largest L2 norm an example's gradient "
        f"may have; float('inf') disables clipping); got {value}.")
  return value


def _validate_noise_multiplier(value, owner: str = "noise_multiplier") -> float:
  """`noise_multiplier` as a float: finite and >= 0."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"`{owner}` must be a finite number >= 0; got {value!r} "
                    f"of type {type(value).__name__}.")
  value = float(value)
  if not math.isfinite(value) or value < 0:
    raise ValueError(
        f"`{owner}` must be finite and >= 0 (noise std = noise_multiplier * "
        f"l2_norm_clip; 0 means no noise and no privacy); got {value}.")
  return value


def _validate_dp_params(l2_norm_clip, noise_multiplier,
                       where: str) -> Tuple[Optional[float], Optional[float]]:
  """Both None (settings come from a DPOptimizer) or both valid."""
  if l2_norm_clip is None and noise_multiplier is None:
    return None, None
  if l2_norm_clip is None or noise_multiplier is None:
    missing = "l2_norm_clip" if l2_norm_clip is None else "noise_multiplier"
    raise ValueError(
        f"{where}: `{missing}` is missing. Pass both `l2_norm_clip` and "
        "`noise_multiplier`, or neither and compile with a "
        "`tf_pxg.keras.DPOptimizer` that carries them.")
  return (_validate_l2_norm_clip(l2_norm_clip),
          _validate_noise_multiplier(noise_multiplier))


def _validate_mechanism(l2_norm_clip, noise_multiplier, clipping,
                       noise_mechanism, where: str):
  """`(clipping policy, noise mechanism)`, checked against the settings.

  Raises:
    ValueError: an unknown policy; `Automatic`/`QuantileAdaptive` with an
      infinite `l2_norm_clip` (automatic clipping's sensitivity, the
      adaptive clip's start).
    TypeError: a mechanism that is neither a `tf_pxg.mf` strategy nor a
      `tf_pxg.dp.mechanisms.NoiseMechanism`.
  """
  policy = clipping_policies.get(clipping)
  if (not isinstance(policy, clipping_policies.Flat) and l2_norm_clip is not None and
      not math.isfinite(l2_norm_clip)):
    raise ValueError(
        f"{where}: clipping={policy!r} needs a finite l2_norm_clip (the "
        "sensitivity R of automatic clipping, the initial clip of adaptive "
        f"clipping); got {l2_norm_clip}.")
  try:
    mechanisms.from_setting(noise_mechanism)
  except TypeError as e:
    raise TypeError(f"{where}: {e}") from None
  del noise_multiplier
  return policy, noise_mechanism


class StepNoise(NamedTuple):
  """The noise multipliers of one step, derived from the plan.

  Attributes:
    gradient: σ_g, the gradient noise's multiplier (the accounted σ less
      the side releases' shares; σ itself without side releases).
    releases: the side releases the step computes and noises itself (in
      order: the clipping policy's, `noisy_loss`, `side_releases`); those
      a mechanism draws are only in the split.
  """
  gradient: float
  releases: Tuple[releases_lib.SideRelease, ...]


def _check_releases(side_releases) -> tuple:
  side_releases = tuple(side_releases or ())
  for release in side_releases:
    if (not isinstance(release, releases_lib.SideRelease) or
        release.drawn_by_mechanism or not release.stateful):
      raise TypeError(
          "DPPlan: side_releases must be stateful tf_pxg.dp.releases."
          "SideRelease instances computed by the step (the noisy training "
          f"loss goes in noisy_loss=); got {release!r}.")
  names = [r.name for r in side_releases]
  if len(set(names)) != len(names) or {"loss", "l2_norm_clip"} & set(names):
    raise ValueError(f"DPPlan: side releases need distinct names (their "
                     "log keys), other than 'loss' and 'l2_norm_clip' "
                     f"(the noisy loss's and the adaptive clip's); got "
                     f"{names}.")
  return side_releases


#: The settings a DP model's constructor may request (`DPPlan.absorb`);
#: the accountant and the sampler instance are the owner's alone.
_REQUESTABLE = ("l2_norm_clip", "noise_multiplier", "clipping",
                "noise_mechanism", "secure_mode", "sampling", "noisy_loss",
                "side_releases", "unprotected_training_metrics")

#: Those an owner's plan takes from a request where it has the default
#: (the clip, σ, the policy and the mechanism fix the state the owner
#: builds, so they must agree).
ABSORBED = ("secure_mode", "sampling", "noisy_loss", "side_releases",
            "unprotected_training_metrics")


def _shown(value) -> str:
  """A setting in a message (a sampler class by its name)."""
  return value.__name__ if isinstance(value, type) else repr(value)


@dataclasses.dataclass(frozen=True)
class DPPlan:
  """The frozen DP configuration (module docstring).

  Attributes:
    l2_norm_clip: C (validated by the owner).
    noise_multiplier: sigma.
    clipping: a `tf_pxg.clipping` policy (default `Flat()`).
    noise_mechanism: the mechanism setting (None: independent Gaussian).
    secure_mode: draw noise and sampling keys from the OS CSPRNG.
    sampling: the sampling choice: None (`fit`'s argument decides,
      "poisson" by default) or a sampler class (a `SAMPLINGS` name is
      resolved to its class; module docstring).
    sampler: the run's `tf_pxg.data.samplers.Sampler` instance, or None
      (the owner's plan; `model.dp_plan` holds the one `fit` built).
    accountant: "rdp" or "pld" (the one `PrivacyCallback` reads).
    noisy_loss: a `tf_pxg.keras.NoisyLoss` (the logged training loss, a
      side release), or None.
    side_releases: more `tf_pxg.dp.releases.SideRelease`s (a tuple).
    unprotected_training_metrics: the step also logs the compiled loss
      and metrics of the private batch, un-noised and NOT covered by ε
      (`unprotected_<name>` keys; an opt-in for debugging). It changes
      what a run releases, so it is part of the plan and the privacy
      ledger records it in the run's settings.

  Raises:
    ValueError: an unknown accountant or sampling (an instance included),
      or a sampling whose participation does not fit the mechanism's ε
      (`tf_pxg.data.participation.check`: e.g. shuffled batches with
      BandMF or BLT, which need cyclic Poisson participation).
  """
  l2_norm_clip: Optional[float]
  noise_multiplier: Optional[float]
  clipping: Any = None
  noise_mechanism: Any = None
  secure_mode: bool = False
  sampling: Optional[type] = None
  sampler: Any = None
  accountant: str = "rdp"
  noisy_loss: Any = None
  side_releases: tuple = ()
  unprotected_training_metrics: bool = False

  def __post_init__(self):
    object.__setattr__(self, "clipping",
                       clipping_policies.get(self.clipping))
    object.__setattr__(self, "sampling",
                       samplers.choice(self.sampling, "DPPlan"))
    if self.noisy_loss is not None:
      from tf_pxg.dp.noisy_loss import NoisyLoss  # noqa: PLC0415
      if not isinstance(self.noisy_loss, NoisyLoss):
        raise TypeError(
            "noisy_loss must be None or a tf_pxg.keras.NoisyLoss(bound, "
            f"noise_multiplier); got {self.noisy_loss!r}.")
    object.__setattr__(self, "side_releases",
                       _check_releases(self.side_releases))
    if self.accountant not in ACCOUNTANTS:
      raise ValueError(f"DPPlan: accountant must be one of {ACCOUNTANTS}; "
                       f"got {self.accountant!r}.")
    if self.sampling is not None:
      # The one check that a sampler's participation fits the
      # mechanism's ε (tf_pxg.data.participation); `fit` checks the
      # instance it builds again.
      participation.check(self.sampling, self.mechanism, "DPPlan")

  @property
  def mechanism(self) -> mechanisms.NoiseMechanism:
    """The `NoiseMechanism` the step runs (secure mode wraps it)."""
    return mechanisms.from_setting(self.noise_mechanism, self.secure_mode)

  def releases(self, expected_batch_size: Optional[float]
               ) -> Tuple[releases_lib.SideRelease, ...]:
    """Every private side release of a step, in the split's order: the
    clipping policy's (adaptive clipping's count, whose noise depends on
    the expected batch size B of the run's sampler; None: a plain batch),
    then `_other_releases`."""
    return (tuple(self.clipping.side_releases(expected_batch_size)) +
            self._other_releases())

  def _other_releases(self) -> Tuple[releases_lib.SideRelease, ...]:
    """`noisy_loss`, `side_releases`, then the mechanism's (drawn by it):
    the releases known before the run's batch size is."""
    own = () if self.noisy_loss is None else (self.noisy_loss,)
    mechanism = tuple(releases_lib.MechanismRelease(
        f"{self.noise_mechanism!r}'s selection", m,
        f"Raise the selection_noise_multiplier of {self.noise_mechanism!r} "
        "above noise_multiplier (a few times it leaves most of the budget "
        "to the gradient).")
                      for m in self.mechanism.side_multipliers())
    return own + self.side_releases + mechanism

  def step_noise(self, expected_batch_size: Optional[float]) -> StepNoise:
    """σ_g and the step's own side releases (`StepNoise`); with no noise
    (σ = 0) the releases are not noised either.

    Raises:
      ValueError: the side releases would use the whole budget (named),
        or adaptive clipping's count noise is unknown (no expected batch
        size and no `count_stddev`).
    """
    every = self.releases(expected_batch_size)
    sigma = self.noise_multiplier or 0.0
    gradient = releases_lib.gradient_noise_multiplier(sigma, every, "DPPlan")
    return StepNoise(gradient, tuple(r for r in every
                                     if not r.drawn_by_mechanism))

  @property
  def num_step_releases(self) -> int:
    """How many side releases the step computes itself (`step_noise`'s
    `releases`): the accumulator's extra scalar sums."""
    # How many a policy releases does not depend on the batch size.
    return (len(self.clipping.side_releases(1.0)) +
            int(self.noisy_loss is not None) + len(self.side_releases))

  def check_budget(self) -> None:
    """Raises ValueError now if the side releases known before the run
    (`_other_releases`) would use the whole budget; with adaptive
    clipping's count, whose noise may depend on the run's batch size,
    `step_noise` checks them all at the first step."""
    if self.noise_multiplier:
      releases_lib.gradient_noise_multiplier(
          self.noise_multiplier, self._other_releases(), "DPPlan")

  @property
  def min_separation(self) -> int:
    """b of the b-min-separation participation the mechanism's ε needs
    (1: any)."""
    return int(mechanisms.from_setting(self.noise_mechanism).min_separation)

  num_bands = _renamed.alias("num_bands", "min_separation")

  @property
  def is_default_mechanism(self) -> bool:
    """Flat clipping and independent noise (no optimizer state needed)."""
    return (isinstance(self.clipping, clipping_policies.Flat) and
            self.noise_mechanism is None)

  @property
  def sampling_name(self) -> Optional[str]:
    """The saved form of `sampling` (its `SAMPLINGS` name; None if none is
    chosen). Raises ValueError for a class without a registered name."""
    if self.sampling is None:
      return None
    return samplers.sampling_name(self.sampling)

  def absorb(self, request: "DPPlan", where: str) -> "DPPlan":
    """This plan (an owner's) with a request's settings merged in (the
    settings a DP model's constructor was given, at `compile`).

    A setting the request gives (not its default) must equal this plan's,
    or, for one of `ABSORBED` (settings that need no state built with the
    owner), fill it where this plan has the default; `l2_norm_clip` and
    `noise_multiplier` are given together or not at all. So there is one
    plan, never a second copy that wins.

    Raises:
      ValueError: naming the setting, both values and `where`.
    """
    changes = {}
    defaults = DPPlan(None, None)
    for name in _REQUESTABLE:
      mine, theirs = getattr(request, name), getattr(self, name)
      if mine == getattr(defaults, name) or mine == theirs:
        continue
      if name in ABSORBED and theirs == getattr(defaults, name):
        changes[name] = mine
        continue
      raise ValueError(
          f"{where} has {name}={_shown(mine)} but its DPOptimizer has "
          f"{name}={_shown(theirs)}. Set {name} in one place: on the "
          "DPOptimizer, or on the model (then create the DPOptimizer "
          f"without `{name}`).")
    return self.replace(**changes) if changes else self

  def conflicts(self, other: "DPPlan") -> list:
    """The names of the settings in which `other` differs."""
    return [f.name for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)]

  @classmethod
  def validated(cls, where: str, l2_norm_clip, noise_multiplier, *,
                required: bool, clipping=None, noise_mechanism=None,
                secure_mode=False, sampling=None, accountant: str = "rdp",
                noisy_loss=None, side_releases=(),
                unprotected_training_metrics=False) -> "DPPlan":
    """The one validation of DP settings as users give them, naming
    `where` (a `DPOptimizer`, a DP model's request, `make_private`).

    `required`: the plan's owner (a `DPOptimizer`) needs `l2_norm_clip`
    and `noise_multiplier`; a model's request takes both or neither
    (neither: its DPOptimizer's).

    Raises:
      TypeError/ValueError: a clip that is not > 0, a σ not finite and
        >= 0, one of the pair missing, a policy that needs a finite clip,
        an unknown mechanism, policy, sampling or accountant, a non-bool
        `secure_mode` or `unprotected_training_metrics`, side releases
        that are not releases.
    """
    if required:
      clip = _validate_l2_norm_clip(l2_norm_clip)
      noise = _validate_noise_multiplier(noise_multiplier)
    else:
      clip, noise = _validate_dp_params(l2_norm_clip, noise_multiplier, where)
    for name, flag in (("secure_mode", secure_mode),
                       ("unprotected_training_metrics",
                        unprotected_training_metrics)):
      if not isinstance(flag, bool):
        raise TypeError(f"{where}: {name} must be True or False; got "
                        f"{flag!r}.")
    clipping, noise_mechanism = _validate_mechanism(
        clip, noise, clipping, noise_mechanism, where)
    sampling = samplers.choice(sampling, where)
    if accountant not in ACCOUNTANTS:
      raise ValueError(f"{where}: accountant must be one of {ACCOUNTANTS}; "
                       f"got {accountant!r}.")
    try:
      return cls(clip, noise, clipping, noise_mechanism, secure_mode,
                 sampling=sampling, accountant=accountant,
                 noisy_loss=noisy_loss,
                 side_releases=tuple(side_releases or ()),
                 unprotected_training_metrics=unprotected_training_metrics)
    except TypeError as e:
      raise TypeError(f"{where}: {e}") from None

  def replace(self, **changes) -> "DPPlan":
    return dataclasses.replace(self, **changes)
