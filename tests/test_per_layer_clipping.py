"""Per-layer (group-wise) clipping (`tf_pxg.clipping.PerLayer`).

References: per-example gradients from a plain `tf.GradientTape` loop over
single examples, split by group, scaled by `min(1, C_g / ||g_{b,g}||)`;
the noise std per group against its closed form (isotropic `sigma C`,
per-group `sigma C_g sqrt(G)`) and the one-Gaussian identity
`sum_g C_g^2 / sigma_g^2 = 1 / sigma^2` against dp_accounting.
"""

import math

from _keras_models import reference_grads_by_example as _reference_grads
import _multi_worker as multi_worker
import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg
import tf_pxg.keras as dpk

clipping = tf_pxg.clipping


def _models(dtype):
  keras.utils.set_random_seed(1)
  dense = keras.Sequential([keras.Input((6,), dtype=dtype),
                            keras.layers.Dense(4, activation="tanh",
                                               dtype=dtype, name="hidden"),
                            keras.layers.Dense(3, dtype=dtype, name="head")])
  conv = keras.Sequential([keras.Input((6, 6, 2), dtype=dtype),
                           keras.layers.Conv2D(3, 3, activation="relu",
                                               dtype=dtype, name="conv"),
                           keras.layers.Flatten(dtype=dtype),
                           keras.layers.Dense(3, dtype=dtype, name="head")])
  return {"dense": (dense, (6,)), "conv": (conv, (6, 6, 2))}


def _expected(ref, index, bounds):
  """Per source: sum_b min(1, C_g / ||g_{b,g}||) g_b; and [G, B] norms."""
  groups = max(index) + 1
  norms = np.array([[math.sqrt(sum((gs[i] ** 2).sum()
                                   for i in range(len(gs)) if index[i] == g))
                     for gs in ref] for g in range(groups)])
  fac = np.minimum(1.0, np.asarray(bounds)[:, None] /
                   np.maximum(norms, 1e-12))
  want = [sum(fac[index[i], b] * gs[i] for b, gs in enumerate(ref))
          for i in range(len(ref[0]))]
  return want, norms


