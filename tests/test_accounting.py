"""Tests for tf_pxg.accounting against dp_accounting and published values."""

import logging
import math

import dp_accounting
import pytest

from tf_pxg import accounting

# TF Privacy's orders plus a few large ones, written out independently of
# accounting.RDP_ORDERS so a change there is caught.
ORDERS = ([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) +
          [128, 256, 512, 1024])

MNIST = dict(num_examples=60000, batch_size=256)
MNIST_STEPS_60_EPOCHS = 14063  # ceil(60 * 60000 / 256) = ceil(14062.5)


def _event(q, sigma, steps):
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), steps)


def _rdp_direct(q, sigma, steps, delta):
  acc = dp_accounting.rdp.RdpAccountant(ORDERS)
  return acc.compose(_event(q, sigma, steps)).get_epsilon(delta)


def _pld_direct(q, sigma, steps, delta, interval):
  acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
  return acc.compose(_event(q, sigma, steps)).get_epsilon(delta)


# ---------------------------------------------------------------------------
# Agreement with dp_accounting called directly.
# ---------------------------------------------------------------------------

SETTINGS = [
    # num_examples, batch_size, noise_multiplier, steps, delta, PLD reference
    # discretisation interval (fine enough to be converged to < 0.1%)
    (60000, 256, 1.1, 14063, 1e-5, 1e-4),
    (50000, 512, 0.5, 977, 1e-5, 1e-4),
    (1000, 1000, 0.8, 10, 1e-3, 1e-4),  # q = 1: no subsampling
    (60000, 256, 17.0, 14063, 1e-5, 1e-5),  # small epsilon, many steps
]


@pytest.mark.parametrize("n,b,sigma,steps,delta,_", SETTINGS)
def test_rdp_equals_dp_accounting(n, b, sigma, steps, delta, _):
  expected = _rdp_direct(b / n, sigma, steps, delta)
  got = accounting.compute_epsilon(n, b, sigma, steps=steps, delta=delta)
  assert isinstance(got, float)
  assert got == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("n,b,sigma,steps,delta,interval", SETTINGS)
def test_pld_close_to_converged_dp_accounting(n, b, sigma, steps, delta,
                                              interval):
  # A fine discretisation is the reference; our pessimistic estimate must be
  # within 1.5% above it. (A fixed 1e-3 interval fails the small-epsilon row:
  # 0.170 vs 0.090.)
  converged = _pld_direct(b / n, sigma, steps, delta, interval)
  got = accounting.compute_epsilon(
      n, b, sigma, steps=steps, delta=delta, accountant="pld")
  assert converged * (1 - 1e-3) <= got <= converged * 1.015


def test_pld_tighter_than_rdp_on_mnist():
  rdp = accounting.compute_epsilon(**MNIST, noise_multiplier=1.1, epochs=60)
  pld = accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, epochs=60, accountant="pld")
  assert pld < rdp


def test_dp_event_is_the_poisson_sampled_gaussian():
  event = accounting.dp_event(**MNIST, noise_multiplier=1.1, epochs=60)
  assert event == _event(256 / 60000, 1.1, MNIST_STEPS_60_EPOCHS)


# ---------------------------------------------------------------------------
# Published reference values.
#
# TF Privacy's MNIST tutorial reports, at delta = 1e-5, N = 60000, B = 256:
# sigma = 1.1, 60 epochs -> eps 3.01; sigma = 1.12, 60 epochs -> 2.92;
# sigma = 1.3, 15 epochs -> 1.19. Those numbers use the classic RDP -> (eps,
# delta) conversion eps = min_a RDP(a) + log(1/delta) / (a - 1) (Mironov 2017,
# Prop. 3). dp_accounting (and so we) use the tighter conversion of Canonne,
# Kamath and Steinke 2020 (Prop. 12):
#   eps = min_a RDP(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1),
# smaller at every order. Below, the RDP curve is computed independently from
# Mironov, Talwar and Zhang 2019 (integer orders, binomial expansion); the
# classic conversion must reproduce the published numbers, and ours must match
# the tighter conversion of the same curve.
# ---------------------------------------------------------------------------

_INT_ORDERS = list(range(2, 64)) + [128, 256]


