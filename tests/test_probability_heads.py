"""Distribution heads under DP (issue 43): TFP likelihoods, per example.

Every head of `tf_pxg.probability` on a Keras 3 model, the way users write
it (functional model, numpy arrays, string optimizer, `NegativeLogLikelihood`
as the compiled loss):

* the engine's per-example gradients, norms and clipped sums against the
  plain `tf.GradientTape` loop over single examples (`tf_pxg.testing`),
  eagerly, in `tf.function` and under XLA, float32 and float64, at B = 6
  (a multiple of the length of TFP's lbeta coefficient table, which the
  engine once took for a batch of examples);
* one noiseless DP step of `fit` against the reference DP-SGD update;
* a noisy `fit` that learns and reports ε, save/load, and the DP plan's
  parts (a sampler, a clipping policy, accumulation, XLA, MirroredStrategy).
"""

import math
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

tfp = pytest.importorskip("tensorflow_probability")

import tf_pxg  # noqa: E402
import tf_pxg.keras as dpk  # noqa: E402
import tf_pxg.probability as pxp  # noqa: E402
from tf_pxg import testing as pxg_testing  # noqa: E402

B = 6
D = 4
MODES = ("eager", "function", "jit")
DTYPES = ("float32", "float64")


def _labels(name: str, rng, n: int, dtype: str) -> np.ndarray:
  if name in ("Poisson", "NegativeBinomial"):
    return rng.poisson(3.0, size=(n, 1)).astype(dtype)
  if name == "CensoredWeibull":
    return np.stack([rng.uniform(0.2, 2.0, n), rng.integers(0, 2, n)],
                    1).astype(dtype)
  return rng.normal(size=(n, 1)).astype(dtype)


HEADS = {
    "Normal": pxp.Normal,
    "StudentT": pxp.StudentT,
    "Poisson": pxp.Poisson,
    "NegativeBinomial": pxp.NegativeBinomial,
    "MixtureDensity": lambda: pxp.MixtureDensity(num_components=3),
    "CensoredWeibull": pxp.CensoredWeibull,
}


def _data(name, dtype="float32", n=B, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, D)).astype(dtype), _labels(name, rng, n, dtype)


def _layers(head, dtype):
  inp = keras.Input((D,), dtype=dtype)
  hidden = keras.layers.Dense(8, activation="tanh", dtype=dtype)(inp)
  return inp, keras.layers.Dense(head.num_params, dtype=dtype)(hidden)


