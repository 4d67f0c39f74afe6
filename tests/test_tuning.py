"""tf_pxg.tuning's mechanism parts against closed forms: K's distribution
(Papernot & Steinke's truncated negative binomial and Poisson), the
search's ε against dp-accounting's RepeatAndSelectDpEvent computed here
directly (both ways), the paper's Theorem 2 at a Gaussian, the
calibration's domination, and the score's noise."""

import math
import random

import dp_accounting
from dp_accounting import dp_event
import numpy as np
import pytest

from tf_pxg import accounting as tfp_accounting
from tf_pxg import tuning
from tf_pxg.tuning import accounting
from tf_pxg.tuning import distributions
from tf_pxg.tuning import scores

ORDERS = list(tfp_accounting.RDP_ORDERS)


def _paper_tnb_pmf(eta, gamma, k):
  """Papernot & Steinke, Section 2: (1-γ)^k / (γ^-η - 1) Π_{l<k} (l+η)/(l+1);
  η = 0: (1-γ)^k / (k log(1/γ))."""
  if eta == 0:
    return (1 - gamma)**k / (k * math.log(1 / gamma))
  prod = math.prod((l + eta) / (l + 1) for l in range(k))
  return (1 - gamma)**k / (gamma**-eta - 1) * prod


def _paper_tnb_mean(eta, gamma):
  if eta == 0:
    return (1 / gamma - 1) / math.log(1 / gamma)
  return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


@pytest.mark.parametrize("eta,gamma", [(0.0, 0.1), (0.5, 0.2), (1.0, 0.25),
                                       (2.0, 0.3)])
def test_tnb_pmf_and_mean_are_the_papers(eta, gamma):
  d = tuning.TruncatedNegativeBinomial(eta, gamma)
  for k in (1, 2, 3, 7, 20):
    assert d.pmf(k) == pytest.approx(_paper_tnb_pmf(eta, gamma, k), rel=1e-10)
  assert d.pmf(0) == 0.0
  assert sum(d.pmf(k) for k in range(1, 2000)) == pytest.approx(1, abs=1e-9)
  assert d.mean == pytest.approx(_paper_tnb_mean(eta, gamma), rel=1e-12)
  assert d.mean == pytest.approx(
      sum(k * d.pmf(k) for k in range(1, 4000)), rel=1e-8)
  assert d.shape == eta


@pytest.mark.parametrize("eta,mean", [(0.0, 5.0), (1.0, 10.0), (3.0, 4.0)])
def test_tnb_from_mean_solves_gamma(eta, mean):
  d = tuning.TruncatedNegativeBinomial(eta, mean=mean)
  assert d.mean == pytest.approx(mean, rel=1e-9)
  assert _paper_tnb_mean(eta, d.gamma) == pytest.approx(mean, rel=1e-9)


@pytest.mark.parametrize("dist", [
    tuning.TruncatedNegativeBinomial(0.0, 0.1),
    tuning.TruncatedNegativeBinomial(1.0, 0.2),
    tuning.TruncatedNegativeBinomial(2.0, mean=6.0),
    tuning.Poisson(4.0)], ids=repr)
def test_sampled_k_matches_the_closed_form_mean_and_tail(dist):
  """20000 draws: the empirical mean within 5 standard errors of the
  closed form, and P[K > k] at the median and the 95th percentile within
  5 binomial standard errors."""
  rng = random.Random(1234)
  draws = np.array([dist.sample(rng) for _ in range(20000)])
  var = sum((k - dist.mean)**2 * dist.pmf(k) for k in range(0, 5000))
  assert abs(draws.mean() - dist.mean) < 5 * math.sqrt(var / len(draws))
  for quantile in (0.5, 0.95):
    k = int(np.quantile(draws, quantile))
    p = dist.tail(k)
    assert p == pytest.approx(1 - sum(dist.pmf(j) for j in range(0, k + 1)),
                              abs=1e-12)
    se = math.sqrt(p * (1 - p) / len(draws))
    assert abs((draws > k).mean() - p) < 5 * se
  first = 0 if isinstance(dist, tuning.Poisson) else 1
  assert draws.min() >= first


def test_poisson_pmf():
  d = tuning.Poisson(3.0)
  assert d.pmf(0) == pytest.approx(math.exp(-3))
  assert d.pmf(4) == pytest.approx(math.exp(-3) * 81 / 24)
  assert d.shape == math.inf


