"""The `Sampler` protocol and the `SamplerConfig` samplers are built from.

`Sampler` names every member tf_pxg reads of a sampler (the accountant,
`PrivacyCallback`, the ledger, `fit` and the `tf.data` stream), with the
defaults a new sampler inherits; `tf_pxg.data.samplers` re-exports it and
lists the implementations. `SamplerConfig` is the frozen configuration a
masked sampler is built from (`PoissonSampler.from_config(config)`): `fit`
fills one from the data and the model, and a new sampler reads it instead
of copying `PoissonSampler`'s constructor.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from tf_pxg import _renamed
from tf_pxg.data import participation as participation_lib

__all__ = ["Sampler", "SamplerConfig"]


class Sampler:
  """What tf_pxg reads of a sampler, with the defaults of a subclass.

  Attributes:
    privacy_unit: "example" or "user": what one ε protects.
    certified: whether `dp_event` is a guarantee (False: Keras' shuffled
      batches, whose `dp_event` raises).
    num_examples: the number of privacy units sampled from (N, or U; None
      if unknown).
    expected_batch_size: B, the data-independent divisor of a step's noisy
      sum (None: the realised batch size, shuffled batches).
    sampling_rate: q, the probability that a unit joins a step it is
      eligible for (None when there is none).
    steps_per_epoch: logical steps of one epoch (None if unknown).
    min_separation: b of the sampler's participation: a unit joins only
      steps `g mod b` of its group g (1: any step). Called `num_groups`
      before (a deprecated alias).
    schema: the class's `tf_pxg.data.participation.Participation` (its
      `min_separation` None when the config sets it); `participation` is
      the instance's.

    step_indices: None, or a method `step_indices(step, key)`: a masked
      sampler's own selection (see `PoissonSampler`; None there is the
      stream's (cyclic) Poisson selection, and a sampler without a
      stream has none).
    group_index: the `tf_pxg.data.poisson.GroupIndex` of the cyclic
      groups (None without groups).
    ledger_settings: more settings (a JSON-able dict) the privacy
      ledger records for a run of this sampler, e.g. the event it states
      when the sampler's class name does not say it (`tf_pxg.data.
      truncated_poisson`); default none.

  Masked samplers (`PoissonSampler` and its subclasses, whose batches `fit`
  lays out as fixed-shape masked physical batches) also have the layout
  (`physical_batch_size`, `accumulation_steps`, `num_replicas`) and the
  stream's randomness (`seed`, `secure_mode`, `group_seed`).
  """
  privacy_unit: str = "example"
  certified: bool = True
  num_examples: Optional[int] = None
  expected_batch_size: Optional[float] = None
  sampling_rate: Optional[float] = None
  steps_per_epoch: Optional[int] = None
  min_separation: int = 1
  schema: participation_lib.Participation = participation_lib.Participation(
      "sampler")
  step_indices = None
  group_index = None
  ledger_settings: dict = {}

  num_groups = _renamed.alias("num_groups", "min_separation")

  @property
  def participation(self) -> participation_lib.Participation:
    """The instance's schema: `schema` at its `min_separation` and rate."""
    return dataclasses.replace(self.schema,
                               min_separation=int(self.min_separation),
                               sampling_rate=self.sampling_rate)

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """The `dp_accounting.DpEvent` of `steps` logical steps of this
    sampler with `mechanism` (a `tf_pxg.dp.mechanisms.NoiseMechanism`) at
    `noise_multiplier`; None if no ε is claimed for that many steps.

    Raises:
      NotImplementedError: a sampler must state its event.
    """
    raise NotImplementedError(
        f"{type(self).__name__} states no dp_event: a sampler must say "
        "which dp-accounting event its batches imply (docs/extending.md).")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """The frozen configuration of a masked sampler (`PoissonSampler`'s
  arguments, which document each field).

  Attributes:
    num_examples: N (or the number of units U).
    expected_batch_size: B.
    physical_batch_size: P (None: the default for B, k, R).
    accumulation_steps: k.
    num_replicas: R.
    steps_per_epoch: logical steps per epoch (None: the default).
    seed: the stream's seed (None: OS entropy; must be None in secure
      mode).
    secure_mode: every step's randomness from the OS CSPRNG.
    start_step: the global index of the first logical step drawn.
    min_separation: b of cyclic participation (1: plain Poisson).
    group_seed: the secret key of the cyclic groups (required for b > 1).

  A sampler's `config` is its resolved configuration (defaults filled in,
  the drawn seed included), so `type(s).from_config(s.config)` draws the
  same steps as `s`.
  """
  num_examples: int
  expected_batch_size: float
  physical_batch_size: Optional[int] = None
  accumulation_steps: int = 1
  num_replicas: int = 1
  steps_per_epoch: Optional[int] = None
  seed: Optional[int] = None
  secure_mode: bool = False
  start_step: int = 0
  min_separation: int = 1
  group_seed: Optional[int] = None

  def replace(self, **changes) -> "SamplerConfig":
    """A copy with `changes`."""
    return dataclasses.replace(self, **changes)

  def kwargs(self) -> dict:
    """The fields as the keyword arguments of a sampler's constructor."""
    return dataclasses.asdict(self)

  @classmethod
  def of(cls, *args, num_groups: Optional[int] = _renamed.NOT_GIVEN,
         where: str = "PoissonSampler", **kwargs) -> "SamplerConfig":
    """A config from a `SamplerConfig` or from `PoissonSampler`'s
    arguments (`num_groups=`, the deprecated name of `min_separation`,
    included).

    Raises:
      TypeError: unknown arguments; a config together with arguments;
        `num_groups` and `min_separation` both given, differently.
    """
    return cls.named(*args, num_groups=num_groups, where=where, depth=5,
                     **kwargs)[0]

  @classmethod
  def named(cls, *args, num_groups: Optional[int] = _renamed.NOT_GIVEN,
            where: str = "PoissonSampler", depth: int = 4,
            **kwargs) -> Tuple["SamplerConfig", str]:
    """`of`, and the name the caller gave b by ("min_separation", or
    "num_groups" if it used the deprecated name), for error messages.
    `depth`: frames from here up to the user's call (for the warning)."""
    if args and isinstance(args[0], cls):
      if len(args) > 1 or kwargs or num_groups is not _renamed.NOT_GIVEN:
        raise TypeError(f"{where}: give a SamplerConfig or its arguments, "
                        "not both.")
      return args[0], "min_separation"
    name = "min_separation"
    if num_groups is not _renamed.NOT_GIVEN:
      kwargs["min_separation"], name = _renamed.argument(
          kwargs.get("min_separation", 1), num_groups, new="min_separation",
          old="num_groups", where=where, default=1, depth=depth)
    try:
      return cls(*args, **kwargs), name
    except TypeError as e:
      raise TypeError(f"{where}: {e}") from None
