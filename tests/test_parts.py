"""The plug points (issue 42): samplers, noise mechanisms and clipping
policies declare their contracts, register one way, and are checked
against each other in one place.

- A table with a case for every registered part of the three kinds
  (`PARTS`); `test_every_registered_part_has_a_case` fails when a part is
  registered without one, as `test_every_registered_op_has_a_case` does
  for the rules. It runs in a fresh process, where nothing was imported
  first: the built-ins come from `tf_pxg.parts.BUILTIN_MODULES` alone.
- One register idiom: the same decorator / call forms, the same errors for
  a taken name and a non-part, `override=`.
- The protocols name every member tf_pxg reads (defaults on the base
  classes), and no `getattr(x, "member", default)` probe is left for them.
- `participation.check`: the sampler's participation against the
  mechanism's needs, as an attack: a sampler subclass that ignores the
  cyclic groups it is given is refused instead of reporting BandMF's ε.
- One name: `min_separation`; the old names warn and map to it.
- `SamplerConfig`: samplers are built from a frozen config.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import pathlib
import re
import subprocess
import sys
import warnings

import dp_accounting
import numpy as np
import pytest

import tf_pxg
from tf_pxg import accounting
from tf_pxg import mf
from tf_pxg import parts
import tf_pxg.data as dpd
from tf_pxg.data import participation
from tf_pxg.data import samplers
from tf_pxg.dp import blt
from tf_pxg.dp import clipping
from tf_pxg.dp import mechanisms

REPO = str(pathlib.Path(__file__).resolve().parents[1])
PACKAGE = pathlib.Path(tf_pxg.__file__).parent
N, B, SIGMA, STEPS = 100, 10, 1.3, 7


# The table: one case per registered part ----------------------------------


def _poisson_case():
  sampler = samplers.resolve("poisson")(N, B, seed=0)
  event = sampler.dp_event(mechanisms.IndependentGaussian(), SIGMA, STEPS)
  assert event == accounting.dp_event(N, B, SIGMA, steps=STEPS)
  assert sampler.participation.min_separation == 1


def _shuffled_case():
  sampler = samplers.resolve("shuffled")(batch_size=B)
  assert not sampler.certified and not sampler.participation.certified
  with pytest.raises(samplers.NotCertifiedError):
    sampler.dp_event(mechanisms.IndependentGaussian(), SIGMA, STEPS)


def _balls_in_bins_case():
  sampler = samplers.resolve("balls_in_bins")(N, B, seed=0)
  event = sampler.dp_event(mechanisms.IndependentGaussian(), SIGMA, STEPS)
  assert event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(SIGMA), math.ceil(STEPS / 10))


def _truncated_poisson_case():
  sampler = samplers.resolve("truncated_poisson")(N, B, max_batch_size=12,
                                                  seed=0)
  event = sampler.dp_event(mechanisms.IndependentGaussian(), SIGMA, STEPS)
  assert event == dp_accounting.SelfComposedDpEvent(
      dp_accounting.TruncatedSubsampledGaussianDpEvent(N, B / N, 12, SIGMA),
      STEPS)
  assert (sampler.physical_batch_size, sampler.accumulation_steps) == (12, 1)
  assert sampler.participation.min_separation == 1


def _independent_gaussian_case():
  mech = mechanisms.resolve("independent_gaussian")()
  assert mech.dp_event(SIGMA) == dp_accounting.GaussianDpEvent(SIGMA)
  assert (mech.min_separation, mech.whole_run_event) == (1, False)


def _band_mf_case():
  mech = mechanisms.resolve("band_mf")(mf.BandedToeplitz(num_bands=3))
  assert mech.min_separation == 3 == mf.BandedToeplitz(3).min_separation
  assert mech.dp_event(SIGMA) == dp_accounting.GaussianDpEvent(SIGMA)


def _secure_gaussian_case():
  inner = blt.BLT(num_steps=20, min_separation=2, num_buffers=3)
  mech = mechanisms.resolve("secure_gaussian")(inner)
  # The inner contract, member by member (not the base class defaults).
  assert (mech.min_separation, mech.whole_run_event, mech.num_steps) == (
      2, True, 20)
  assert mech.dp_event(SIGMA) == inner.dp_event(SIGMA)


def _blt_case():
  mech = mechanisms.resolve("blt")(num_steps=20, min_separation=2,
                                   num_buffers=3)
  assert (mech.min_separation, mech.whole_run_event, mech.num_steps) == (
      2, True, 20)
  sampler = dpd.PoissonSampler(N, B, seed=0, min_separation=2, group_seed=1)
  assert sampler.dp_event(mech, SIGMA, 20) == mech.dp_event(SIGMA)
  assert sampler.dp_event(mech, SIGMA, 21) is None  # past num_steps


def _policy_case(name):
  def case():
    policy = clipping.get(name)
    assert type(policy) is clipping.POLICIES[name] and policy.name == name
    norms = np.array([0.5, 2.0, 40.0, np.inf], np.float32)
    factors = np.asarray(policy.factors(norms, 1.0))
    assert np.all(factors[:3] * norms[:3] <= 1.0 + 1e-6) and factors[3] == 0
    assert clipping.get(clipping.serialize(policy)) == policy
  return case


PARTS = {
    ("sampler", "poisson"): _poisson_case,
    ("sampler", "shuffled"): _shuffled_case,
    ("sampler", "balls_in_bins"): _balls_in_bins_case,
    ("sampler", "truncated_poisson"): _truncated_poisson_case,
    ("noise mechanism", "independent_gaussian"): _independent_gaussian_case,
    ("noise mechanism", "band_mf"): _band_mf_case,
    ("noise mechanism", "secure_gaussian"): _secure_gaussian_case,
    ("noise mechanism", "blt"): _blt_case,
    ("clipping policy", "flat"): _policy_case("flat"),
    ("clipping policy", "automatic"): _policy_case("automatic"),
    ("clipping policy", "quantile_adaptive"): _policy_case(
        "quantile_adaptive"),
    ("clipping policy", "norm_tracking"): _policy_case("norm_tracking"),
    ("clipping policy", "per_layer"): _policy_case("per_layer"),
}

_LIST_REGISTERED = """
from tf_pxg.data import samplers
from tf_pxg.dp import clipping, mechanisms
print(repr(sorted(
    [("sampler", n) for n in samplers.known_names()] +
    [("noise mechanism", n) for n in mechanisms.known_names()] +
    [("clipping policy", n) for n in clipping.known_names()])))