def test_random_source_is_the_os_csprng_unless_seeded():
  assert isinstance(distributions.random_source(), random.SystemRandom)
  a, b = distributions.random_source(7), distributions.random_source(7)
  assert type(a) is random.Random and a.random() == b.random()
  with pytest.raises(TypeError):
    distributions.random_source("7")


@pytest.mark.parametrize("bad", [dict(eta=-1, gamma=0.5),
                                 dict(eta=1, gamma=0.0),
                                 dict(eta=1), dict(eta=1, gamma=0.5, mean=3),
                                 dict(eta=1, mean=0.5)])
def test_tnb_refuses_bad_parameters(bad):
  eta = bad.pop("eta")
  with pytest.raises(ValueError):
    tuning.TruncatedNegativeBinomial(eta, **bad)


def _dpsgd(sigma, steps=200, q=0.05):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(
          sigma)), steps)


def _direct_epsilon(per_run, mean, shape, delta):
  """dp-accounting's RDP accountant on RepeatAndSelectDpEvent, here."""
  acc = dp_accounting.rdp.RdpAccountant(ORDERS)
  acc.compose(dp_event.RepeatAndSelectDpEvent(per_run, mean, shape))
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("dist", [
    tuning.TruncatedNegativeBinomial(0.0, mean=5.0),
    tuning.TruncatedNegativeBinomial(1.0, mean=10.0),
    tuning.Poisson(8.0)], ids=repr)
def test_search_epsilon_is_dp_accountings_repeat_and_select(dist):
  per_run = _dpsgd(1.2)
  got = tuning.search_epsilon(per_run, dist, 1e-5)
  assert got == pytest.approx(
      _direct_epsilon(per_run, dist.mean, dist.shape, 1e-5), rel=1e-12)
  single = tfp_accounting.event_epsilon(per_run, 1e-5)
  assert single < got < 5 * single  # selection costs, but not K times


@pytest.mark.parametrize("dist", [
    tuning.TruncatedNegativeBinomial(1.0, mean=5.0), tuning.Poisson(5.0)],
                         ids=repr)
def test_noise_multiplier_for_search_meets_the_target_tightly(dist):
  sigma = tuning.noise_multiplier_for_search(
      3.0, 1e-5, dist, lambda s: _dpsgd(s, steps=100))
  direct = _direct_epsilon(_dpsgd(sigma, steps=100), dist.mean, dist.shape,
                           1e-5)
  assert direct <= 3.0
  assert _direct_epsilon(_dpsgd(sigma * (1 - 1e-3), steps=100), dist.mean,
                         dist.shape, 1e-5) > 3.0


def test_rdp_curve_is_the_gaussians_closed_form():
  curve = accounting.rdp_curve(dp_accounting.GaussianDpEvent(2.0))
  np.testing.assert_allclose(curve, np.array(ORDERS) / (2 * 4.0), rtol=1e-12)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_repeat_and_select_rdp_is_theorem_2(eta):
  """At a Gaussian (ε(λ) = λ / 2σ²): ε'(λ) = ε(λ) + (1+η)(1 - 1/λ̂) ε(λ̂)
  + (1+η) log(1/γ)/λ̂ + log E[K] / (λ-1), the min over λ̂, as the search's
  event is accounted (η = dp-accounting's shape, γ ours)."""
  sigma, dist = 3.0, tuning.TruncatedNegativeBinomial(eta, mean=8.0)
  curve = accounting.rdp_curve(tuning.search_event(
      dp_accounting.GaussianDpEvent(sigma), dist))
  lams = np.array(ORDERS)
  base = lams / (2 * sigma**2)
  c = (1 + eta) * np.min((1 - 1 / lams) * base +
                         math.log(1 / dist.gamma) / lams)
  theorem = base + c + math.log(dist.mean) / (lams - 1)
  # dp-accounting also takes the min over larger orders (monotonicity).
  mono = np.array([theorem[i:].min() for i in range(len(lams))])
  np.testing.assert_allclose(curve, mono, rtol=1e-6)