def _loss(t, p):
  return tf.reduce_sum(tf.square(p - t), axis=-1)


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("arch", ["dense", "conv"])
def test_per_layer_clipped_sum_is_exact(mode, dtype, batch, arch):
  model, shape = _models(dtype)[arch]
  rng = np.random.default_rng(batch)
  x = rng.standard_normal((batch,) + shape).astype(dtype)
  y = rng.standard_normal((batch, 3)).astype(dtype)
  first = "hidden" if arch == "dense" else "conv"
  policy = clipping.PerLayer(bounds={first: 2.0, "head": 1.0})
  clip = 0.6

  def run(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = _loss(y, model(x))
    return tape.clipped_gradient_sum(losses, model.trainable_variables, clip,
                                     clipping=policy)

  fn = {"eager": run, "function": tf.function(run),
        "xla": tf.function(run, jit_compile=True)}[mode]
  sums, norms = fn(tf.constant(x), tf.constant(y))
  ref = _reference_grads(model, x, y, lambda t, p: tf.reduce_sum(_loss(t, p)))
  bounds = [clip * 2 / math.sqrt(5), clip * 1 / math.sqrt(5)]
  want, group_norms = _expected(ref, [0, 0, 1, 1], bounds)
  tol = 1e-4 if dtype == "float32" else 1e-6
  np.testing.assert_allclose(norms.numpy(),
                             np.sqrt((group_norms ** 2).sum(0)), rtol=tol)
  assert (group_norms > np.asarray(bounds)[:, None]).any()  # some clipped
  for got, w in zip(sums, want):
    scale = max(float(np.abs(w).max()), 1e-30)
    np.testing.assert_allclose(got.numpy(), w, rtol=0, atol=tol * scale)
  # Each group's clipped contribution is within C_g; the total within C.
  assert math.isclose(math.sqrt(sum(c * c for c in bounds)), clip)


@pytest.mark.parametrize("groups", ["variable", "callable"])
def test_variable_and_function_groups(groups):
  model, _ = _models("float32")["dense"]
  rng = np.random.default_rng(3)
  x = rng.standard_normal((6, 6)).astype("float32")
  y = rng.standard_normal((6, 3)).astype("float32")
  if groups == "variable":
    policy, index = clipping.PerLayer("variable"), [0, 1, 2, 3]
  else:  # kernels together, biases together
    policy = clipping.PerLayer(lambda v: v.path.rsplit("/", 1)[1])
    index = [0, 1, 0, 1]

  @tf.function
  def run(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = _loss(y, model(x))
    return tape.clipped_gradient_sum(losses, model.trainable_variables, 0.4,
                                     clipping=policy)

  sums, _ = run(x, y)
  ref = _reference_grads(model, x, y, lambda t, p: tf.reduce_sum(_loss(t, p)))
  g = max(index) + 1
  want, _ = _expected(ref, index, [0.4 / math.sqrt(g)] * g)
  for got, w in zip(sums, want):
    np.testing.assert_allclose(got.numpy(), w, rtol=0,
                               atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("jit", [False, True])
def test_parameter_shared_across_groups_is_materialised(jit):
  """W = A + B with A and B in different groups, and a NaN example: the
  sum over W's interface cannot take one factor for both."""
  rng = np.random.default_rng(0)
  a = tf.Variable(rng.standard_normal((4, 3)).astype("float32"), name="a")
  b = tf.Variable(rng.standard_normal((4, 3)).astype("float32"), name="b")
  c = tf.Variable(rng.standard_normal((3,)).astype("float32"), name="c")
  x = rng.standard_normal((5, 4)).astype("float32")
  x[2, 1] = np.nan
  policy = clipping.PerLayer("variable", noise_allocation="per_group")

  def loss(x):
    return tf.reduce_sum(tf.tanh(x @ (a + b) + c) ** 2, axis=-1)

  @tf.function(jit_compile=jit)
  def run(x):
    with tf_pxg.GradientTape() as tape:
      losses = loss(x)
    return tape.clipped_gradient_sum(losses, [a, b, c], 0.9,
                                     clipping=policy)

  sums, norms = run(x)
  ref = []
  for i in range(5):
    with tf.GradientTape() as tape:
      l = tf.reduce_sum(loss(x[i:i + 1]))
    ref.append([g.numpy().astype(np.float64)
                for g in tape.gradient(l, [a, b, c])])
  keep = [i for i in range(5) if i != 2]
  want, _ = _expected([ref[i] for i in keep], [0, 1, 2],
                      [0.9 / math.sqrt(3)] * 3)
  assert not np.isfinite(norms.numpy()[2])
  for got, w in zip(sums, want):
    assert np.all(np.isfinite(got.numpy()))
    np.testing.assert_allclose(got.numpy(), w, rtol=0, atol=1e-5)


@keras.saving.register_keras_serializable(package="test_per_layer")
def by_kind(variable):
  return variable.path.rsplit("/", 1)[-1]


def _zero_model(allocation, bounds, sigma, clip, seed=4):
  inp = keras.Input((10,))
  h = keras.layers.Dense(2000, use_bias=False, kernel_initializer="zeros",
                         name="one")(inp)
  out = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros",
                           name="two")(h)
  model = dpk.DPModel(inp, out, seed=seed, l2_norm_clip=clip,
                      noise_multiplier=sigma, clipping=clipping.PerLayer(
                          bounds=bounds, noise_allocation=allocation))
  model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse",
                jit_compile=False)
  return model


# ids without "per_group": conftest skips node ids holding it (grouped
# convolutions on CPU).
@pytest.mark.parametrize("allocation", ["isotropic", "per_group"],
                         ids=["isotropic", "proportional"])
def test_noise_std_of_each_group_is_the_closed_form(allocation):
  sigma, clip, batch = 1.3, 0.5, 16
  bounds = {"one": 3.0, "two": 1.0}
  model = _zero_model(allocation, bounds, sigma, clip)
  model.train_on_batch(np.zeros((batch, 10), "float32"),
                       np.zeros((batch, 1), "float32"))
  # Zero gradients: each weight moves by -lr * noise / batch.
  stds = [float(np.std(v.numpy())) * batch
          for v in model.trainable_variables]
  c_g = [clip * 3 / math.sqrt(10), clip * 1 / math.sqrt(10)]
  if allocation == "isotropic":
    want = [sigma * clip] * 2
  else:
    want = [sigma * c * math.sqrt(2) for c in c_g]
  # 20000 and 2000 draws: 2% and 5% are > 4 standard errors.
  assert stds[0] == pytest.approx(want[0], rel=0.02)
  assert stds[1] == pytest.approx(want[1], rel=0.07)
  # The split is one Gaussian mechanism of multiplier sigma:
  # sum_g C_g^2 / sigma_g^2 = 1 / sigma^2 for either allocation.
  sig_g = want
  assert sum(c * c / (s * s) for c, s in zip(c_g, sig_g)) == pytest.approx(
      sigma ** -2, rel=1e-12)
  # ... which dp_accounting agrees with: the groups' Gaussians (each in
  # units of its sensitivity, multiplier sigma_g / C_g) compose to sigma.
  parts = dp_accounting.rdp.RdpAccountant()
  parts.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(s / c) for c, s in zip(c_g, sig_g)]))
  one = dp_accounting.rdp.RdpAccountant()
  one.compose(dp_accounting.GaussianDpEvent(sigma))
  assert parts.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5),
                                                  rel=1e-9)
  assert clipping.PerLayer(bounds=bounds, noise_allocation=allocation
                           ).noise_scales(model.trainable_variables) == (
      None if allocation == "isotropic" else pytest.approx(
          [math.sqrt(10) / (3 * math.sqrt(2)),
           math.sqrt(10) / (1 * math.sqrt(2))]))


