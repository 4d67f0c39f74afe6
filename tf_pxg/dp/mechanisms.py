"""`NoiseMechanism`: the noise of a DP step as one part with a small protocol.

A DP-SGD step is clip -> add noise -> normalise (Abadi et al. 2016). The
middle part varies: independent Gaussian noise, BandMF's correlated noise
(`tf_pxg.dp.correlated`), buffered Toeplitz noise (`tf_pxg.dp.blt`), the
secure source (`tf_pxg.dp.secure`), a sparse-row mechanism. The Keras train step
(`tf_pxg.keras._train_step.dp_gradients`) composes them without asking which
one it has; everything that differs between mechanisms is behind this
protocol (the Optax/jax-privacy "privatizer" with `init`/`update` state):

- `init_state(variables)`: the mechanism's state for these trainable
  variables (e.g. BandMF's noise buffers), created once, in the strategy
  scope, by the `DPOptimizer` that owns it (saved with it); None if none.
- `add(clipped_sum, state, step, *, noise_multiplier, l2_norm_clip,
  num_replicas, source, normalizer=None, write=None) -> (noisy_sum, state)`:
  one replica's share of the step's noise added to its clipped sums (the
  shares of R replicas sum, through the all-reduce, to the whole noise,
  once: `tf_pxg.dp.noise.replica_noise_stddev`), divided by `normalizer`
  when given (in the noise's pass where the kernel can). `step` is the
  logical step index (`optimizer.iterations`); `write` (scalar bool or
  None: always) gates any state update: a step that will not be applied
  (past the step limit, or not a logical step's end) must leave the state
  as it was, so a resumed or limited run never replays or skips noise.
- `dp_event(noise_multiplier)`: the `dp_accounting` event of ONE
  participation of one unit under this mechanism (the sampler composes it:
  `tf_pxg.accounting`), valid under the participation schema
  `min_separation` states; or, with `whole_run_event`, the event of the
  whole run of at most `num_steps` steps (not to be composed).
- `min_separation`: b such that the event holds when each unit
  participates only at steps `i = g mod b` of its group g (cyclic
  sampling; 1: any step, e.g. Poisson sampling): b-min-separation
  participation (Choquette-Choo et al. 2023). `participation_groups` is
  its deprecated name. `tf_pxg.data.participation.check` refuses a
  sampler that does not give it, before any step.
- `whole_run_event`, `num_steps`: whether `dp_event` is the whole run's
  event (BLT), and the most steps it covers (None: any number).
- `noise_source(generator)`: where the randomness comes from (the model's
  `tf.random.Generator`, or OS keys in secure mode); the train step uses
  it for every noise it draws (also the private scalars').
- `noise_dtype(dtype)`: the dtype `add` returns for a sum of `dtype`.
- `state_variables(state)`: the `tf.Variable`s of `state` (saved in the
  `.keras` file and checkpoints, in this order).

Names. `MECHANISMS` maps names to mechanism classes ("independent_gaussian",
"band_mf", "secure_gaussian", "blt"); `register(name, cls)` (or
`@register(name)`) adds one, with the idiom of every part
(`tf_pxg.parts`; the built-ins' modules are listed in
`tf_pxg.parts.BUILTIN_MODULES` and imported when a name is resolved), and
`from_setting` takes the name of a mechanism built without arguments.

A mechanism is also a saved setting: `get_config()` and `from_config`, and
`serialize`/`deserialize` below store its module so that a mechanism
defined in any `tf_pxg` module round-trips through Keras saving without a
registry to edit. `from_setting` turns the public settings
(`noise_mechanism=None | tf_pxg.mf.BandedToeplitz(...) | a NoiseMechanism`,
`secure_mode`) into the mechanism the step runs.

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Choquette-Choo et al., "Amplified Banded Matrix Factorization", NeurIPS
  2023 (BandMF).
"""

from __future__ import annotations

import importlib
from typing import Any, List, Optional, Sequence, Tuple

import dp_accounting
import tensorflow as tf

from tf_pxg import _renamed
from tf_pxg import parts
from tf_pxg import mf
from tf_pxg.dp import correlated
from tf_pxg.dp import noise as dp_noise
from tf_pxg.dp import secure

__all__ = [
    "BandMF",
    "IndependentGaussian",
    "MECHANISMS",
    "NoiseMechanism",
    "SecureGaussian",
    "deserialize",
    "from_setting",
    "known_names",
    "register",
    "resolve",
    "serialize",
]