def _log_a_int(q, sigma, alpha):
  """log E_{z~N(0,s^2)}[((1-q) + q N(1,s^2)(z) / N(0,s^2)(z))^alpha]."""
  terms = [
      math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
      + k * math.log(q) + (alpha - k) * math.log1p(-q)
      + (k * k - k) / (2 * sigma**2) for k in range(alpha + 1)
  ]
  top = max(terms)
  return top + math.log(sum(math.exp(t - top) for t in terms))


def _independent_rdp(q, sigma, steps):
  return [steps * _log_a_int(q, sigma, a) / (a - 1) for a in _INT_ORDERS]


def _classic_eps(rdp, delta):
  return min(r + math.log(1 / delta) / (a - 1)
             for a, r in zip(_INT_ORDERS, rdp))


def _improved_eps(rdp, delta):
  return min(r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
             for a, r in zip(_INT_ORDERS, rdp))


@pytest.mark.parametrize("sigma,epochs,published", [
    (1.1, 60, 3.01),
    (1.12, 60, 2.92),
    (1.3, 15, 1.19),
])
def test_published_tf_privacy_mnist_values(sigma, epochs, published):
  steps = math.ceil(epochs * 60000 / 256)
  rdp = _independent_rdp(256 / 60000, sigma, steps)
  # The independent RDP curve reproduces the published numbers (2 decimals).
  assert abs(_classic_eps(rdp, 1e-5) - published) <= 0.006
  ours = accounting.compute_epsilon(
      **MNIST, noise_multiplier=sigma, epochs=epochs)
  # Our orders contain _INT_ORDERS, so ours is at most the tighter conversion
  # of the independent curve, and fractional orders gain little on it.
  improved = _improved_eps(rdp, 1e-5)
  assert improved - 0.005 <= ours <= improved + 1e-9
  assert ours < published


def test_mnist_reference_band():
  # sigma = 1.1, 60 epochs: 3.01 under the classic conversion; the tighter
  # one lowers it by ~0.41 at the optimal order (~a = 20).
  eps = accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, epochs=60, delta=1e-5)
  assert 2.55 < eps < 2.65


# ---------------------------------------------------------------------------
# Properties.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_more_noise_less_epsilon(acc):
  eps = [
      accounting.compute_epsilon(
          **MNIST, noise_multiplier=s, epochs=20, accountant=acc)
      for s in (0.8, 1.0, 1.5, 3.0)
  ]
  assert all(a > b for a, b in zip(eps, eps[1:])), eps


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_more_epochs_more_epsilon(acc):
  eps = [
      accounting.compute_epsilon(
          **MNIST, noise_multiplier=1.1, epochs=e, accountant=acc)
      for e in (1, 5, 20, 60)
  ]
  assert all(a < b for a, b in zip(eps, eps[1:])), eps


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_epochs_equal_steps(acc):
  by_epochs = accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, epochs=60, accountant=acc)
  by_steps = accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, steps=MNIST_STEPS_60_EPOCHS,
      accountant=acc)
  off_by_one = accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, steps=MNIST_STEPS_60_EPOCHS - 1,
      accountant=acc)
  assert by_epochs == by_steps
  assert off_by_one < by_steps


@pytest.mark.parametrize("n,b,epochs,steps", [
    (60000, 256, 60, 14063),
    (60000, 256, 1, 235),      # 234.375
    (100, 10, 1.1, 11),        # exact: in floats 1.1 * 100 / 10 = 11.000...02
    (50000, 100, 1.1, 550),
    (1000, 100, 3, 30),
    (1000, 1000, 2.5, 3),
    (60000, 256, 0, 0),
])
def test_steps_for(n, b, epochs, steps):
  assert accounting.steps_for(n, b, epochs) == steps


def test_edge_values():
  assert accounting.compute_epsilon(100, 10, 0.0, steps=5) == math.inf
  assert accounting.compute_epsilon(
      100, 10, 0.0, steps=5, accountant="pld") == math.inf
  assert accounting.compute_epsilon(100, 10, 1.0, steps=0) == 0.0
  assert accounting.compute_epsilon(100, 10, 1.0, epochs=0) == 0.0
  assert accounting.noise_multiplier_for_epsilon(1.0, 100, 10, steps=0) == 0.0


@pytest.mark.parametrize("acc,target", [
    ("rdp", 3.0), ("rdp", 0.5), ("rdp", 10.0), ("pld", 3.0)])