def _dense_dp(policy, **kw):
  keras.utils.set_random_seed(2)
  model = dpk.DPSequential([keras.Input((3,)),
                            keras.layers.Dense(4, activation="tanh",
                                               name="hidden"),
                            keras.layers.Dense(2, name="head")],
                           l2_norm_clip=0.3, clipping=policy, **kw)
  return model


def test_keras_step_equals_reference_and_make_private():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 3)).astype("float32")
  y = rng.standard_normal((16, 2)).astype("float32")
  keras.utils.set_random_seed(2)
  base = keras.Sequential([keras.Input((3,)),
                           keras.layers.Dense(4, activation="tanh"),
                           keras.layers.Dense(2)])
  model = dpk.make_private(base, l2_norm_clip=0.3, noise_multiplier=0.0,
                           clipping=clipping.PerLayer())
  model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
  before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
  ref = _reference_grads(model, x, y, lambda t, p: tf.reduce_mean(
      tf.square(p - t)))
  want, _ = _expected(ref, [0, 0, 1, 1], [0.3 / math.sqrt(2)] * 2)
  model.train_on_batch(x, y)
  for v, b, w in zip(model.trainable_variables, before, want):
    np.testing.assert_allclose(v.numpy(), b - 0.5 * w / 16, rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_accumulation_and_xla_give_the_one_batch_step(jit):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((96, 3)).astype("float32")
  y = rng.standard_normal((96, 2)).astype("float32")

  def run(k, jit):
    model = _dense_dp(clipping.PerLayer(bounds={"hidden": 1.0,
                                                "head": 2.0}),
                      noise_multiplier=0.0)
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="mse",
                  jit_compile=jit)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, sampling_seed=9,
              accumulation_steps=k, physical_batch_size=48 // k)
    return model

  ref, got = run(1, False), run(2, jit)
  assert int(got.optimizer.iterations) == int(ref.optimizer.iterations)
  for a, b in zip(got.trainable_variables, ref.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-5)


def test_saved_and_loaded(tmp_path):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((32, 3)).astype("float32")
  y = rng.standard_normal((32, 2)).astype("float32")
  policy = clipping.PerLayer(by_kind, bounds={"kernel": 2.0, "bias": 0.5},
                             noise_allocation="per_group")
  model = _dense_dp(policy, noise_multiplier=0.5)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  model.fit(x, y, batch_size=8, verbose=0)
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.clipping == policy
  assert loaded.clipping.groups is by_kind
  loaded.fit(x, y, batch_size=8, verbose=0)  # and trains on
  assert clipping.get(clipping.serialize(policy)) == policy
  assert clipping.get("per_layer") == clipping.PerLayer()
  hash(policy)


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match="groups"):
    clipping.PerLayer("neuron")
  with pytest.raises(ValueError, match="finite and > 0"):
    clipping.PerLayer(bounds={"dense": 0.0})
  with pytest.raises(ValueError, match="noise_allocation"):
    clipping.PerLayer(noise_allocation="uniform")
  with pytest.raises(ValueError, match="isotropic"):
    clipping.PerLayer(bounds={"a": 1.0}, target_quantile=0.5,
                      noise_allocation="per_group")
  with pytest.raises(ValueError, match="naming"):
    clipping.PerLayer(target_quantile=0.5)
  model = _dense_dp(clipping.PerLayer(bounds={"hidden": 1.0}),
                    noise_multiplier=0.0)
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  with pytest.raises(ValueError, match="no bound for the group"):
    model.train_on_batch(np.ones((4, 3), "float32"),
                         np.zeros((4, 2), "float32"))