"""


def _fresh(code: str) -> str:
  env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([sys.executable, "-c", code], env=env, check=True,
                        capture_output=True, text=True, cwd=REPO).stdout


def test_every_registered_part_has_a_case():
  """In a fresh process (nothing imported first), every registered part
  of the three kinds has a case in `PARTS`, and every case a part."""
  registered = set(eval(_fresh(_LIST_REGISTERED).strip().splitlines()[-1]))  # pylint: disable=eval-used
  missing = sorted(registered - set(PARTS))
  assert not missing, (
      f"Registered parts without a case in PARTS: {missing}. Add one to "
      f"{__file__} (docs/extending.md).")
  assert set(PARTS) <= registered, sorted(set(PARTS) - registered)
  assert set(kind for kind, _ in PARTS) == set(parts.BUILTIN_MODULES)


@pytest.mark.parametrize("key", sorted(PARTS), ids="/".join)
def test_part_case(key):
  PARTS[key]()


def test_fit_takes_a_built_in_sampler_name_in_a_fresh_process():
  """`fit(sampling="balls_in_bins")` with nothing imported but tf_pxg.keras
  (the name is resolved from `parts.BUILTIN_MODULES`)."""
  code = """
import sys
import numpy as np, keras
import tf_pxg.keras as dpk
assert "tf_pxg.data.balls_in_bins" not in sys.modules
model = dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(1)],
                         l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
model.compile(optimizer="sgd", loss="mse")
x = np.zeros((16, 3), "float32"); y = np.zeros((16, 1), "float32")
model.fit(x, y, batch_size=4, epochs=1, verbose=0, sampling="balls_in_bins",
          sampling_seed=1)