def test_noise_multiplier_round_trip(acc, target):
  tol = 1e-4
  sigma = accounting.noise_multiplier_for_epsilon(
      target, **MNIST, epochs=60, accountant=acc, tolerance=tol)

  def eps(s):
    return accounting.compute_epsilon(
        **MNIST, noise_multiplier=s, epochs=60, accountant=acc)

  assert eps(sigma) <= target
  assert eps(sigma - tol) > target


def test_noise_multiplier_for_mnist_published_setting():
  # Inverting the MNIST run: reaching our eps for sigma = 1.1 needs sigma 1.1.
  eps = accounting.compute_epsilon(**MNIST, noise_multiplier=1.1, epochs=60)
  sigma = accounting.noise_multiplier_for_epsilon(
      eps, **MNIST, epochs=60, tolerance=1e-6)
  assert sigma == pytest.approx(1.1, abs=2e-6)


def test_noise_multiplier_unreachable():
  # No subsampling, a million steps, delta = 1e-10: eps stays above 1e-3 for
  # every sigma <= 2**20 (the largest RDP order, 1024, alone gives eps >=
  # log(1e10 / 1024) / 1023 ~ 0.016 until the RDP is below delta**2).
  with pytest.raises(ValueError, match=r"target_epsilon=0.001 is not "
                     r"reachable: even noise_multiplier="):
    accounting.noise_multiplier_for_epsilon(
        1e-3, num_examples=1000, batch_size=1000, steps=10**6, delta=1e-10)


def test_large_noise_reaches_epsilon_zero():
  # With RDP below delta**2 the KL bound gives (0, delta)-DP: eps is exactly 0,
  # so tiny targets are reachable with enough noise.
  assert accounting.compute_epsilon(
      **MNIST, noise_multiplier=1e6, epochs=60) == 0.0


# ---------------------------------------------------------------------------
# Input validation: every ValueError names the argument and the bad value.
# ---------------------------------------------------------------------------

_OK = dict(num_examples=60000, batch_size=256, noise_multiplier=1.1, epochs=1)

BAD_EPSILON_ARGS = [
    (dict(num_examples=0), r"num_examples must be a positive integer.*got 0"),
    (dict(num_examples=-5), r"num_examples .* got -5"),
    (dict(num_examples=600.0), r"num_examples .* got 600.0"),
    (dict(num_examples=True), r"num_examples .* got True"),
    (dict(batch_size=0), r"batch_size .*0 < batch_size <= num_examples "
     r"\(= 60000\); got 0"),
    (dict(batch_size=60001), r"batch_size .* got 60001"),
    (dict(batch_size=25.6), r"batch_size .* got 25.6"),
    (dict(noise_multiplier=-0.1), r"noise_multiplier must be a finite number "
     r">= 0; got -0.1"),
    (dict(noise_multiplier=math.nan), r"noise_multiplier .* got nan"),
    (dict(noise_multiplier=math.inf), r"noise_multiplier .* got inf"),
    (dict(noise_multiplier="1.1"), r"noise_multiplier .* got '1.1'"),
    (dict(delta=0.0), r"delta must be a number with 0 < delta < 1; got 0.0"),
    (dict(delta=1.0), r"delta .* got 1.0"),
    (dict(delta=-1e-5), r"delta .* got -1e-05"),
    (dict(accountant="moments"), r"accountant must be one of 'rdp', 'pld'; "
     r"got 'moments'"),
    (dict(epochs=-1), r"epochs must be a finite number >= 0; got -1"),
    (dict(epochs=math.inf), r"epochs .* got inf"),
    (dict(epochs=None, steps=-3), r"steps must be an integer >= 0; got -3"),
    (dict(epochs=None, steps=2.5), r"steps .* got 2.5"),
    (dict(epochs=None), r"exactly one of epochs and steps; got epochs=None, "
     r"steps=None"),
    (dict(steps=10), r"exactly one of epochs and steps; got epochs=1, "
     r"steps=10"),
]


@pytest.mark.parametrize("override,message", BAD_EPSILON_ARGS)
def test_compute_epsilon_rejects(override, message):
  with pytest.raises(ValueError, match=message):
    accounting.compute_epsilon(**{**_OK, **override})