def test_calibrate_gives_shorter_runs_less_noise_inside_the_reference():
  reference = _dpsgd(1.5, steps=300)
  sigma = accounting.calibrate(lambda s: _dpsgd(s, steps=100), reference, 6)
  assert sigma < 1.5
  assert accounting.dominates(reference, _dpsgd(sigma, steps=100))
  assert not accounting.dominates(reference,
                                  _dpsgd(sigma * (1 - 1e-3), steps=100))
  # a higher sampling rate with fewer steps: also inside, at its own σ
  sigma_q = accounting.calibrate(lambda s: _dpsgd(s, steps=150, q=0.1),
                                 reference, 6)
  assert accounting.dominates(reference, _dpsgd(sigma_q, steps=150, q=0.1))


def test_plans_worst_case_refuses_a_candidate_outside_the_reference():
  from tf_pxg.tuning import search  # pylint: disable=g-import-not-at-top
  events = {1: 100, 2: 300}

  def run_event(config, sigma):
    return _dpsgd(sigma, steps=events[config["epochs"]],
                  q=config.get("q", 0.05))

  dist = tuning.TruncatedNegativeBinomial(1.0, mean=3.0)
  plans = search.plan_runs([{"epochs": 1}, {"epochs": 2}], run_event,
                           tuning.NoisyTrainingLoss(), dist,
                           target_epsilon=None, noise_multiplier=1.3,
                           delta=1e-5, calibrate=True)
  sigmas = {k: p.noise_multiplier for k, p in plans.by_key.items()}
  assert sigmas[search.config_key({"epochs": 2})] == 1.3  # the reference
  assert sigmas[search.config_key({"epochs": 1})] < 1.3
  assert plans.per_run_event == _dpsgd(1.3, steps=300)
  worst = search.plan_runs([{"epochs": 1}, {"epochs": 2}], run_event,
                           tuning.NoisyTrainingLoss(), dist,
                           target_epsilon=None, noise_multiplier=1.3,
                           delta=1e-5, calibrate=False)
  assert {p.noise_multiplier for p in worst.by_key.values()} == {1.3}
  # worst case with a candidate the reference (largest ε at σ = 1) does not
  # dominate at every order: a higher rate, fewer steps
  with pytest.raises(ValueError, match="calibrate=True"):
    search.plan_runs([{"epochs": 2}, {"epochs": 1, "q": 0.9}], run_event,
                     tuning.NoisyTrainingLoss(), dist, target_epsilon=None,
                     noise_multiplier=1.3, delta=1e-5, calibrate=False)


def test_private_validation_noise_is_its_closed_form():
  """The released score = (Σ clamp(m_i) + N(0, (z·bound)²)) / n: over 4000
  releases on fixed values, mean = the clamped mean, std = z·bound/n."""
  n, z = 200, 4.0
  values = np.r_[np.ones(150), np.zeros(50)]
  score = scores.PrivateValidation(np.zeros((n, 1)), np.zeros(n),
                                   noise_multiplier=z, seed=3)
  draws = np.array([score.noised_mean(values) for _ in range(4000)])
  assert score.stddev() == z / n
  assert draws.std() == pytest.approx(z / n, rel=0.05)
  assert abs(draws.mean() - 0.75) < 5 * (z / n) / math.sqrt(4000)
  assert score.event == dp_accounting.GaussianDpEvent(z)
  # clamped: a value of 1e6 counts as `bound`
  spiky = scores.PrivateValidation(np.zeros((n, 1)), np.zeros(n),
                                   noise_multiplier=1e-9, seed=0)
  assert spiky.noised_mean(np.r_[1e6, np.zeros(n - 1)]) == pytest.approx(
      1 / n)


def test_private_validation_keeps_no_state_that_counts_runs():
  score = scores.PrivateValidation(np.zeros((10, 1)), np.zeros(10),
                                   noise_multiplier=1.0)
  draws = [score.noised_mean(np.ones(10)) for _ in range(3)]
  state = score._rng  # pylint: disable=protected-access
  assert state is None and len(set(draws)) == 3


def test_scores_direction_and_nan():
  loss = tuning.NoisyTrainingLoss()
  assert loss.better(0.1, 0.2) and not loss.better(math.nan, 0.2)
  assert loss.better(0.3, math.nan)
  public = scores.PublicValidation(np.zeros((3, 1)), np.zeros(3))
  assert public.better(0.9, 0.8) and public.event is None
  assert "DECLARED PUBLIC" in public.source
