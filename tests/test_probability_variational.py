"""DP variational inference with `DenseVariational` (issue 43).

Closed forms: for `z = x (mu + softplus(rho) * eps) + (mu_b + softplus(rho_b)
* eps_b)` and the per-example loss `l_b = (z_b - y_b)^2 / 2`, example b's
gradients are, with `dz_b = z_b - y_b` and `s = sigmoid` (softplus'):

  d l_b / d mu    = x_b^T dz_b,       d l_b / d rho   = x_b^T dz_b * eps * s(rho),
  d l_b / d mu_b  = dz_b,             d l_b / d rho_b = dz_b * eps_b * s(rho_b);

the KL regularizers' gradients (weight w, prior scale s0, sigma = softplus):

  d / d mu = w mu / s0^2,   d / d rho = w (sigma / s0^2 - 1 / sigma) s(rho).

A DP step clips the first and adds the second unclipped.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

tfp = pytest.importorskip("tensorflow_probability")

import tf_pxg  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402
import tf_pxg.probability as pxp  # noqa: E402
from tf_pxg import testing as pxg_testing  # noqa: E402

D, U, B = 3, 2, 5


def _sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def _layer(kl_weight=0.1, prior_scale=0.7, seed=0):
  keras.utils.set_random_seed(seed)
  layer = pxp.DenseVariational(U, kl_weight=kl_weight,
                               prior_scale=prior_scale, posterior_scale=0.3,
                               seed=seed)
  layer.build((None, D))
  # Posterior parameters away from their initial values.
  rng = np.random.default_rng(seed)
  for v in layer.trainable_variables:
    v.assign(rng.normal(size=v.shape).astype("float32") * 0.5)
  return layer


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_likelihood_per_example_gradients_equal_the_closed_form(mode):
  layer = _layer()
  rng = np.random.default_rng(1)
  x = rng.normal(size=(B, D)).astype("float32")
  y = rng.normal(size=(B, U)).astype("float32")
  eps = (rng.normal(size=(D, U)).astype("float32"),
         rng.normal(size=(U,)).astype("float32"))
  variables = [layer.kernel_loc, layer.kernel_rho, layer.bias_loc,
               layer.bias_rho]

  def run():
    with tf_pxg.GradientTape() as tape:
      z = layer(x, noise=eps)
      losses = 0.5 * tf.reduce_sum(tf.square(z - y), axis=1)
    return tape.per_example_gradient(losses, variables)

  fn = run if mode == "eager" else tf.function(run, jit_compile=mode == "jit")
  got = [g.numpy() for g in fn()]
  mu, rho, mu_b, rho_b = (v.numpy() for v in variables)
  kernel = mu + np.log1p(np.exp(rho)) * eps[0]
  bias = mu_b + np.log1p(np.exp(rho_b)) * eps[1]
  dz = x @ kernel + bias - y
  g_mu = x[:, :, None] * dz[:, None, :]
  expected = [g_mu, g_mu * eps[0] * _sigmoid(rho), dz,
              dz * eps[1] * _sigmoid(rho_b)]
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5,
                               atol=1e-6 * float(np.abs(e).max()))


def _kl_gradient_closed_form(layer):
  w, s0 = layer.kl_weight, layer.prior_scale
  out = []
  for v in layer.trainable_variables:
    value = v.numpy().astype(np.float64)
    if v.path.endswith("_loc"):
      out.append(w * value / s0 ** 2)
    else:
      sigma = np.log1p(np.exp(value))
      out.append(w * (sigma / s0 ** 2 - 1.0 / sigma) * _sigmoid(value))
  return out


def test_kl_regularizers_equal_tfp_kl_and_its_closed_form_gradient():
  layer = _layer()
  with tf.GradientTape() as tape:
    kl_loss = tf.add_n(layer.losses)
  grads = tape.gradient(kl_loss, layer.trainable_variables)
  for g, e in zip(grads, _kl_gradient_closed_form(layer)):
    np.testing.assert_allclose(g, e, rtol=1e-5)
  # KL(q || p) against TFP's own Normal-Normal KL.
  tfd = tfp.distributions
  reference = 0.0
  for loc, rho in ((layer.kernel_loc, layer.kernel_rho),
                   (layer.bias_loc, layer.bias_rho)):
    q = tfd.Normal(loc, tf.nn.softplus(rho))
    reference += float(tf.reduce_sum(tfd.kl_divergence(
        q, tfd.Normal(0.0, layer.prior_scale))))
  assert float(layer.kl_divergence()) == pytest.approx(reference, rel=1e-5)
  assert float(kl_loss) == pytest.approx(layer.kl_weight * reference,
                                         rel=1e-5)


def _vi_model(kl_weight, clip, noise, seed=0):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((D,))
  hidden = pxp.DenseVariational(8, kl_weight=kl_weight, activation="tanh",
                                seed=seed)(inp)
  out = keras.layers.Dense(2)(hidden)
  model = dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=noise,
                      seed=seed)
  model.compile(optimizer=keras.optimizers.SGD(0.1),
                loss=pxp.NegativeLogLikelihood(pxp.Normal()))
  return model


def test_dp_step_clips_the_likelihood_and_not_the_kl():
  """Tiny clip C, no noise: the step is `-lr (clipped likelihood mean +
  KL gradient)`. The likelihood part is bounded by C (its unclipped
  gradients are far above C), the KL part passes in full (far above C)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, D)).astype("float32")
  y = rng.normal(size=(16, 1)).astype("float32")
  clip, lr = 1e-4, 0.1
  model = _vi_model(kl_weight=0.5, clip=clip, noise=0.0)
  model(x)
  w0 = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  layer = model.layers[1]
  kl_grads = {v.path: g for v, g in zip(layer.trainable_variables,
                                        _kl_gradient_closed_form(layer))}
  with tf.GradientTape() as tape:  # The unclipped likelihood gradient.
    nll = tf.reduce_mean(model.loss.call(y, model(x)))
  nll_norm = math.sqrt(sum(float(tf.reduce_sum(tf.square(g))) for g in
                           tape.gradient(nll, model.trainable_variables)))
  assert nll_norm > 100 * clip

  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
            sampling="shuffled")
  step = [(v.numpy() - w) / -lr for v, w in zip(model.trainable_variables,
                                                 w0)]
  kl = [kl_grads.get(v.path, np.zeros(v.shape)) for v in
        model.trainable_variables]
  kl_norm = math.sqrt(sum(float(np.sum(k * k)) for k in kl))
  assert kl_norm > 100 * clip
  # What is left after the KL is the clipped mean: norm <= C.
  rest = math.sqrt(sum(float(np.sum((s - k) ** 2)) for s, k in zip(step, kl)))
  assert rest <= clip * (1 + 1e-3) + 1e-5 * kl_norm, (rest, clip, kl_norm)


