"""The `Sampler` protocol: how a DP run draws its batches, and its event.

A sampler decides which privacy units each logical step trains on and
states the `dp_accounting` event that law implies for a noise mechanism:
`sampler.dp_event(mechanism, noise_multiplier, steps)`. The accountant
(`tf_pxg.accounting.event_epsilon`, `tf_pxg.keras.PrivacyCallback`)
composes that event and nothing else; a DP model's `fit` builds the
sampler from its `sampling=` argument (`resolve`, one table from the
strings users pass to classes) and never asks which one it has.

Implementations (each states its own event):

- `tf_pxg.data.PoissonSampler`: Poisson sampling at rate q = B / N, and
  with `num_groups=b` cyclic Poisson sampling for BandMF/BLT
  (`tf_pxg.accounting.cyclic_poisson_event`).
- `tf_pxg.data.balls_in_bins.BallsInBinsSampler`: one batch per example
  per epoch (its stated upper bound).
- `tf_pxg.data.PoissonShards`: the Beam pipeline's cyclic Poisson shards.
- `PrivacyUnits`: units of several rows (user-level DP, augmult) drawn by
  any of the above; the event is the inner sampler's, per unit.
- `ShuffledSampler`: Keras' own shuffled fixed batches; no event (not a
  guarantee: `certified` is False and `dp_event` raises).

A masked sampler (one whose batches `fit` lays out as fixed-shape masked
physical batches, `tf_pxg.data.poisson_dataset`) is a `PoissonSampler`
subclass: it overrides `step_indices(step, key)` (TF ops: the sorted
indices of global logical step `step`) and `dp_event`, and `fit` takes the
class as `sampling=`. That is the whole of adding a sampler: one file
(see `tests/test_samplers.py`, which defines one in the test).
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from tf_pxg.data import poisson

__all__ = ["NotCertifiedError", "PrivacyUnits", "SAMPLINGS", "Sampler",
           "ShuffledSampler", "resolve"]


@runtime_checkable
class Sampler(Protocol):
  """What the accountant and `fit` read of a sampler.

  Attributes:
    privacy_unit: "example" or "user": what one ε protects.
    certified: whether `dp_event` is a guarantee (False: Keras' shuffled
      batches, whose `dp_event` raises).
    num_examples: the number of privacy units sampled from (N, or U).
    expected_batch_size: B, the data-independent divisor of a step's
      noisy sum (None: the realised batch size, shuffled batches).
    sampling_rate: q, the probability that a unit joins a step it is
      eligible for (None when there is none).
    num_groups: b of a cyclic participation schema (1: none).
  """
  privacy_unit: str
  certified: bool
  num_examples: Optional[int]
  expected_batch_size: Optional[float]
  sampling_rate: Optional[float]
  num_groups: int

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """The `dp_accounting.DpEvent` of `steps` logical steps of this
    sampler with `mechanism` (a `tf_pxg.dp.mechanisms.NoiseMechanism`) at
    `noise_multiplier`; None if no ε is claimed for that many steps."""


class NotCertifiedError(ValueError):
  """A sampler's batches carry no privacy guarantee to account."""


class ShuffledSampler:
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
  privacy_unit = "example"
  certified = False
  num_groups = 1
  expected_batch_size = None
  sampling_rate = None

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


class PrivacyUnits:
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
  certified = True

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
  num_groups = property(lambda self: getattr(self.inner, "num_groups", 1))
  steps_per_epoch = property(lambda self: self.inner.steps_per_epoch)

  def dp_event(self, mechanism, noise_multiplier: float, steps: int):
    """`inner.dp_event(...)`: the units are what `inner` samples."""
    return self.inner.dp_event(mechanism, noise_multiplier, steps)


#: `fit(sampling=...)`'s strings and the sampler classes they stand for.
SAMPLINGS = {"poisson": poisson.PoissonSampler, "shuffled": ShuffledSampler}


def resolve(sampling) -> type:
  """The sampler class of `fit(sampling=...)`: a name of `SAMPLINGS`, or a
  sampler class (`ShuffledSampler`, or a `PoissonSampler` subclass, built
  by `fit` with `PoissonSampler`'s arguments). (`fit` also takes an
  instance of such a class: it resolves the instance's class.)

  Raises:
    ValueError: anything else (the message lists the names).
  """
  if isinstance(sampling, str) and sampling in SAMPLINGS:
    return SAMPLINGS[sampling]
  if isinstance(sampling, type) and issubclass(
      sampling, tuple(SAMPLINGS.values())):
    return sampling
  names = ", ".join(repr(name) for name in SAMPLINGS)
  raise ValueError(
      f"`sampling` must be one of {names} ('poisson', the default, is the "
      "sampling DP-SGD's ε assumes) or a tf_pxg.data sampler class such as "
      f"BallsInBinsSampler (a PoissonSampler subclass); got {sampling!r}.")