print(type(model.dp_plan.sampler).__name__)
"""
  assert _fresh(code).strip().splitlines()[-1] == "BallsInBinsSampler"


# One register idiom --------------------------------------------------------


_KINDS = {
    "sampler": (samplers, "SAMPLINGS", dpd.PoissonSampler),
    "noise mechanism": (mechanisms, "MECHANISMS", mechanisms.NoiseMechanism),
    "clipping policy": (clipping, "POLICIES", clipping.ClippingPolicy),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_one_register_idiom(kind, monkeypatch):
  module, table, base = _KINDS[kind]
  monkeypatch.setattr(module, table, dict(getattr(module, table)))
  register = module.register

  @register("a_new_part")
  class New(base):
    pass

  class Other(base):
    pass

  assert getattr(module, table)["a_new_part"] is New
  assert register("a_new_part", New) is New  # the same object again: fine
  taken = re.escape(f"the {kind} name 'a_new_part' already names")
  with pytest.raises(ValueError, match=taken + ".*override=True"):
    register("a_new_part", Other)
  assert register("a_new_part", Other, override=True) is Other
  with pytest.raises(ValueError, match=f"is not a {kind}"):
    register("not_a_part", dict)
  with pytest.raises(ValueError, match="non-empty string"):
    register("", Other)


def test_rules_register_the_same_way():
  """The rules' `tf_pxg.register("OpType", rule=None, *, override=False)`
  has the same shape as every kind's: a name, the part (None: a
  decorator), keyword-only `override=`; a taken name raises."""
  import inspect  # pylint: disable=import-outside-toplevel

  def shape(fn):
    params = list(inspect.signature(fn).parameters.values())
    return ([p.kind for p in params], params[1].default,
            params[2].name, params[2].default)

  want = shape(tf_pxg.register)
  assert list(inspect.signature(tf_pxg.register).parameters)[0] == "op_type"
  assert want == ([inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2 +
                  [inspect.Parameter.KEYWORD_ONLY], None, "override", False)
  for module, _, _ in _KINDS.values():
    assert list(inspect.signature(module.register).parameters)[0] == "name"
    assert shape(module.register) == want, module.__name__


# The protocols declare every member ---------------------------------------


def test_protocols_declare_every_member_read():
  for member in ("privacy_unit", "certified", "num_examples",
                 "expected_batch_size", "sampling_rate", "steps_per_epoch",
                 "min_separation", "schema", "participation", "dp_event"):
    assert hasattr(samplers.Sampler, member), member
  assert dpd.PoissonSampler.step_indices is None  # the built-in selection
  for member in ("min_separation", "whole_run_event", "num_steps",
                 "stateful", "supports_xla", "init_state", "state_variables",
                 "noise_dtype", "noise_source", "prepare", "side_multipliers",
                 "add", "dp_event", "get_config", "from_config"):
    assert hasattr(mechanisms.NoiseMechanism, member), member
  for member in ("name", "adaptive", "factors", "get_config"):
    assert hasattr(clipping.ClippingPolicy, member), member


_PROBED = ("whole_run_event", "num_steps", "step_indices", "num_groups",
           "min_separation", "participation_groups", "num_bands")


def test_no_getattr_probes_for_declared_members():
  """The library reads the declared members; it does not probe for them
  (the files of this part; tf_pxg/keras is the lead's, listed in the
  report)."""
  pattern = re.compile(r"(getattr|hasattr)\([^()]*[\"'](" +
                       "|".join(_PROBED) + r")[\"']")
  found = []
  for path in [*(PACKAGE / "data").glob("*.py"), PACKAGE / "accounting.py",
               *(PACKAGE / "dp").glob("*.py"), *(PACKAGE / "mf").glob("*.py")]:
    for i, line in enumerate(path.read_text().splitlines(), 1):
      if pattern.search(line):
        found.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
  assert not found, "\n".join(found)


# One check of participation against the mechanism -------------------------


def _bandmf(b=2):
  return mechanisms.BandMF(mf.BandedToeplitz(num_bands=b))


class IgnoresTheGroups(dpd.PoissonSampler):
  """The attack: a sampler that drops the cyclic groups it is given (plain
  Poisson batches) and still claims BandMF's amplified ε."""

  def __init__(self, *args, **kwargs):
    for ignored in ("min_separation", "num_groups", "group_seed"):
      kwargs.pop(ignored, None)
    super().__init__(*args, **kwargs)

  def dp_event(self, mechanism, noise_multiplier, steps):
    b = mechanism.min_separation
    return accounting.cyclic_poisson_event(
        mechanism, self.expected_batch_size * b / self.num_examples, b,
        noise_multiplier, steps)