def _graph_ops(fn, *args) -> dict:
  graph = fn.get_concrete_function(*args).graph
  out = {}
  for op in graph.get_operations():
    out[op.type] = out.get(op.type, 0) + 1
  return out


def test_flat_program_has_no_group_ops():
  """Flat clipping takes none of the grouped path (no stack of group
  norms, no unstack of factors); one group equals flat clipping."""
  model, _ = _models("float32")["dense"]
  x = tf.constant(np.ones((4, 6), "float32"))
  y = tf.constant(np.zeros((4, 3), "float32"))

  def make(policy):
    @tf.function
    def run(x, y):
      with tf_pxg.GradientTape() as tape:
        losses = _loss(y, model(x))
      return tape.clipped_gradient_sum(losses, model.trainable_variables,
                                       0.5, clipping=policy)
    return run

  flat = _graph_ops(make(None), x, y)
  grouped = _graph_ops(make(clipping.PerLayer()), x, y)
  assert grouped.get("Unpack", 0) == flat.get("Unpack", 0) + 1
  one = clipping.PerLayer(lambda v: "all")
  (s1, n1), (s2, n2) = make(one)(x, y), make(None)(x, y)
  np.testing.assert_allclose(n1.numpy(), n2.numpy(), rtol=1e-6)
  for a, b in zip(s1, s2):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


_MIRRORED_MODEL = (
    "dpk.DPSequential([keras.Input((3,)), keras.layers.Dense(4, "
    "activation='tanh', name='hidden'), keras.layers.Dense(2, name='head')],"
    " l2_norm_clip=0.2, noise_multiplier=0.0, "
    "clipping=tf_pxg.clipping.PerLayer(bounds={'hidden': 1.0, 'head': 3.0},"
    " **POLICY))")


@pytest.mark.parametrize("policy", [
    "dict(noise_allocation='per_group')",
    # The automatic bounds: each group's count summed over the replicas.
    "dict(target_quantile=0.5, count_stddev=0.0)"], ids=["fixed", "auto"])
def test_mirrored_strategy_equals_one_device(policy):
  result = multi_worker.run_script(multi_worker.one_vs_mirrored_fit(
      _MIRRORED_MODEL.replace("POLICY", policy)), timeout=240)
  (_, w1), (_, w2) = result["one"], result["two"]
  for a, b in zip(w1, w2):
    np.testing.assert_allclose(np.array(b), np.array(a), rtol=0, atol=1e-5)


# Adaptive bounds --------------------------------------------------------


@keras.saving.register_keras_serializable(package="test_per_layer")
def sum_loss(y_true, y_pred):
  del y_true
  return tf.reduce_sum(y_pred, axis=-1)


def _two_group_model(policy, lr=0.0, **kw):
  """Loss = a . x[:3] + b . x[3:]: example b's group gradients are x[:3]
  and x[3:], whatever the weights."""
  inp = keras.Input((6,))
  left = keras.layers.Dense(1, use_bias=False, name="a")(inp[:, :3])
  right = keras.layers.Dense(1, use_bias=False, name="b")(inp[:, 3:])
  model = dpk.DPModel(inp, left + right, clipping=policy, **kw)
  model.compile(optimizer=keras.optimizers.SGD(lr), loss=sum_loss)
  return model


def _radial(rng, n, top):
  radius = rng.uniform(0.0, top, n)
  direction = rng.standard_normal((n, 3))
  direction /= np.linalg.norm(direction, axis=1, keepdims=True)
  return radius, radius[:, None] * direction


