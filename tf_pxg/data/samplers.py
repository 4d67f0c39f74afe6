"""Samplers: how a DP run draws its batches, and the event that implies.

A sampler decides which privacy units each logical step trains on and
states the `dp_accounting` event that law implies for a noise mechanism:
`sampler.dp_event(mechanism, noise_multiplier, steps)`. The accountant
(`tf_pxg.accounting.event_epsilon`, `tf_pxg.keras.PrivacyCallback`)
composes that event and nothing else; a DP model's `fit` builds the
sampler from its `sampling=` argument (`resolve`: a registered name or a
class) and a `SamplerConfig`, and never asks which one it has.

The protocol is `Sampler` (`tf_pxg.data.protocol`: every member tf_pxg
reads, with defaults); the participation a sampler gives is its
`participation` (`tf_pxg.data.participation`), which `participation.check`
matches against the noise mechanism's needs before any step.

Implementations (each states its own event):

- `tf_pxg.data.PoissonSampler`: Poisson sampling at rate q = B / N, and
  with `min_separation=b` cyclic Poisson sampling for BandMF/BLT
  (`tf_pxg.accounting.cyclic_poisson_event`).
- `tf_pxg.data.balls_in_bins.BallsInBinsSampler`: one batch per example
  per epoch (its stated upper bound).
- `tf_pxg.data.truncated_poisson.TruncatedPoissonSampler`: Poisson draws
  truncated to one physical batch of B_max rows per step
  (`TruncatedSubsampledGaussianDpEvent`, accounted with PLD).
- `tf_pxg.data.PoissonShards`: the Beam pipeline's cyclic Poisson shards.
- `PrivacyUnits`: units of several rows (user-level DP, augmult) drawn by
  any of the above; the event is the inner sampler's, per unit.
- `ShuffledSampler`: Keras' own shuffled fixed batches; no event (not a
  guarantee: `certified` is False and `dp_event` raises).

A masked sampler (one whose batches `fit` lays out as fixed-shape masked
physical batches, `tf_pxg.data.poisson_dataset`) is a `PoissonSampler`
subclass: it defines `step_indices(step, key)` (TF ops: the sorted
indices of global logical step `step`), `dp_event` and, if its
participation is not (cyclic) Poisson, `schema`; `fit` takes the class as
`sampling=`, or its registered name. That is the whole of adding a sampler:
one file plus a row in tests/test_parts.py (docs/extending.md).

Names. `SAMPLINGS` maps the names `fit(sampling=...)` and
`DPOptimizer(sampling=...)` take to classes ("poisson", "shuffled",
"balls_in_bins", "truncated_poisson"); `register(name, cls)` (or `@register(name)`) adds one,
with the idiom of every part (`tf_pxg.parts`). The built-in samplers'
modules are listed in `tf_pxg.parts.BUILTIN_MODULES` and imported when a
name is first resolved, so no import is needed first. A DP plan's sampling
choice is a class (`choice`) and is saved by its name (`sampling_name`),
which is why a class without one cannot be saved.
"""

from __future__ import annotations

from typing import Optional

from tf_pxg import parts
from tf_pxg.data import participation
from tf_pxg.data import poisson
from tf_pxg.data.protocol import Sampler
from tf_pxg.data.protocol import SamplerConfig

__all__ = ["NotCertifiedError", "PrivacyUnits", "SAMPLINGS", "Sampler",
           "SamplerConfig", "ShuffledSampler", "choice", "known_names",
           "register", "resolve", "sampling_name"]

_KIND = "sampler"


class NotCertifiedError(ValueError):
  """A sampler's batches carry no privacy guarantee to account."""


class ShuffledSampler(Sampler):
  """Keras' own data path: shuffled fixed batches (or a dataset's batches),
  each one step divided by its realised size.

  Not a guarantee: the Poisson ε does not hold for shuffled batches, which
  can be much less private (Chua et al., "How Private are DP-SGD
  Implementations?", ICML 2024). `certified` is False and `dp_event`
  raises `NotCertifiedError`; `PrivacyCallback` refuses to report an ε for
  it, or (`allow_shuffled=True`) logs the Poisson figure under
  `epsilon_if_poisson`, with a warning.

  Args:
    num_examples: N if known (arrays), else None.
    batch_size: the fixed batch size if known, else None.
  """
  certified = False
  schema = participation.Participation("shuffled", 1, certified=False)

  def __init__(self, num_examples: Optional[int] = None,
               batch_size: Optional[int] = None):
    self.num_examples = num_examples
    self.batch_size = batch_size

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """Raises `NotCertifiedError`: shuffled batches have no certified
    event (class docstring)."""
    raise NotCertifiedError(
        f"{type(self).__name__}: fit trained on shuffled fixed batches "
        "(sampling='shuffled'); no dp-accounting event holds for them (the "
        "Poisson ε can be far too small for shuffled batches). Use "
        "sampling='poisson' (the default) for a guarantee.")