def test_a_sampler_that_ignores_its_groups_is_refused():
  config = dpd.SamplerConfig(N, B, seed=0, min_separation=2, group_seed=1)
  attack = IgnoresTheGroups.from_config(config)
  # Its own dp_event would report the amplified BandMF ε ...
  assert attack.dp_event(_bandmf(), SIGMA, STEPS) is not None
  # ... but the one check refuses it, naming both and the fix.
  with pytest.raises(participation.ParticipationError,
                     match=r"fit: the sampler <IgnoresTheGroups instance> "
                     r"gives poisson participation \(min_separation=1.*"
                     r"needs cyclic Poisson sampling with "
                     r"min_separation=2.*sampling='poisson'"):
    participation.check(attack, _bandmf(), "fit")
  # The honest sampler of the same config passes.
  honest = dpd.PoissonSampler.from_config(config)
  assert participation.check(honest, _bandmf(), "fit").min_separation == 2


class DrawsOutsideItsGroups(dpd.PoissonSampler):
  """The other attack: it keeps the groups it is given (so it states
  cyclic participation) but its own selection takes every example."""

  def step_indices(self, step, key=None):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    del step, key
    return tf.range(self.num_examples, dtype=tf.int64)


def test_a_sampler_whose_selection_ignores_its_groups_is_refused():
  config = dpd.SamplerConfig(N, B, seed=0, min_separation=2, group_seed=1)
  attack = DrawsOutsideItsGroups.from_config(config)
  assert attack.participation.min_separation == 2  # what it states
  with pytest.raises(participation.ParticipationError,
                     match=r"fit: .*DrawsOutsideItsGroups.*drew example \d+ "
                     r"\(group 1\) at step 0, which samples only group 0"):
    participation.check(attack, _bandmf(), "fit")
  # A selection that keeps to the groups passes.

  class KeepsToItsGroups(dpd.PoissonSampler):

    def step_indices(self, step, key=None):
      import tensorflow as tf  # pylint: disable=import-outside-toplevel
      del key
      members = self.group_members(int(step) % self.min_separation)
      return tf.constant(members[:3], tf.int64)

  participation.check(KeepsToItsGroups.from_config(config), _bandmf(),
                      "fit")


def test_fit_refuses_the_attack_before_any_step():
  import keras  # pylint: disable=import-outside-toplevel
  import tf_pxg.keras as dpk  # pylint: disable=import-outside-toplevel
  model = dpk.DPSequential(
      [keras.Input((3,)), keras.layers.Dense(1)], l2_norm_clip=1.0,
      noise_multiplier=SIGMA, seed=0,
      noise_mechanism=mf.BandedToeplitz(num_bands=2))
  model.compile(optimizer="sgd", loss="mse")
  x, y = np.zeros((N, 3), "float32"), np.zeros((N, 1), "float32")
  with pytest.raises(participation.ParticipationError):
    model.fit(x, y, batch_size=B, epochs=1, verbose=0,
              sampling=IgnoresTheGroups)
  assert int(model.optimizer.iterations) == 0