_KIND = "noise mechanism"

#: Names -> mechanism classes (`register` adds one; module docstring).
MECHANISMS = {}


def _not_a_mechanism(cls) -> Optional[str]:
  if isinstance(cls, type) and issubclass(cls, NoiseMechanism):
    return None
  return "not a subclass of tf_pxg.dp.mechanisms.NoiseMechanism."


def register(name: str, mechanism_class: Optional[type] = None, *,
             override: bool = False):
  """Registers a `NoiseMechanism` class under `name` in `MECHANISMS`
  (`tf_pxg.parts.add`: the idiom of every part). Usable as a decorator,
  `@register("my_noise")`.

  Raises:
    ValueError: `name` is taken by another class (pass `override=True`),
      or the class is not a `NoiseMechanism` subclass.
  """
  return parts.add(MECHANISMS, _KIND, name, mechanism_class,
                   override=override, check=_not_a_mechanism)


def known_names() -> tuple:
  """The registered names (`MECHANISMS`' keys, the built-ins loaded)."""
  parts.load_builtins(_KIND)
  return tuple(MECHANISMS)


def resolve(name: str) -> type:
  """The mechanism class registered as `name` (the built-ins' modules are
  imported first if it is not yet known).

  Raises:
    ValueError: an unknown name (the message lists the names).
  """
  if name not in known_names():
    raise ValueError(f"Unknown noise mechanism {name!r}; registered: "
                     f"{', '.join(repr(n) for n in MECHANISMS)}.")
  return MECHANISMS[name]


class NoiseMechanism:
  """The protocol (module docstring), with the defaults of a stateless
  mechanism whose noise is independent across steps."""

  #: b of the cyclic participation its `dp_event` assumes (1: any): its
  #: b-min-separation participation (module docstring).
  min_separation = 1
  #: Whether `dp_event` is the event of the whole run (not composed).
  whole_run_event = False
  #: The most steps a whole-run event covers (None: any).
  num_steps = None
  participation_groups = _renamed.alias("participation_groups",
                                        "min_separation")
  #: Whether `init_state` makes state (kept by a `DPOptimizer`).
  stateful = False
  #: Whether `add` can run inside XLA-compiled code.
  supports_xla = True

  def init_state(self, variables: Sequence[tf.Variable]) -> Any:
    del variables
    return None

  def state_variables(self, state) -> List[tf.Variable]:
    del state
    return []

  def noise_dtype(self, dtype: tf.DType) -> tf.DType:
    return dtype

  def noise_source(self, generator):
    return generator

  def prepare(self, tape, variables, *, state=None, batch_size, mask=None,
              step_end=None, xla=False):
    """Reads what `add` needs from the recorded batch, after the forward
    pass and before the tape's gradient drops the recording (a sparse-row
    mechanism: the ids each example gathers, `tf_pxg.dp.sparse_selection`).
    `state` is the run's `tf_pxg.dp.step_state.StepState`, where a
    mechanism keeps what it accumulates over a logical step's physical
    batches (None: a plain batch outside a DP optimizer). Default:
    nothing."""
    del tape, variables, state, batch_size, mask, step_end, xla

  def side_multipliers(self) -> tuple:
    """Sensitivity-1 noise multipliers of private side releases `add` makes
    on the same batch (DP-AdaFEST's row selection): the gradient gives up
    their shares `m^-2` of the accounted `sigma^-2`. Default: none."""
    return ()

  def add(self, clipped_sum: Sequence[tf.Tensor], state, step, *,
          noise_multiplier: float, l2_norm_clip, num_replicas: int, source,
          normalizer=None, write=None) -> Tuple[List[tf.Tensor], Any]:
    raise NotImplementedError

  def dp_event(self, noise_multiplier: float) -> dp_accounting.DpEvent:
    raise NotImplementedError

  def get_config(self) -> dict:
    return {}

  @classmethod
  def from_config(cls, config: dict):
    return cls(**config)

  def __eq__(self, other):
    return type(self) is type(other) and self.get_config() == \
        other.get_config()

  def __hash__(self):
    return hash(type(self))

  def __repr__(self):
    args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
    return f"{type(self).__name__}({args})"


def _divide(grads, normalizer):
  return [g / tf.cast(normalizer, g.dtype) for g in grads]