def _plain_model(head, dtype="float32", seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Model(*_layers(head, dtype))


def _per_example_loss(head, dtype):
  loss = pxp.NegativeLogLikelihood(head, dtype=dtype)
  return lambda y, p: loss.call(y, p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", HEADS)
def test_per_example_gradients_match_the_reference_loop(name, mode, dtype):
  head = HEADS[name]()
  model = _plain_model(head, dtype)
  x, y = _data(name, dtype)
  err = pxg_testing.check_per_example_gradients(
      _per_example_loss(head, dtype), model, model.trainable_variables, x,
      labels=y, mode=mode)
  # Norms and clip factors are float32 by contract, in float64 too.
  assert err <= 1e-4, err


class _InitialWeights(keras.callbacks.Callback):
  """The trainable weights just before the first step (after a build)."""

  def on_train_batch_begin(self, batch, logs=None):
    if not hasattr(self, "weights"):
      self.weights = [np.asarray(v.numpy(), np.float64)
                      for v in self.model.trainable_variables]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", HEADS)
def test_noiseless_dp_step_matches_the_reference_update(name, mode, dtype):
  """One `fit` step with noise 0 against `w - lr mean_b min(1, C/n_b) g_b`,
  the g_b from a plain tf.GradientTape on one example at a time."""
  head = HEADS[name]()
  x, y = _data(name, dtype, seed=1)
  reference_model = _plain_model(head, dtype, seed=3)
  grads = pxg_testing.reference_per_example_gradients(
      _per_example_loss(head, dtype), reference_model,
      reference_model.trainable_variables, x, y)
  grads = [np.asarray(g, np.float64) for g in grads]
  w0 = [np.asarray(v.numpy(), np.float64)
        for v in reference_model.trainable_variables]
  norms = pxg_testing.per_example_global_norms(grads)
  clip = float(np.median(norms))  # some examples clipped, some not
  expected = pxg_testing.expected_dp_sgd_weights(w0, grads, clip,
                                                 learning_rate=0.5)

  keras.utils.set_random_seed(3)
  model = dpk.DPModel(*_layers(head, dtype), l2_norm_clip=clip,
                      noise_multiplier=0.0)
  model.compile(optimizer=keras.optimizers.SGD(0.5),
                loss=pxp.NegativeLogLikelihood(head, dtype=dtype),
                run_eagerly=mode == "eager", jit_compile=mode == "jit")
  initial = _InitialWeights()
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
            sampling="shuffled", callbacks=[initial])
  for a, b in zip(initial.weights, w0):
    np.testing.assert_array_equal(a, b)
  pxg_testing.assert_dp_step_matches_reference(
      [v.numpy() for v in model.trainable_variables], w0, expected,
      rtol=1e-4 if dtype == "float32" else 1e-5)


def _synthetic(name, n, seed=0):
  """Labels that a linear model of x explains, per head's family."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, D)).astype("float32")
  signal = x @ np.array([0.8, -0.5, 0.3, 0.0]) * 0.7
  if name in ("Poisson", "NegativeBinomial"):
    y = rng.poisson(np.exp(1.0 + signal))
  elif name == "CensoredWeibull":
    t = np.exp(signal) * rng.weibull(2.0, n)
    c = rng.uniform(0.5, 3.0, n)
    y = np.stack([np.minimum(t, c), (t <= c)], 1)
  elif name == "StudentT":
    y = signal + 0.3 * rng.standard_t(3.0, n)
  else:
    y = signal + 0.3 * np.exp(0.5 * x[:, 1]) * rng.normal(size=n)
  y = np.asarray(y, "float32")
  return x, y.reshape(n, -1)


def _mean_nll(model, head, x, y):
  loss = pxp.NegativeLogLikelihood(head)
  return float(np.mean(loss.call(y, model.predict(x, verbose=0))))


@pytest.mark.parametrize("name", HEADS)
def test_noisy_fit_learns_and_reports_epsilon(name):
  head = HEADS[name]()
  n, batch = 1024, 128
  x, y = _synthetic(name, n)
  keras.utils.set_random_seed(0)
  model = dpk.DPModel(*_layers(head, "float32"), l2_norm_clip=1.0,
                      noise_multiplier=1.0, seed=11)
  model.compile(optimizer="adam", loss=pxp.NegativeLogLikelihood(head))
  before = _mean_nll(model, head, x, y)
  history = model.fit(
      x, y, batch_size=batch, epochs=4, verbose=0, sampling_seed=5,
      callbacks=[dpk.PrivacyCallback(num_examples=n, batch_size=batch,
                                     delta=1e-5)])
  eps = history.history["epsilon"]
  assert all(math.isfinite(e) and e > 0 for e in eps)
  assert eps == sorted(eps)
  after = _mean_nll(model, head, x, y)
  assert math.isfinite(after) and after < before, (before, after)


@pytest.mark.parametrize("name", HEADS)
def test_save_and_load(name, tmp_path):
  head = HEADS[name]()
  x, y = _data(name, n=32)
  keras.utils.set_random_seed(0)
  model = dpk.DPModel(*_layers(head, "float32"), l2_norm_clip=1.0,
                      noise_multiplier=0.5, seed=2)
  model.compile(optimizer="sgd", loss=pxp.NegativeLogLikelihood(head))
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  path = str(tmp_path / "head.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  loaded_head = loaded.loss.head
  assert type(loaded_head) is type(head)
  assert loaded_head.get_config() == head.get_config()
  p = model.predict(x, verbose=0)
  np.testing.assert_allclose(loaded.predict(x, verbose=0), p, rtol=1e-6)
  np.testing.assert_allclose(loaded.loss.call(y, p),
                             model.loss.call(y, p), rtol=1e-6)
  loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # Trains on.


def test_censored_weibull_likelihood_is_density_or_survival():
  """Closed forms: observed -> log f(t), censored -> -(t / scale)^k."""
  head = pxp.CensoredWeibull()
  params = np.array([[0.3, -0.2], [1.1, 0.4]], "float64")
  y = np.array([[0.7, 1.0], [1.5, 0.0]], "float64")
  k = np.log1p(np.exp(params[:, 0])) + head.min_scale
  lam = np.log1p(np.exp(params[:, 1])) + head.min_scale
  t = y[:, 0]
  log_f = (np.log(k / lam) + (k - 1) * np.log(t / lam) - (t / lam) ** k)
  log_s = -(t / lam) ** k
  expected = np.where(y[:, 1] == 1, log_f, log_s)
  np.testing.assert_allclose(head.log_likelihood(y, params), expected,
                             rtol=1e-9)


@keras.saving.register_keras_serializable(package="test_probability")
def _laplace(params):
  return tfp.distributions.Laplace(params[:, 0],
                                   tf.nn.softplus(params[:, 1]) + 1e-3)


def test_a_distribution_making_function_is_a_head(tmp_path):
  x, y = _data("Normal", n=B)
  model = _plain_model(pxp.Normal())
  loss = pxp.NegativeLogLikelihood(_laplace)
  err = pxg_testing.check_per_example_gradients(
      loss.call, model, model.trainable_variables, x, labels=y, mode="jit")
  assert err <= 1e-4
  dp = dpk.DPModel(*_layers(pxp.Normal(), "float32"), l2_norm_clip=1.0,
                   noise_multiplier=0.5)
  dp.compile(optimizer="sgd", loss=loss)
  dp.fit(x, y, batch_size=3, epochs=1, verbose=0)
  dp.save(str(tmp_path / "f.keras"))
  assert keras.models.load_model(str(tmp_path / "f.keras")).loss.head is (
      _laplace)


def test_plan_parts_sampler_clipping_accumulation_xla():
  """StudentT (lbeta) with balls-in-bins batches, automatic clipping,
  accumulation over 2 physical batches and XLA: trains, finite, ε."""
  from tf_pxg.data.balls_in_bins import BallsInBinsSampler  # pylint: disable=g-import-not-at-top
  head = pxp.StudentT()
  n = 256
  x, y = _synthetic("StudentT", n)
  keras.utils.set_random_seed(0)
  model = dpk.DPModel(*_layers(head, "float32"), l2_norm_clip=1.0,
                      noise_multiplier=1.0, seed=4,
                      clipping=tf_pxg.clipping.Automatic())
  model.compile(optimizer="adam", loss=pxp.NegativeLogLikelihood(head),
                jit_compile=True)
  history = model.fit(x, y, batch_size=32, epochs=2, verbose=0,
                      sampling=BallsInBinsSampler, sampling_seed=1,
                      accumulation_steps=2,
                      callbacks=[dpk.PrivacyCallback(n, 32, delta=1e-5)])
  assert all(math.isfinite(e) for e in history.history["epsilon"])
  assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
  assert int(model.optimizer.iterations) > 0


_MIRRORED = textwrap.dedent("""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    {mirrored}
    import keras
    import tf_pxg.keras as dpk
    import tf_pxg.probability as pxp
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.poisson(3.0, size=(8, 1)).astype("float32")
    def build():
      keras.utils.set_random_seed(1)
      inp = keras.Input((4,))
      out = keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(inp))
      model = dpk.DPModel(inp, out, l2_norm_clip=0.3, noise_multiplier=0.0)
      model.compile(optimizer=keras.optimizers.SGD(0.5),
                    loss=pxp.NegativeLogLikelihood(pxp.NegativeBinomial()),
                    jit_compile=False)
      return model
    model = build()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffled",
              shuffle=False)
    single = [v.numpy().tolist() for v in model.trainable_variables]
    with strategy.scope():
      model = build()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling="shuffled",
              shuffle=False)
    mirrored = [v.numpy().tolist() for v in model.trainable_variables]
    print("RESULT " + json.dumps({{"single": single, "mirrored": mirrored}}))
""")


def test_mirrored_strategy_step_equals_the_single_device_step():
  import _multi_worker as multi_worker  # pylint: disable=g-import-not-at-top
  code = _MIRRORED.format(mirrored=multi_worker.MIRRORED_TWO_CPUS)
  out = multi_worker.run_script(code, timeout=300)
  for a, b in zip(out["single"], out["mirrored"]):
    np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4,
                               atol=1e-6)