_MATRIX = [
    # sampler (class or instance), mechanism, refused?
    (dpd.PoissonSampler, _bandmf(), False),  # the class: b set by fit
    (samplers.ShuffledSampler, mechanisms.IndependentGaussian(), False),
    (samplers.ShuffledSampler, _bandmf(), True),
    (samplers.ShuffledSampler, blt.BLT(20, 1), False),  # uncertified
    ("balls_in_bins", mechanisms.IndependentGaussian(), False),
    ("balls_in_bins", _bandmf(), True),
    ("balls_in_bins", blt.BLT(20, 1), True),  # whole-run event
    (lambda: dpd.PoissonSampler(N, B, seed=0), _bandmf(), True),
    (lambda: dpd.PoissonSampler(N, B, seed=0, min_separation=2,
                                group_seed=1),
     mechanisms.IndependentGaussian(), True),
    (lambda: dpd.PoissonSampler(N, B, seed=0, min_separation=2,
                                group_seed=1), blt.BLT(20, 2), False),
    (lambda: samplers.PrivacyUnits(dpd.PoissonSampler(N, B, seed=0)),
     _bandmf(), True),
]


@pytest.mark.parametrize("sampler,mechanism,refused", _MATRIX)
def test_participation_matrix(sampler, mechanism, refused):
  if isinstance(sampler, str):
    sampler = samplers.resolve(sampler)
  elif not isinstance(sampler, type):
    sampler = sampler()
  if refused:
    with pytest.raises(participation.ParticipationError, match="where"):
      participation.check(sampler, mechanism, "where")
  else:
    participation.check(sampler, mechanism, "where")


def test_samplers_own_events_go_through_the_check():
  """`dp_event` of every certified built-in refuses what the check does."""
  with pytest.raises(participation.ParticipationError):
    dpd.PoissonSampler(N, B, seed=0).dp_event(_bandmf(), SIGMA, STEPS)
  with pytest.raises(participation.ParticipationError, match="per-step"):
    samplers.resolve("balls_in_bins")(N, B, seed=0).dp_event(
        blt.BLT(20, 1), SIGMA, STEPS)


# One name: min_separation, the old names deprecated aliases ---------------


def _warns_once(fn, old):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    value = fn()
  ours = [w for w in caught if issubclass(w.category, DeprecationWarning)]
  assert len(ours) == 1 and f"`{old}` is deprecated" in str(
      ours[0].message) and "min_separation" in str(ours[0].message)
  assert ours[0].filename == __file__  # attributed to the caller
  return value


def test_old_names_warn_and_map_to_min_separation():
  kw = dict(num_examples=1000, batch_size=100, noise_multiplier=1.0,
            steps=10)
  assert _warns_once(lambda: accounting.compute_epsilon(**kw, num_bands=4),
                     "num_bands") == accounting.compute_epsilon(
                         **kw, min_separation=4)
  assert _warns_once(lambda: accounting.dp_event(**kw, num_bands=4),
                     "num_bands") == accounting.dp_event(**kw,
                                                         min_separation=4)
  assert _warns_once(
      lambda: accounting.sampling_probability(1000, 100, num_bands=4),
      "num_bands") == 0.4
  assert _warns_once(lambda: accounting.max_num_bands(1000, 100),
                     "max_num_bands") == 10
  sampler = _warns_once(lambda: dpd.PoissonSampler(
      N, B, seed=0, num_groups=2, group_seed=1), "num_groups")
  assert sampler.min_separation == 2 == sampler.config.min_separation
  assert _warns_once(lambda: sampler.num_groups, "num_groups") == 2
  mech = blt.BLT(20, 3)
  assert _warns_once(lambda: mech.participation_groups,
                     "participation_groups") == 3
  assert _warns_once(lambda: dpd.max_num_groups(N, B), "max_num_groups") == 10
  with pytest.raises(ValueError, match="pass only min_separation"):
    accounting.compute_epsilon(**kw, num_bands=2, min_separation=4)


def test_errors_name_the_argument_the_caller_used():
  with pytest.raises(ValueError, match="min_separation=11 is too large"):
    accounting.compute_epsilon(1000, 100, 1.0, steps=1, min_separation=11)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with pytest.raises(ValueError, match="num_bands=11 is too large"):
      accounting.compute_epsilon(1000, 100, 1.0, steps=1, num_bands=11)
  with pytest.raises(ValueError, match="largest min_separation is 10 "):
    dpd.PoissonSampler(N, B, min_separation=11, group_seed=1)