@register("independent_gaussian")
class IndependentGaussian(NoiseMechanism):
  """DP-SGD's noise: `N(0, (sigma C)^2)` per coordinate, fresh every step.

  Each of R replicas adds `N(0, (sigma C)^2 / R)` (independent streams), so
  the all-reduced sum has the whole noise once. Its event per
  participation is `GaussianDpEvent(sigma)` (sensitivity C).
  """

  def add(self, clipped_sum, state, step, *, noise_multiplier, l2_norm_clip,
          num_replicas, source, normalizer=None, write=None):
    del step, write
    sums = list(clipped_sum)
    if not noise_multiplier:
      sums = [dp_noise.densify(g) for g in sums]
      return (sums if normalizer is None else _divide(sums, normalizer),
              state)
    stddev = dp_noise.replica_noise_stddev(noise_multiplier * l2_norm_clip,
                                           num_replicas)
    # float64, so float64 gradients get a float64 reciprocal; the kernel
    # divides in its own pass (one pass over the weights fewer).
    scale = (None if normalizer is None else
             1.0 / tf.cast(normalizer, tf.float64))
    noisy = dp_noise.add_gaussian_noise(sums, stddev, generator=source,
                                        scale=scale)
    return [dp_noise.densify(g) for g in noisy], state

  def dp_event(self, noise_multiplier):
    return dp_accounting.GaussianDpEvent(noise_multiplier)


@register("band_mf")
class BandMF(NoiseMechanism):
  """BandMF's correlated noise `x = C^-1 z`, streamed from `b - 1` buffers.

  `strategy` is a `tf_pxg.mf.BandedToeplitz` with `num_bands = b > 1`
  (b = 1 is DP-SGD: `from_setting` gives `IndependentGaussian`). The state
  is a `tf_pxg.dp.correlated.NoiseBuffers`; the recurrence and the
  distribution over replicas are in `tf_pxg.dp.correlated`. Its event per
  participation is `GaussianDpEvent(sigma)`, valid when each unit
  participates only at steps `b` apart (`min_separation = b`, cyclic
  Poisson sampling with b groups): the columns of C at those steps do not
  overlap and each has norm <= 1 (Choquette-Choo et al. 2023).
  """

  def __init__(self, strategy):
    if int(strategy.num_bands) < 2:
      raise ValueError(
          f"BandMF needs num_bands >= 2 (b = 1 is DP-SGD: use "
          f"IndependentGaussian); got {strategy!r}.")
    self.strategy = strategy

  stateful = True

  @property
  def min_separation(self) -> int:
    """b: the strategy's `min_separation` (its band count)."""
    return int(self.strategy.min_separation)

  @property
  def coefs(self):
    return self.strategy.coefs

  def init_state(self, variables):
    return correlated.NoiseBuffers(variables, self.strategy.num_bands)

  def state_variables(self, state):
    return [] if state is None else list(state.buffers)

  def noise_dtype(self, dtype):
    return correlated.buffer_dtype(dtype)

  def add(self, clipped_sum, state, step, *, noise_multiplier, l2_norm_clip,
          num_replicas, source, normalizer=None, write=None):
    stddev = dp_noise.replica_noise_stddev(
        noise_multiplier * tf.cast(l2_norm_clip, tf.float64), num_replicas)
    scale = (None if normalizer is None else
             1.0 / tf.cast(normalizer, tf.float64))
    noisy = correlated.correlated_noisy_sums(
        [dp_noise.densify(g) for g in clipped_sum], self.strategy.coefs,
        state, step, stddev, source, scale=scale, write=write)
    return noisy, state

  def dp_event(self, noise_multiplier):
    return dp_accounting.GaussianDpEvent(noise_multiplier)

  def get_config(self):
    return {"strategy": serialize(self.strategy)}

  @classmethod
  def from_config(cls, config):
    return cls(deserialize(config["strategy"]))