def test_reparameterisation_noise_passes_the_independence_check():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, D)).astype("float32")
  y = rng.normal(size=(8, 1)).astype("float32")
  model = _vi_model(kl_weight=0.01, clip=1.0, noise=0.0)
  result = pxg_testing.check_example_independence(
      model, x, y, loss=pxp.NegativeLogLikelihood(pxp.Normal()).call)
  assert result.passed, result.details
  assert result.changed_loss_change > 0  # The change was exercised.


def test_dp_vi_fit_reports_epsilon_saves_and_loads(tmp_path):
  rng = np.random.default_rng(0)
  n = 512
  x = rng.normal(size=(n, D)).astype("float32")
  y = (x @ np.array([1.0, -0.5, 0.2]) + 0.3 * rng.normal(size=n)).astype(
      "float32")[:, None]
  model = _vi_model(kl_weight=1.0 / n, clip=1.0, noise=1.0)
  model.compile(optimizer="adam",
                loss=pxp.NegativeLogLikelihood(pxp.Normal()))
  history = model.fit(x, y, batch_size=64, epochs=3, verbose=0,
                      callbacks=[dpk.PrivacyCallback(n, 64, delta=1e-5)])
  assert all(math.isfinite(e) and e > 0 for e in history.history["epsilon"])
  path = str(tmp_path / "vi.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  layer = loaded.layers[1]
  assert isinstance(layer, pxp.DenseVariational)
  assert layer.kl_weight == pytest.approx(1.0 / n)
  for a, b in zip(loaded.trainable_variables, model.trainable_variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert float(loaded.layers[1].kl_divergence()) == pytest.approx(
      float(model.layers[1].kl_divergence()))
