"""Risk in attack terms (issue 53, item 3): μ-GDP and the best attack's TPR.

`tf_pxg.risk` is checked against two references that share none of its
code: the closed form of μ-GDP for Gaussian compositions (T steps of the
unsampled Gaussian at σ are exactly sqrt(T)/σ-GDP, and TPR(α) =
Φ(Φ⁻¹(α) + μ), written here with `scipy.stats.norm`), and, for Poisson
subsampling, the f-DP curve computed here directly from a dp-accounting
PLD built without the accountant (`from_gaussian_mechanism(...)
.self_compose(T)`), its δ(ε) evaluated at every point of its loss grid at
once, the conversion (ε, δ(ε)) -> f taken by brute force over that whole
grid. Then the places that report it: `privacy_summary()`, the CLI and
the callback's logs in a small `fit`.
"""

import math

import dp_accounting
import keras
import numpy as np
import pytest
from scipy import optimize
from scipy import stats

import tf_pxg.keras as dpk
from tf_pxg import accounting
from tf_pxg import cli
from tf_pxg import risk

FPRS = (1e-3, 1e-2)
DELTA = 1e-5
INTERVAL = 1e-4  # the PLD's discretisation in the checks against the PLD
TOL = 1e-6


def _gaussians(sigma, steps):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(sigma), steps)


def _poisson(q, sigma, steps):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _closed_form_tpr(mu, fpr):
  return stats.norm.cdf(stats.norm.ppf(fpr) + mu)


def _closed_form_delta(mu, epsilon):
  return (stats.norm.cdf(-epsilon / mu + mu / 2) -
          math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2))


# ---------------------------------------------------------------------------
# (b) The closed form: Gaussian compositions, q = 1.
# ---------------------------------------------------------------------------

CASES = [(1.0, 1), (2.0, 16), (0.8, 7), (5.0, 100)]


@pytest.mark.parametrize("sigma, steps", CASES)
def test_gaussian_composition_is_exactly_sqrt_t_over_sigma(sigma, steps):
  found = risk.event_risk(_gaussians(sigma, steps), DELTA)
  mu = math.sqrt(steps) / sigma
  assert found.exact and found.method == "closed form"
  assert abs(found.mu - mu) <= 1e-12 * mu
  for fpr in FPRS:
    assert abs(found.tpr_at(fpr) - _closed_form_tpr(mu, fpr)) <= 1e-12


@pytest.mark.parametrize("sigma, steps", CASES[:3])
def test_the_pld_path_recovers_the_closed_form(sigma, steps):
  # The same events through dp-accounting's PLD (no closed form): the
  # curve from the PLD's profile and the dominating fit agree with
  # sqrt(T)/σ-GDP to TOL.
  found = risk.event_risk(_gaussians(sigma, steps), DELTA,
                          value_discretization_interval=INTERVAL,
                          closed_form=False)
  mu = math.sqrt(steps) / sigma
  assert not found.exact and found.method == "pld"
  assert abs(found.mu - mu) <= TOL
  for fpr in FPRS:
    assert abs(found.tpr_at(fpr) - _closed_form_tpr(mu, fpr)) <= TOL


def test_q_1_poisson_composed_by_the_pld_matches_the_closed_form():
  # Poisson sampling at q = 1 is the Gaussian: exact μ by default, and
  # through the PLD (which composes the T steps by FFT) within TOL.
  event = _poisson(1.0, 2.0, 16)
  assert risk.event_risk(event, DELTA).mu == pytest.approx(2.0, abs=1e-12)
  found = risk.event_risk(event, DELTA, value_discretization_interval=INTERVAL,
                          closed_form=False)
  assert abs(found.mu - 2.0) <= TOL
  for fpr in FPRS:
    assert abs(found.tpr_at(fpr) - _closed_form_tpr(2.0, fpr)) <= TOL


def test_composition_of_different_gaussians_adds_inverse_variances():
  event = dp_accounting.ComposedDpEvent([
      _gaussians(2.0, 3), dp_accounting.GaussianDpEvent(1.5),
      dp_accounting.NoOpDpEvent()])
  mu = math.sqrt(3 / 4 + 1 / 1.5**2)
  found = risk.event_risk(event, DELTA)
  assert found.exact and found.mu == pytest.approx(mu, abs=1e-12)


