"""The DP plan owns the sampling choice and the accountant (issue 29).

`DPOptimizer(sampling=..., accountant=...)` puts both in its frozen
`DPPlan`, validates them at construction, saves them by name, and `fit`
reads the plan's sampling, refusing a conflicting one. (The `.keras`
round trip with a cyclic plan and the PLD ε after loading is in
tests/test_keras_save.py.)
"""

import keras
import numpy as np
import pytest

import tf_pxg.data as dpd
from tf_pxg import mf
from tf_pxg.data import samplers
from tf_pxg.data.balls_in_bins import BallsInBinsSampler
import tf_pxg.keras as dpk

N, BATCH, SIGMA = 16, 4, 1.0


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(N, 3)).astype("float32"),
          rng.normal(size=(N, 1)).astype("float32"))


def _model(**dp):
  return dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(1)],
                          seed=0, **dp)


def _round_trip(optimizer):
  return dpk.DPOptimizer.from_config(optimizer.get_config())


def test_sampling_and_accountant_are_plan_fields_validated_early():
  by_name = dpk.DPSGD(1.0, SIGMA, sampling="poisson", accountant="pld")
  by_class = dpk.DPSGD(1.0, SIGMA, sampling=dpd.PoissonSampler,
                       accountant="pld")
  # A name is the class it stands for: one choice, one plan.
  assert by_name.sampling is dpd.PoissonSampler
  assert by_name.plan.accountant == by_name.accountant == "pld"
  assert by_name.plan.conflicts(by_class.plan) == []
  assert by_name.plan.conflicts(dpk.DPSGD(1.0, SIGMA).plan) == [
      "sampling", "accountant"]
  assert dpk.DPSGD(1.0, SIGMA).plan.sampling is None
  with pytest.raises(ValueError,
                     match=r"DPOptimizer: sampling must be .*instance"):
    dpk.DPSGD(1.0, SIGMA, sampling=dpd.PoissonSampler(N, BATCH, seed=0))
  with pytest.raises(ValueError,
                     match=r"DPOptimizer: .*'shuffled', 'balls_in_bins'.*"
                           r"got 'uniform'"):
    dpk.DPSGD(1.0, SIGMA, sampling="uniform")
  with pytest.raises(ValueError, match=r"DPOptimizer: accountant .*'moments'"):
    dpk.DPSGD(1.0, SIGMA, accountant="moments")
  with pytest.raises(ValueError, match="needs cyclic Poisson sampling"):
    dpk.DPSGD(1.0, SIGMA, sampling="shuffled",
              noise_mechanism=mf.BandedToeplitz(num_bands=2))


def test_sampling_is_saved_by_name_and_unnamed_classes_raise(monkeypatch):
  opt = dpk.DPAdam(1.0, SIGMA, sampling=BallsInBinsSampler,
                   accountant="pld", learning_rate=0.1)
  config = opt.get_config()
  assert (config["sampling"], config["accountant"]) == ("balls_in_bins",
                                                        "pld")
  assert _round_trip(opt).plan.conflicts(opt.plan) == []
  # A configured class is a new class under the same __name__: saving it
  # by that name would silently drop its options, so get_config raises.
  monte_carlo = BallsInBinsSampler.configured(accounting="monte_carlo")
  opt = dpk.DPSGD(1.0, SIGMA, sampling=monte_carlo)
  with pytest.raises(ValueError, match="has no registered name"):
    opt.get_config()
  # Registered, it is saved and restored as that very class.
  monkeypatch.setattr(samplers, "SAMPLINGS", dict(samplers.SAMPLINGS))
  samplers.register("balls_in_bins_mc", monte_carlo)
  clone = _round_trip(opt)
  assert clone.sampling is monte_carlo and clone.plan.conflicts(opt.plan) == []
  with pytest.raises(ValueError, match="already names"):
    samplers.register("poisson", monte_carlo)
  with pytest.raises(ValueError, match="PoissonSampler"):
    samplers.register("dict", dict)
  # Loading where the name is not registered says what to do.
  config = opt.get_config()
  del samplers.SAMPLINGS["balls_in_bins_mc"]
  with pytest.raises(ValueError, match="'balls_in_bins_mc', which is not a "
                                       "registered sampling"):
    dpk.DPOptimizer.from_config(config)