@pytest.mark.parametrize("override,message", [
    (dict(target_epsilon=0.0), r"target_epsilon must be a finite number > 0; "
     r"got 0.0"),
    (dict(target_epsilon=-1), r"target_epsilon .* got -1"),
    (dict(target_epsilon=math.inf), r"target_epsilon .* got inf"),
    (dict(tolerance=0), r"tolerance must be a finite number > 0; got 0"),
    (dict(tolerance=math.nan), r"tolerance .* got nan"),
    (dict(batch_size=70000), r"batch_size .* got 70000"),
    (dict(delta=2.0), r"delta .* got 2.0"),
    (dict(accountant="RDP"), r"accountant .* got 'RDP'"),
    (dict(epochs=None), r"exactly one of epochs and steps"),
])
def test_noise_multiplier_for_epsilon_rejects(override, message):
  args = dict(target_epsilon=1.0, num_examples=60000, batch_size=256, epochs=1)
  with pytest.raises(ValueError, match=message):
    accounting.noise_multiplier_for_epsilon(**{**args, **override})


@pytest.mark.parametrize("call", [
    lambda: accounting.steps_for(100, 0, 1),
    lambda: accounting.steps_for(100, 10, -1),
    lambda: accounting.dp_event(100, 10, -1.0, steps=1),
    lambda: accounting.dp_event(100, 10, 1.0),
])
def test_helpers_reject(call):
  with pytest.raises(ValueError):
    call()


# ---------------------------------------------------------------------------
# dp_accounting's log output stays inside our calls.
# ---------------------------------------------------------------------------

# q = 0.5, sigma = 2: the RDP series of many fractional orders does not
# converge and dp_accounting logs one absl warning per such order.
_NOISY = dict(num_examples=1000, batch_size=500, noise_multiplier=2.0,
              steps=10)


def test_dp_accounting_does_log_for_this_setting(caplog):
  # Precondition for the next test: calling dp_accounting directly logs.
  with caplog.at_level(logging.WARNING):
    _rdp_direct(0.5, 2.0, 10, 1e-5)
  assert any("failed to converge" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_no_log_spam(acc, caplog, capfd):
  capfd.readouterr()
  with caplog.at_level(logging.DEBUG):
    eps = accounting.compute_epsilon(**_NOISY, accountant=acc)
    if acc == "rdp":  # many more calls into the RDP code that logs
      accounting.noise_multiplier_for_epsilon(
          eps * 1.5, num_examples=1000, batch_size=500, steps=10,
          accountant=acc, tolerance=1e-2)
  assert math.isfinite(eps)
  assert caplog.records == []
  out, err = capfd.readouterr()
  assert out == "" and err == ""
  # The filter is gone afterwards: other code's records still get through.
  assert logging.getLogger("absl").filters == []
  assert logging.getLogger().filters == []
  with caplog.at_level(logging.WARNING):
    _rdp_direct(0.5, 2.0, 10, 1e-5)
  assert caplog.records


def test_quiet_only_drops_dp_accounting_records(caplog):
  with caplog.at_level(logging.WARNING):
    with accounting._quiet_dp_accounting():  # pylint: disable=protected-access
      logging.getLogger("absl").warning("someone else's absl warning")
      logging.warning("someone else's root warning")
  assert [r.getMessage() for r in caplog.records] == [
      "someone else's absl warning", "someone else's root warning"]


def test_compute_epsilon_grows_with_epochs():
  # (Its speed is a benchmark matter, not asserted here.)
  for acc in accounting.ACCOUNTANTS:
    eps = [accounting.compute_epsilon(**MNIST, noise_multiplier=1.1,
                                      epochs=e, accountant=acc)
           for e in (15, 60)]
    assert all(math.isfinite(e) and e > 0 for e in eps), (acc, eps)
    assert eps[0] < eps[1], (acc, eps)


# ---------------------------------------------------------------------------
# Amplified BandMF (num_bands = b): ceil(T / b) compositions of the
# Poisson-sampled Gaussian at q = B b / N (Choquette-Choo et al. 2023; the
# event of jax-privacy's amplified_bandmf_event), built here directly.
# ---------------------------------------------------------------------------

BANDMF_SETTINGS = [
    # num_examples, batch_size, noise_multiplier, steps (not a multiple of
    # 4 or 16), delta
    (60000, 256, 1.1, 1001, 1e-5),
    (50000, 500, 0.8, 333, 1e-6),
]


@pytest.mark.parametrize("bands", [1, 4, 16])
@pytest.mark.parametrize("n,b,sigma,steps,delta", BANDMF_SETTINGS)
def test_bandmf_rdp_equals_dp_accounting(n, b, sigma, steps, delta, bands):
  rounds = math.ceil(steps / bands)
  assert steps % bands == 0 or rounds * bands > steps
  expected = _rdp_direct(b * bands / n, sigma, rounds, delta)
  got = accounting.compute_epsilon(n, b, sigma, steps=steps, delta=delta,
                                   num_bands=bands)
  assert got == pytest.approx(expected, rel=1e-9)
  assert accounting.dp_event(n, b, sigma, steps=steps,
                             num_bands=bands) == _event(
                                 b * bands / n, sigma, rounds)


@pytest.mark.parametrize("bands", [4, 16])
@pytest.mark.parametrize("n,b,sigma,steps,delta", BANDMF_SETTINGS)
def test_bandmf_pld_close_to_converged_dp_accounting(n, b, sigma, steps,
                                                     delta, bands):
  converged = _pld_direct(b * bands / n, sigma, math.ceil(steps / bands),
                          delta, 1e-4)
  got = accounting.compute_epsilon(n, b, sigma, steps=steps, delta=delta,
                                   accountant="pld", num_bands=bands)
  assert converged * (1 - 1e-3) <= got <= converged * 1.015


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_one_band_is_exactly_dp_sgd(acc):
  assert accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, accountant=acc, epochs=3,
      num_bands=1) == accounting.compute_epsilon(
          **MNIST, noise_multiplier=1.1, accountant=acc, epochs=3)