class PrivacyUnits(Sampler):
  """A sampler of privacy units of several rows, drawn by `inner`.

  User-level DP (`fit(user_ids=..., examples_per_user=k)`): `inner` samples
  the U users; each sampled user's unit is up to k of their examples.
  Augmentation multiplicity (`fit(augmult=K)`): each sampled example's
  unit is its K augmented copies. Either way one unit reaches the update
  through one clipped vector (the mean of its rows' gradients), so the
  mechanism run on units is `inner`'s mechanism run on examples, and the
  event is `inner.dp_event`, with ε per unit (per user for user-level).

  Args:
    inner: the sampler of units (any masked sampler, e.g. `PoissonSampler`
      over U users, or `BallsInBinsSampler`).
    privacy_unit: "example" (augmult) or "user".
    augmult: K copies of each example.
    examples_per_user: k for user-level units, else None.
  """
  def __init__(self, inner, privacy_unit: str = "example", augmult: int = 1,
               examples_per_user: Optional[int] = None):
    if privacy_unit not in ("example", "user"):
      raise ValueError(f"PrivacyUnits: privacy_unit must be 'example' or "
                       f"'user'; got {privacy_unit!r}.")
    self.inner = inner
    self.privacy_unit = privacy_unit
    self.augmult = int(augmult)
    self.examples_per_user = examples_per_user

  num_examples = property(lambda self: self.inner.num_examples)
  expected_batch_size = property(
      lambda self: self.inner.expected_batch_size)
  sampling_rate = property(lambda self: self.inner.sampling_rate)
  min_separation = property(lambda self: self.inner.min_separation)
  steps_per_epoch = property(lambda self: self.inner.steps_per_epoch)
  certified = property(lambda self: self.inner.certified)
  participation = property(lambda self: self.inner.participation)

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """`inner.dp_event(...)`: the units are what `inner` samples."""
    return self.inner.dp_event(mechanism, noise_multiplier, steps)


#: `fit(sampling=...)`'s names and the sampler classes they stand for; the
#: name is also how a `DPOptimizer(sampling=...)` choice is saved
#: (`sampling_name`). `register` adds to it; the built-ins' modules are
#: `tf_pxg.parts.BUILTIN_MODULES["sampler"]`.
SAMPLINGS = {}

# What `fit` can draw from: Keras' batches or the masked stream
# (`tf_pxg.keras._poisson_fit` has one builder for each).
_BASES = (poisson.PoissonSampler, ShuffledSampler)


def _not_a_sampler(cls) -> Optional[str]:
  if isinstance(cls, type) and issubclass(cls, _BASES):
    return None
  return ("not a subclass of tf_pxg.data.PoissonSampler (masked batches) "
          "or ShuffledSampler, the two data paths fit has.")


def register(name: str, sampler_class: Optional[type] = None, *,
             override: bool = False):
  """Registers a sampler class under `name` in `SAMPLINGS`
  (`tf_pxg.parts.add`: the idiom of every part).

  `fit(sampling=name)` then builds it, and a `DPOptimizer(sampling=cls)`
  is saved as `name` (load the model in a process that has registered it
  again, as for Keras' custom objects; the built-ins are loaded by name).
  Usable as a decorator, `@register("full_batch")`.

  Raises:
    ValueError: `name` is taken by another class (pass `override=True`),
      or the class is not a `PoissonSampler` or `ShuffledSampler` subclass.
  """
  return parts.add(SAMPLINGS, _KIND, name, sampler_class, override=override,
                   check=_not_a_sampler)


register("poisson", poisson.PoissonSampler)
register("shuffled", ShuffledSampler)


def known_names() -> tuple:
  """The names `resolve` takes (`SAMPLINGS`' keys, the built-ins loaded)."""
  parts.load_builtins(_KIND)
  return tuple(SAMPLINGS)


def _names() -> str:
  return ", ".join(repr(name) for name in known_names())


def resolve(sampling) -> type:
  """The sampler class of `fit(sampling=...)`: a name of `SAMPLINGS` (the
  built-in samplers' modules are imported first if the name is not yet
  known), or a sampler class (`ShuffledSampler`, or a `PoissonSampler`
  subclass, built by `fit` with `PoissonSampler.from_config`). (`fit`
  also takes an instance of such a class: it resolves the instance's
  class.)

  Raises:
    ValueError: anything else (the message lists the names).
  """
  if isinstance(sampling, str):
    if sampling not in SAMPLINGS:
      parts.load_builtins(_KIND)
    if sampling in SAMPLINGS:
      return SAMPLINGS[sampling]
  if isinstance(sampling, type) and issubclass(sampling, _BASES):
    return sampling
  raise ValueError(
      f"`sampling` must be one of {_names()} ('poisson', the default, is "
      "the sampling DP-SGD's ε assumes) or a tf_pxg.data sampler class such "
      f"as BallsInBinsSampler (a PoissonSampler subclass); got {sampling!r}.")
def choice(sampling, where: str) -> Optional[type]:
  """A DP plan's sampling choice: None (not chosen) or the sampler class
  `resolve(sampling)`; an instance is refused (it is built from the data:
  give it to `fit`).

  Raises:
    ValueError: naming `where`, the argument, and what it accepts.
  """
  if sampling is None:
    return None
  if not isinstance(sampling, (str, type)):
    raise ValueError(
        f"{where}: sampling must be None, one of {_names()} or a sampler "
        f"class; got the instance {sampling!r}. A sampler instance is "
        "built from the data: pass its class (or name) here, or the "
        "instance to fit(sampling=...).")
  try:
    return resolve(sampling)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def sampling_name(sampler_class: type) -> str:
  """The name a sampler class is saved under: its `SAMPLINGS` key (the
  class itself, not a subclass of the same name, e.g. one made by
  `BallsInBinsSampler.configured(...)`).

  Raises:
    ValueError: the class has no name (register it with `register`).
  """
  parts.load_builtins(_KIND)
  name = parts.name_of(SAMPLINGS, sampler_class)
  if name is not None:
    return name
  raise ValueError(
      f"The sampler class {sampler_class!r} has no registered name, so a "
      "DP plan that chose it cannot be saved (a class made by "
      "BallsInBinsSampler.configured(...) is a new class). Register it, "
      "tf_pxg.data.samplers.register('my_sampling', cls), before saving and "
      "before loading; or choose the sampling in fit(sampling=...), which "
      "is not saved.")