def test_profile_matches_the_closed_form():
  for mu in (0.3, 1.0, 2.5):
    for eps in (0.0, 0.5, 3.0):
      assert float(risk.gaussian_delta(mu, eps)) == pytest.approx(
          _closed_form_delta(mu, eps), abs=1e-14)


# ---------------------------------------------------------------------------
# (a) A direct computation from dp-accounting's PLD: Poisson subsampling.
# ---------------------------------------------------------------------------


def _direct_curve(q, sigma, steps):
  """The PLD built directly, and δ(ε) on its whole loss grid kΔ."""
  pld = dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
      standard_deviation=sigma, sampling_prob=q,
      value_discretization_interval=INTERVAL).self_compose(steps)
  top = pld.get_epsilon_for_delta(1e-14)  # beyond: δ is the tail mass
  eps = np.arange(int(top / INTERVAL) + 2) * INTERVAL
  return pld, eps, np.asarray(pld.get_delta_for_epsilon(eps))


def _direct_tpr(eps, deltas, fpr):
  """1 - sup over the grid of max(0, 1 - δ - e^ε α, e^-ε (1 - δ - α))."""
  f = np.maximum(1 - deltas - np.exp(eps) * fpr,
                 np.exp(-eps) * (1 - deltas - fpr))
  return 1.0 - max(0.0, float(f.max()))


def _direct_mu(pld, eps, deltas):
  """sup of μ(ε) (δ_μ(ε) = δ(ε)) over ε <= ε(δ), grid and end point."""
  end = pld.get_epsilon_for_delta(DELTA)
  points = list(zip(eps[eps <= end], deltas[eps <= end]))
  points.append((end, float(pld.get_delta_for_epsilon(end))))

  def mu_at(e, d):
    return optimize.brentq(lambda m: _closed_form_delta(m, e) - d, 1e-9, 50,
                           xtol=1e-14)
  values = [mu_at(e, d) for e, d in points[::50]] + [mu_at(*points[-1])]
  return max(values), values


def test_subsampled_gaussian_matches_the_pld_computed_directly():
  q, sigma, steps = 0.05, 1.0, 40
  pld, eps, deltas = _direct_curve(q, sigma, steps)
  found = risk.event_risk(_poisson(q, sigma, steps), DELTA,
                          value_discretization_interval=INTERVAL)
  assert not found.exact and found.method == "pld"
  for fpr in FPRS:
    assert abs(found.tpr_at(fpr) - _direct_tpr(eps, deltas, fpr)) <= TOL
  mu, values = _direct_mu(pld, eps, deltas)
  assert abs(found.mu - mu) <= TOL
  # The fit dominates: μ-GDP's δ is at least the run's for δ >= DELTA...
  assert np.all(risk.gaussian_delta(found.mu, eps[deltas > DELTA]) >=
                deltas[deltas > DELTA] - 1e-12)
  # ...and the curve is no Gaussian one: μ(0) is well below it.
  assert values[0] < found.mu - 0.01
  # The TPRs upper-bound the best attack on the curve's Gaussian below.
  for fpr in FPRS:
    assert found.tpr_at(fpr) <= _closed_form_tpr(found.mu, fpr) + 1e-12
    assert found.tpr_at(fpr) > fpr


def test_default_refinement_is_within_one_percent_of_the_fine_pld():
  event = accounting.dp_event(1000, 10, 2.0, epochs=1)
  coarse = risk.event_risk(event, DELTA)
  fine = risk.event_risk(event, DELTA, value_discretization_interval=1e-5)
  assert coarse.mu == pytest.approx(fine.mu, rel=0.01)
  for fpr in FPRS:
    assert coarse.tpr_at(fpr) == pytest.approx(fine.tpr_at(fpr), rel=0.01)