def test_adaptive_bounds_track_each_groups_quantile():
  rng = np.random.default_rng(0)
  n = 4000
  ra, xa = _radial(rng, n, 1.0)   # group a: norms ~ U(0, 1)
  rb, xb = _radial(rng, n, 10.0)  # group b: norms ~ U(0, 10)
  x = np.concatenate([xa, xb], 1).astype("float32")
  policy = clipping.PerLayer(bounds={"a": 1.0, "b": 1.0},
                             target_quantile=0.7, learning_rate=0.2,
                             count_stddev=0.0)
  model = _two_group_model(policy, l2_norm_clip=2.0, noise_multiplier=0.0)
  hist = model.fit(x, np.zeros((n, 1), "float32"), batch_size=200,
                   epochs=12, verbose=0, sampling_seed=3)
  state = model.optimizer.dp_state.releases
  sa, sb = float(state["clip_a"].numpy()), float(state["clip_b"].numpy())
  assert sa == pytest.approx(np.quantile(ra, 0.7), rel=0.12)
  assert sb == pytest.approx(np.quantile(rb, 0.7), rel=0.12)
  assert hist.history["clip_b"][-1] == pytest.approx(sb)
  # The bounds in use: C s_g / ||s||, so their ratio is the quantiles'.
  bounds = policy.group_bounds(["a", "b"], 2.0, [sa, sb]).numpy()
  assert math.sqrt((bounds ** 2).sum()) == pytest.approx(2.0, rel=1e-6)
  assert bounds[1] / bounds[0] == pytest.approx(sb / sa, rel=1e-5)


def test_adaptive_counts_take_their_share_of_sigma():
  sigma, std = 1.0, 3.0
  policy = clipping.PerLayer(bounds={"a": 1.0, "b": 2.0},
                             target_quantile=0.5, count_stddev=std)
  model = _two_group_model(policy, l2_norm_clip=1.0,
                           noise_multiplier=sigma)
  noise = model.optimizer.plan.step_noise(None)
  assert len(noise.releases) == 2
  sigma_g = (sigma ** -2 - 2 * (2 * std) ** -2) ** -0.5
  assert noise.gradient == pytest.approx(sigma_g, rel=1e-12)
  # One Gaussian: gradient (sigma_g) and the two counts (2 std each).
  parts = dp_accounting.rdp.RdpAccountant()
  parts.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(sigma_g),
      dp_accounting.GaussianDpEvent(2 * std),
      dp_accounting.GaussianDpEvent(2 * std)]))
  one = dp_accounting.rdp.RdpAccountant()
  one.compose(dp_accounting.GaussianDpEvent(sigma))
  assert parts.get_epsilon(1e-5) == pytest.approx(one.get_epsilon(1e-5),
                                                  rel=1e-9)
  with pytest.raises(ValueError, match="whole"):
    clipped = clipping.PerLayer(bounds={"a": 1.0, "b": 2.0},
                                target_quantile=0.5, count_stddev=0.6)
    _two_group_model(clipped, l2_norm_clip=1.0,
                     noise_multiplier=1.0).optimizer.plan.step_noise(None)


def test_adaptive_bounds_are_saved(tmp_path):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 6)).astype("float32")
  policy = clipping.PerLayer(bounds={"a": 1.0, "b": 1.0},
                             target_quantile=0.5, count_stddev=0.0)
  model = _two_group_model(policy, l2_norm_clip=5.0, noise_multiplier=0.0)
  model.fit(x, np.zeros((64, 1), "float32"), batch_size=16, verbose=0)
  before = {k: float(v.numpy())
            for k, v in model.optimizer.dp_state.releases.items()}
  assert before["clip_a"] != pytest.approx(5.0 / math.sqrt(2))
  path = str(tmp_path / "m.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert loaded.clipping == policy
  after = {k: float(v.numpy())
           for k, v in loaded.optimizer.dp_state.releases.items()}
  assert after == pytest.approx(before)


@pytest.mark.parametrize("jit", [False, True])
def test_adaptive_bounds_with_accumulation_and_xla(jit):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((96, 6)).astype("float32")

  def run(k, jit):
    keras.utils.set_random_seed(2)
    policy = clipping.PerLayer(bounds={"a": 1.0, "b": 1.0},
                               target_quantile=0.5, count_stddev=0.0)
    model = _two_group_model(policy, lr=0.1, l2_norm_clip=0.5,
                             noise_multiplier=0.0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=sum_loss,
                  jit_compile=jit)
    model.fit(x, np.zeros((96, 1), "float32"), batch_size=16, epochs=2,
              verbose=0, sampling_seed=9, accumulation_steps=k,
              physical_batch_size=48 // k)
    return model

  ref, got = run(1, False), run(2, jit)
  for a, b in zip(got.trainable_variables, ref.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-5)
  for k, v in ref.optimizer.dp_state.releases.items():
    assert float(got.optimizer.dp_state.releases[k].numpy()) == (
        pytest.approx(float(v.numpy()), rel=1e-5))
    assert float(v.numpy()) != pytest.approx(0.5 / math.sqrt(2))