@register("secure_gaussian")
class SecureGaussian(NoiseMechanism):
  """`inner`'s noise with the secure source (`tf_pxg.dp.secure`): every
  key from the OS CSPRNG, a sum of four Gaussians per coordinate. The law
  of the noise is `inner`'s, so is the event; not inside XLA."""

  supports_xla = False

  def __init__(self, inner: NoiseMechanism):
    self.inner = inner

  # The inner mechanism's contract, member by member (the base class's
  # defaults would otherwise hide the inner values).
  min_separation = property(lambda self: self.inner.min_separation)
  whole_run_event = property(lambda self: self.inner.whole_run_event)
  num_steps = property(lambda self: self.inner.num_steps)

  @property
  def stateful(self):
    return self.inner.stateful

  def init_state(self, variables):
    return self.inner.init_state(variables)

  def state_variables(self, state):
    return self.inner.state_variables(state)

  def noise_dtype(self, dtype):
    return self.inner.noise_dtype(dtype)

  def noise_source(self, generator):
    del generator
    return secure.SecureNoiseSource()

  def add(self, clipped_sum, state, step, **kwargs):
    kwargs["source"] = self.noise_source(kwargs.get("source"))
    return self.inner.add(clipped_sum, state, step, **kwargs)

  def dp_event(self, noise_multiplier):
    return self.inner.dp_event(noise_multiplier)

  def get_config(self):
    return {"inner": serialize(self.inner)}

  @classmethod
  def from_config(cls, config):
    return cls(deserialize(config["inner"]))

  def __getattr__(self, name):  # the inner mechanism's own attributes
    if name == "inner":
      raise AttributeError(name)
    return getattr(self.inner, name)


def from_setting(noise_mechanism=None,
                 secure_mode: bool = False) -> NoiseMechanism:
  """The `NoiseMechanism` of the public settings.

  Args:
    noise_mechanism: None (DP-SGD), a `tf_pxg.mf.BandedToeplitz` (b = 1:
      DP-SGD exactly; b > 1: `BandMF`), a `NoiseMechanism`, or the name of
      a registered mechanism built without arguments
      ("independent_gaussian").
    secure_mode: wrap it in `SecureGaussian`.

  Raises:
    TypeError: for anything else (an unknown name included), or a name
      whose class needs arguments (the message says to pass an instance).
  """
  if noise_mechanism is None:
    mech = IndependentGaussian()
  elif isinstance(noise_mechanism, NoiseMechanism):
    mech = noise_mechanism
  elif isinstance(noise_mechanism, str) and noise_mechanism in known_names():
    cls = MECHANISMS[noise_mechanism]
    try:
      mech = cls()
    except TypeError as e:
      raise TypeError(
          f"noise_mechanism={noise_mechanism!r}: {cls.__name__} needs "
          f"arguments ({e}); pass an instance, e.g. "
          f"{cls.__name__}(...).") from None
  elif isinstance(noise_mechanism, mf.BandedToeplitz):
    mech = (IndependentGaussian() if int(noise_mechanism.num_bands) == 1
            else BandMF(noise_mechanism))
  else:
    raise TypeError(
        "noise_mechanism must be None (DP-SGD), a "
        "tf_pxg.mf.BandedToeplitz(num_bands=b), a "
        "tf_pxg.dp.mechanisms.NoiseMechanism, or the name of one built "
        f"without arguments ({', '.join(repr(n) for n in known_names())}); "
        f"got {noise_mechanism!r}.")
  if secure_mode and not isinstance(mech, SecureGaussian):
    mech = SecureGaussian(mech)
  return mech


def serialize(obj) -> Optional[dict]:
  """`{"class_name", "config"}` (and `"module"` outside `tf_pxg.mf`) of a
  noise mechanism setting; None stays None."""
  if obj is None:
    return None
  out = {"class_name": type(obj).__name__, "config": obj.get_config()}
  module = type(obj).__module__
  if not module.startswith("tf_pxg.mf"):
    out["module"] = module
  return out


def deserialize(config):
  """The setting of `serialize`'s dict (an instance or None passes).

  Only classes of `tf_pxg` modules are loaded (a saved file names the
  module; nothing else is imported from it).

  Raises:
    ValueError: an unknown class, or a module outside `tf_pxg`.
  """
  if config is None or not isinstance(config, dict):
    return config
  module_name = config.get("module", "tf_pxg.mf")
  if module_name != "tf_pxg" and not module_name.startswith("tf_pxg."):
    raise ValueError(
        f"Noise mechanism {config!r}: only tf_pxg modules are loaded from a "
        "saved config; pass the object itself to DPOptimizer instead.")
  cls = getattr(importlib.import_module(module_name),
                config.get("class_name", ""), None)
  if cls is None:
    raise ValueError(f"Unknown noise mechanism {config!r}; expected a "
                     "tf_pxg.mf class such as BandedToeplitz or a "
                     "tf_pxg NoiseMechanism.")
  return cls.from_config(config["config"])