def test_one_band_event_and_noise_are_dp_sgd():
  assert accounting.dp_event(
      **MNIST, noise_multiplier=1.1, epochs=60, num_bands=1) == _event(
          256 / 60000, 1.1, MNIST_STEPS_60_EPOCHS)
  assert accounting.noise_multiplier_for_epsilon(
      3.0, **MNIST, epochs=2, num_bands=1,
      tolerance=1e-3) == accounting.noise_multiplier_for_epsilon(
          3.0, **MNIST, epochs=2, tolerance=1e-3)


def test_bandmf_epochs_equal_steps():
  # 2.5 epochs of N=60000, B=256: ceil(585.9) = 586 steps.
  assert accounting.compute_epsilon(
      **MNIST, noise_multiplier=1.1, epochs=2.5,
      num_bands=16) == accounting.compute_epsilon(
          **MNIST, noise_multiplier=1.1, steps=586, num_bands=16)


@pytest.mark.parametrize("bands,target", [(4, 2.0), (16, 1.0)])
def test_bandmf_noise_multiplier_round_trip(bands, target):
  tol = 1e-4
  sigma = accounting.noise_multiplier_for_epsilon(
      target, **MNIST, steps=1001, tolerance=tol, num_bands=bands)

  def eps(s):
    return _rdp_direct(256 * bands / 60000, s, math.ceil(1001 / bands), 1e-5)

  assert eps(sigma) <= target
  assert eps(sigma - tol) > target


def test_sampling_probability_and_max_num_bands():
  assert accounting.sampling_probability(60000, 256) == 256 / 60000
  assert accounting.sampling_probability(60000, 256, 16) == 256 * 16 / 60000
  assert accounting.sampling_probability(1000, 100, 10) == 1.0
  assert accounting.max_num_bands(60000, 256) == 234
  assert accounting.max_num_bands(1000, 100) == 10
  # The largest b is accepted, the next is not.
  accounting.compute_epsilon(1000, 100, 1.0, steps=25, num_bands=10)


_TOO_LARGE = (r"num_bands=11 is too large for num_examples=1000 and "
              r"batch_size=100.*exceeds 1. Use num_bands <= 10")