def test_tf_pxg_uses_the_new_names_and_does_not_warn():
  """Inside tf_pxg the old names are only defined, not used: fit's path
  through the parts of this change reads `min_separation` (a call with
  the new names emits no DeprecationWarning)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sampler = dpd.PoissonSampler(N, B, seed=0, min_separation=2,
                                 group_seed=1)
    sampler.dp_event(_bandmf(), SIGMA, STEPS)
    accounting.mechanism_epsilon(_bandmf(), N, B, SIGMA, STEPS)
    mf.choose_num_bands(1000, 100, 1, 3.0, 1e-5, candidates=[1, 2],
                        method="sqrt")
  assert not [w for w in caught
              if issubclass(w.category, DeprecationWarning)]
  old_attributes = {"num_groups", "participation_groups"}
  old_keywords = {"num_groups", "num_bands"}
  used = []
  for path in [*(PACKAGE / "data").glob("*.py"), PACKAGE / "accounting.py",
               PACKAGE / "cli.py", PACKAGE / "dp" / "mechanisms.py",
               PACKAGE / "dp" / "blt.py", PACKAGE / "mf" / "toeplitz.py"]:
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr in old_attributes and
          not (isinstance(node.value, ast.Name) and node.value.id == "args")):
        used.append(f"{path.name}:{node.lineno}: .{node.attr}")
      if isinstance(node, ast.Call):
        # (Forwarding a deprecated parameter, `num_groups=num_groups`, is
        # the alias itself.)
        used += [f"{path.name}:{node.lineno}: {k.arg}="
                 for k in node.keywords if k.arg in old_keywords and not (
                     isinstance(k.value, ast.Name) and k.value.id == k.arg)]
  assert not used, used


def test_keras_saving_a_dp_model_does_not_warn(tmp_path):
  """Keras' saving reads every attribute of a model and its optimizer,
  deprecated aliases (`num_bands`) included: that walk is not the user's
  use of an old name, so saving and loading warn nothing."""
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  model = dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(2)],
                           l2_norm_clip=1.0, noise_multiplier=1.0,
                           noise_mechanism=mf.BandedToeplitz(2))
  model.compile("sgd", "mse")
  path = str(tmp_path / "m.keras")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.save(path)
    loaded = keras.models.load_model(path)
  ours = [str(w.message) for w in caught
          if issubclass(w.category, DeprecationWarning) and
          "is deprecated; use" in str(w.message)]
  assert not ours, ours
  assert loaded.min_separation == 2
  with pytest.warns(DeprecationWarning, match="num_bands"):
    assert loaded.num_bands == 2  # the user's read still warns


# Samplers are built from a frozen config ----------------------------------


def test_samplers_are_built_from_a_frozen_config():
  config = dpd.SamplerConfig(N, B, seed=3, min_separation=2, group_seed=5,
                             accumulation_steps=2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.seed = 4  # type: ignore[misc]
  sampler = dpd.PoissonSampler.from_config(config)
  # The resolved config rebuilds the same stream (defaults filled in).
  assert sampler.config.physical_batch_size == (
      dpd.default_physical_batch_size(B, 2))
  again = dpd.PoissonSampler.from_config(sampler.config)
  for step in range(4):
    np.testing.assert_array_equal(sampler.indices_for_step(step),
                                  again.indices_for_step(step))
  # The keyword constructor is the same config.
  assert dpd.PoissonSampler(N, B, seed=3, min_separation=2, group_seed=5,
                            accumulation_steps=2).config == sampler.config
  with pytest.raises(TypeError, match="PoissonSampler"):
    dpd.PoissonSampler(N, B, num_bins=3)
  # A subclass with its own options reads the same config.
  bins = samplers.resolve("balls_in_bins").from_config(
      dpd.SamplerConfig(N, B, seed=1))
  assert bins.num_bins == 10 and bins.config.expected_batch_size == 10.0
  with pytest.raises(ValueError, match="no cyclic groups"):
    samplers.resolve("balls_in_bins").from_config(
        dpd.SamplerConfig(N, B, seed=1, min_separation=2, group_seed=1))
