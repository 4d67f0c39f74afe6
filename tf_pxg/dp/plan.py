"""`DPPlan`: the DP configuration of a training run, frozen, in one place.

The plan holds everything the privacy guarantee is computed from: the clip
`l2_norm_clip`, the noise multiplier sigma, the clipping policy
(`tf_pxg.clipping`), the noise mechanism setting (`None`, a
`tf_pxg.mf.BandedToeplitz`, or a `tf_pxg.dp.mechanisms.NoiseMechanism`),
secure mode, the sampling and the accountant ("rdp" or "pld").

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
from typing import Any, Optional

from tf_pxg.data import samplers
from tf_pxg.dp import clipping as clipping_policies
from tf_pxg.dp import mechanisms

__all__ = ["ACCOUNTANTS", "DPPlan"]

#: The accountants `tf_pxg.accounting` offers.
ACCOUNTANTS = ("rdp", "pld")


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
    accountant: "rdp" or "pld" (`PrivacyCallback`'s, unless it is given
      one).

  Raises:
    ValueError: an unknown accountant or sampling (an instance included),
      or shuffled sampling with a noise mechanism whose ε needs cyclic
      Poisson participation (BandMF, BLT).
  """
  l2_norm_clip: Optional[float]
  noise_multiplier: Optional[float]
  clipping: Any = None
  noise_mechanism: Any = None
  secure_mode: bool = False
  sampling: Optional[type] = None
  sampler: Any = None
  accountant: str = "rdp"

  def __post_init__(self):
    object.__setattr__(self, "clipping",
                       clipping_policies.get(self.clipping))
    object.__setattr__(self, "sampling",
                       samplers.choice(self.sampling, "DPPlan"))
    if self.accountant not in ACCOUNTANTS:
      raise ValueError(f"DPPlan: accountant must be one of {ACCOUNTANTS}; "
                       f"got {self.accountant!r}.")
    if (self.sampling is not None and
        issubclass(self.sampling, samplers.ShuffledSampler) and
        self.num_bands > 1):
      raise ValueError(
          f"DPPlan: sampling={self.sampling.__name__} (Keras' shuffled "
          f"batches) with noise_mechanism={self.noise_mechanism!r}, whose ε "
          f"needs cyclic Poisson sampling ({self.num_bands} groups, "
          "participations at least that many steps apart). Choose "
          "sampling='poisson' (or leave it unset).")

  @property
  def mechanism(self) -> mechanisms.NoiseMechanism:
    """The `NoiseMechanism` the step runs (secure mode wraps it)."""
    return mechanisms.from_setting(self.noise_mechanism, self.secure_mode)

  @property
  def num_bands(self) -> int:
    """b of the cyclic participation the mechanism's ε needs (1: any)."""
    return int(mechanisms.from_setting(
        self.noise_mechanism).participation_groups)

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

  def conflicts(self, other: "DPPlan") -> list:
    """The names of the settings in which `other` differs."""
    return [f.name for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)]

  def replace(self, **changes) -> "DPPlan":
    return dataclasses.replace(self, **changes)