def test_fit_uses_the_plan_sampling_and_refuses_another():
  x, y = _data()
  model = _model()
  model.compile(optimizer=dpk.DPSGD(1.0, SIGMA, sampling="shuffled",
                                    learning_rate=0.1), loss="mse")
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  assert type(model.dp_plan.sampler) is samplers.ShuffledSampler
  assert model.dp_plan.sampling is samplers.ShuffledSampler
  assert int(model.optimizer.iterations) == N // BATCH
  for other in ("poisson", dpd.PoissonSampler(N, BATCH, seed=0)):
    with pytest.raises(ValueError, match=r"fit got sampling=.*"
                                         r"\(PoissonSampler\).*plan chose "
                                         r"sampling=ShuffledSampler"):
      model.fit(x, y, batch_size=BATCH, verbose=0, sampling=other)
  assert int(model.optimizer.iterations) == N // BATCH  # nothing ran
  # Without a plan choice fit's argument (default "poisson") decides.
  free = _model()
  free.compile(optimizer=dpk.DPSGD(1.0, SIGMA, learning_rate=0.1),
               loss="mse")
  free.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
  assert type(free.dp_plan.sampler) is dpd.PoissonSampler


def test_model_sampling_is_a_request_handed_to_the_optimizer():
  """A model's `sampling=` is the plan with a plain optimizer, is taken by
  a DPOptimizer without one, and conflicts with another one."""
  model = _model(l2_norm_clip=1.0, noise_multiplier=SIGMA,
                 sampling="shuffled")
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  assert model.dp_plan.sampling is samplers.ShuffledSampler
  clone = dpk.DPSequential.from_config(model.get_config())
  assert clone.dp_plan.conflicts(model.dp_plan) == []
  adopting = dpk.DPSGD(1.0, SIGMA)
  _model(sampling="shuffled").compile(optimizer=adopting, loss="mse")
  assert adopting.sampling is samplers.ShuffledSampler
  with pytest.raises(ValueError, match=r"sampling=ShuffledSampler but its "
                                       r"DPOptimizer has sampling="
                                       r"PoissonSampler"):
    _model(sampling="shuffled").compile(
        optimizer=dpk.DPSGD(1.0, SIGMA, sampling="poisson"), loss="mse")


# A model's request meets the owner's plan in one place (DPPlan.absorb) ----


def test_absorb_fills_only_what_needs_no_state_and_refuses_the_rest():
  import dataclasses  # noqa: PLC0415
  from tf_pxg.dp import plan as dp_plan  # noqa: PLC0415
  from tf_pxg.dp import norm_release  # noqa: PLC0415
  owner = dp_plan.DPPlan.validated("owner", 1.0, 1.0, required=True)
  request = dp_plan.DPPlan.validated(
      "request", None, None, required=False, secure_mode=True,
      sampling="poisson", noisy_loss=dpk.NoisyLoss(1.0, 10.0),
      side_releases=[norm_release.ClippedNormMean(5.0)],
      unprotected_training_metrics=True)
  merged = owner.absorb(request, "Model 'm'")
  assert sorted(merged.conflicts(owner)) == sorted(dp_plan.ABSORBED)
  assert merged.absorb(request, "Model 'm'") == merged  # idempotent
  assert owner.absorb(dp_plan.DPPlan(None, None), "m") is owner
  # A setting the owner already has, or one that fixes the owner's state,
  # must agree: named, with both values.
  refused = {
      "l2_norm_clip": dict(l2_norm_clip=2.0, noise_multiplier=1.0),
      "noise_multiplier": dict(l2_norm_clip=1.0, noise_multiplier=2.0),
      "clipping": dict(clipping="automatic"),
      "noise_mechanism": dict(noise_mechanism=mf.BandedToeplitz(2)),
      "sampling": dict(sampling="shuffled"),
  }
  for name, given in refused.items():
    req = dp_plan.DPPlan.validated(
        "request", given.pop("l2_norm_clip", None),
        given.pop("noise_multiplier", None), required=False, **given)
    with pytest.raises(ValueError, match=f"Model 'm' has {name}=.* but its "
                                         f"DPOptimizer has {name}="):
      merged.absorb(req, "Model 'm'")
  # Every field is either the owner's alone or a request's: a new field
  # must be put in one of the two lists.
  fields = {f.name for f in dataclasses.fields(dp_plan.DPPlan)}
  requestable = set(dp_plan._REQUESTABLE)  # pylint: disable=protected-access
  assert fields - requestable == {"sampler", "accountant"}
  assert set(dp_plan.ABSORBED) <= requestable <= fields