def test_an_event_the_pld_does_not_take_goes_through_rdp():
  # A DP search's event (tf_pxg.tuning): only dp-accounting's RDP
  # accountant composes it. Its curve is then RDP's: valid, looser; the
  # search releases more than its inner run, so its risk is not lower.
  inner = _poisson(0.01, 1.0, 1000)
  search = dp_accounting.dp_event.RepeatAndSelectDpEvent(inner, 5.0,
                                                         math.inf)
  found = risk.event_risk(search, DELTA)
  alone = risk.event_risk(inner, DELTA)
  assert found.method == "rdp" and alone.method == "pld"
  assert math.isfinite(found.mu) and found.mu > alone.mu
  for fpr in FPRS:
    assert alone.tpr_at(fpr) < found.tpr_at(fpr) < 1.0


def test_edge_events_and_bad_arguments():
  none = risk.event_risk(None, DELTA)
  assert none.mu == math.inf and none.tpr_at(1e-3) == 1.0
  nothing = risk.event_risk(dp_accounting.NoOpDpEvent(), DELTA)
  assert nothing.mu == 0.0 and nothing.tpr_at(1e-2) == pytest.approx(1e-2)
  noiseless = risk.event_risk(_poisson(0.1, 0.0, 3), DELTA)
  assert noiseless.mu == math.inf and noiseless.tpr_at(1e-3) == 1.0
  with pytest.raises(ValueError, match="delta"):
    risk.event_risk(_gaussians(1.0, 1), 0.0)
  with pytest.raises(ValueError, match="FPR .* got 2"):
    risk.event_risk(_gaussians(1.0, 1), DELTA, fprs=(2,))
  with pytest.raises(KeyError, match="0.5"):
    risk.event_risk(_gaussians(1.0, 1), DELTA).tpr_at(0.5)


# ---------------------------------------------------------------------------
# Where it is reported: the CLI, the summary, the logs.
# ---------------------------------------------------------------------------


def test_cli_epsilon_risk_prints_mu_and_tprs(capsys):
  args = ["tf-pxg", "epsilon", "--num_examples=60000", "--batch_size=256",
          "--noise_multiplier=1.1", "--epochs=3"]
  assert cli.main(args) == 0
  plain = capsys.readouterr().out.strip()
  assert "\n" not in plain  # unchanged without --risk
  assert cli.main(args + ["--risk"]) == 0
  lines = capsys.readouterr().out.strip().split("\n")
  assert lines[0] == plain
  values = {k: float(v.split()[0]) for k, v in
            (line.split("=", 1) for line in lines[1:])}
  want = risk.event_risk(
      _poisson(256 / 60000, 1.1, accounting.steps_for(60000, 256, 3)),
      DELTA)
  assert values == {"mu_gdp": want.mu, "tpr_at_fpr_0.001": want.tpr_at(1e-3),
                    "tpr_at_fpr_0.01": want.tpr_at(1e-2)}
  assert "fit at delta=1e-05" in lines[1]


N = 64


def _fit_model(callback):
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 3)).astype("float32")
  y = rng.integers(0, 2, N).astype("int32")
  model = dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(2)],
                           l2_norm_clip=1.0, noise_multiplier=2.0)
  model.compile(keras.optimizers.SGD(0.1),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[callback])
  return model, history.history


def test_logged_risk_and_summary_in_a_small_fit():
  model, logs = _fit_model(dpk.PrivacyCallback(
      num_examples=N, batch_size=16, delta=DELTA, log_risk=True))
  steps = int(model.optimizer.iterations.numpy())
  assert steps == 8
  # The events that ran: Poisson at q = 16/64, σ = 2, 4 steps per epoch.
  for epoch, t in enumerate((4, 8)):
    want = risk.event_risk(_poisson(16 / N, 2.0, t), DELTA)
    assert logs["mu_gdp"][epoch] == pytest.approx(want.mu, rel=1e-12)
    for fpr in FPRS:
      assert logs[f"tpr_at_fpr_{fpr:g}"][epoch] == pytest.approx(
          want.tpr_at(fpr), rel=1e-12)
  summary = model.privacy_summary()
  assert summary.splitlines()[-1] == want.describe()
  assert "μ-GDP μ = " in summary and "at FPR 0.001" in summary
  # Off by default: only ε is logged.
  plain = dpk.PrivacyCallback(num_examples=N, batch_size=16, delta=DELTA)
  plain.set_model(model)
  epoch_logs = {}
  plain.on_epoch_end(1, epoch_logs)
  assert list(epoch_logs) == ["epsilon"]