@pytest.mark.parametrize("bands,message", [
    (0, r"num_bands must be a positive integer \(1 = DP-SGD\); got 0"),
    (-4, r"num_bands .* got -4"),
    (4.0, r"num_bands .* got 4.0"),
    (True, r"num_bands .* got True"),
    (None, r"num_bands .* got None"),
    (11, _TOO_LARGE),
])
def test_num_bands_rejected(bands, message):
  run = dict(num_examples=1000, batch_size=100)
  calls = [
      lambda: accounting.compute_epsilon(**run, noise_multiplier=1.0,
                                         steps=10, num_bands=bands),
      lambda: accounting.dp_event(**run, noise_multiplier=1.0, steps=10,
                                  num_bands=bands),
      lambda: accounting.noise_multiplier_for_epsilon(1.0, **run, steps=10,
                                                      num_bands=bands),
      lambda: accounting.sampling_probability(**run, num_bands=bands),
  ]
  for call in calls:
    with pytest.raises(ValueError, match=message):
      call()


def test_num_bands_is_keyword_only():
  with pytest.raises(TypeError):
    accounting.dp_event(1000, 100, 1.0, None, 10, 4)  # pylint: disable=too-many-function-args


# ---------------------------------------------------------------------------
# Adaptive clipping: Andrew et al. 2021, Theorem 1, against dp_accounting's
# composition of the two Gaussians.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sigma,sigma_b", [(1.0, 5.0), (1.1, 0.6),
                                           (0.7, 20.0), (3.0, 1.6)])
def test_split_noise_multipliers_compose_to_the_accounted_sigma(sigma,
                                                                sigma_b):
  sigma_g = accounting.split_noise_multipliers(sigma, sigma_b)
  assert sigma_g > sigma
  count = dp_accounting.GaussianDpEvent(2 * sigma_b)  # sensitivity 1/2
  both = dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(sigma_g), count])
  q, steps, delta = 256 / 60000, 1000, 1e-5
  for pair, single in [
      # One unsampled step, and a Poisson-sampled run where each step
      # releases both for the same batch.
      (both, dp_accounting.GaussianDpEvent(sigma)),
      (dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, both), steps),
       _event(q, sigma, steps)),
  ]:
    acc_pair = dp_accounting.rdp.RdpAccountant(ORDERS).compose(pair)
    acc_single = dp_accounting.rdp.RdpAccountant(ORDERS).compose(single)
    assert acc_pair.get_epsilon(delta) == pytest.approx(
        acc_single.get_epsilon(delta), rel=1e-12)
  # The pair really costs more than the gradient alone.
  alone = dp_accounting.rdp.RdpAccountant(ORDERS).compose(
      dp_accounting.GaussianDpEvent(sigma_g)).get_epsilon(delta)
  assert alone < dp_accounting.rdp.RdpAccountant(ORDERS).compose(
      both).get_epsilon(delta)
  assert accounting.combined_noise_multiplier(sigma_g, sigma_b) == (
      pytest.approx(sigma, rel=1e-12))


def test_split_noise_multipliers_closed_form():
  # sigma^-2 = sigma_g^-2 + (2 sigma_b)^-2 with sigma = 1, sigma_b = 5:
  # sigma_g^-2 = 1 - 1/100.
  assert accounting.split_noise_multipliers(1.0, 5.0) == pytest.approx(
      (1 - 0.01)**-0.5, rel=1e-15)


@pytest.mark.parametrize("args,message", [
    ((1.0, 0.5), r"count_noise_multiplier=0.5 is too small for "
     r"noise_multiplier=1.0.*Use count_noise_multiplier > 0.5 "),
    ((2.0, 0.3), r"count_noise_multiplier > 1.0 "),
    ((0.0, 1.0), r"noise_multiplier must be a finite number > 0; got 0.0"),
    ((math.inf, 1.0), r"noise_multiplier .* got inf"),
    ((1.0, 0.0), r"count_noise_multiplier must be a finite number > 0; "
     r"got 0.0"),
    ((1.0, math.nan), r"count_noise_multiplier .* got nan"),
    ((1.0, True), r"count_noise_multiplier .* got True"),
])
def test_split_noise_multipliers_rejects(args, message):
  with pytest.raises(ValueError, match=message):
    accounting.split_noise_multipliers(*args)


def test_combined_noise_multiplier_rejects():
  with pytest.raises(ValueError, match="gradient_noise_multiplier"):
    accounting.combined_noise_multiplier(0.0, 1.0)
  with pytest.raises(ValueError, match="count_noise_multiplier"):
    accounting.combined_noise_multiplier(1.0, -1.0)
