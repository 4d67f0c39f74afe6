"""Privacy units larger than one row: augmentation multiplicity, users.

Exactness (sigma = 0, SGD(1), q = 1, a clip active for some units and not
others): one logical step of `fit(augmult=K)` / `fit(user_ids=...,
examples_per_user=k)` moves the weights by `-(1/B) sum_u clip(mean_{rows
of u} g_row)`, computed here with a plain `tf.GradientTape` per unit; in
eager, tf.function and XLA, with accumulation_steps=2, and under
MirroredStrategy on 2 logical CPUs (the suite's shared subprocess,
tests/_multi_worker.py). The user sampler's law:
users per step ~ Binomial(U, q), at most k examples per user, every example
reachable. User-level ε equals dp_accounting's Poisson-subsampled Gaussian
at rate B/U.
"""

import math

import _multi_worker as multi_worker
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.keras as dpk
from tf_pxg import data as dpd
from tf_pxg import testing as pxg_testing


class CopyScale(keras.layers.Layer):
  """A deterministic per-copy transform: row r scaled by 1 + (r mod K)/2.

  The K copies of an example are rows `[p K, (p + 1) K)` of the physical
  batch (and of every replica's slice), so copy j gets scale 1 + j/2.
  """

  def __init__(self, k, **kwargs):
    super().__init__(**kwargs)
    self.k = k

  def call(self, x):
    j = tf.range(tf.shape(x)[0]) % self.k
    return x * (1.0 + 0.5 * tf.cast(j, x.dtype))[:, None]

  def compute_output_shape(self, shape):
    return shape


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(clip, copies=None, strategy=None, mode="function"):
  scope = strategy.scope() if strategy is not None else _null()
  with scope:
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    h = inp if copies is None else CopyScale(copies)(inp)
    h = keras.layers.Dense(7, activation="tanh")(h)
    out = keras.layers.Dense(3)(h)
    model = dpk.DPModel(inp, out, l2_norm_clip=clip, noise_multiplier=0.0,
                        seed=5)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=_sce(),
                  run_eagerly=(mode == "eager"),
                  jit_compile=(mode == "xla"))
  return model


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def _unit_grads(model, units):
  """Per unit: the gradient of the mean loss over its rows (`(x, y)`)."""
  out = []
  for x, y in units:
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
          y, model(x, training=True), from_logits=True))
    out.append([g.numpy() for g in tape.gradient(
        loss, model.trainable_variables)])
  return out


def _norm(g):
  return math.sqrt(sum(float(np.sum(t * t)) for t in g))


def _reference(model, units, clip, normalizer):
  total = None
  for g in _unit_grads(model, units):
    c = min(1.0, clip / _norm(g))
    g = [c * t for t in g]
    total = g if total is None else [a + t for a, t in zip(total, g)]
  return [-t / normalizer for t in total]


def _median_clip(units, copies=None):
  norms = [_norm(g) for g in _unit_grads(_mlp(1.0, copies), units)]
  clip = float(np.median(norms))
  assert min(norms) < clip < max(norms)  # active for some, not others
  return clip


def _delta(model, before):
  return [w.numpy() - b for w, b in zip(model.trainable_variables, before)]


def _rel_error(got, want):
  scale = max(np.abs(w).max() for w in want)
  return float(max(np.abs(g - w).max() for g, w in zip(got, want)) / scale)


def _data(n=6, seed=1):
  rng = np.random.RandomState(seed)
  return ((rng.randn(n, 5) * 2).astype("float32"),
          rng.randint(0, 3, n).astype("int32"))


_USER_SIZES = (1, 2, 7)


def _user_data():
  x, y = _data(sum(_USER_SIZES), seed=3)
  ids = np.repeat(np.array([10, 20, 30]), _USER_SIZES)
  perm = np.random.RandomState(0).permutation(len(ids))  # interleaved rows
  return x[perm], y[perm], ids[perm]


def run_case(case, mode="function", accumulation=1, strategy=None):
  """Returns (relative error of the step vs the reference, iterations)."""
  physical = None if accumulation == 1 else 4
  if case in ("augmult_identical", "augmult_copies"):
    k = 3
    x, y = _data()
    copies = k if case == "augmult_copies" else None
    units = [(np.repeat(x[i:i + 1], k, 0), np.repeat(y[i:i + 1], k, 0))
             for i in range(len(y))]
    clip = _median_clip(units, copies)
    model = _mlp(clip, copies, strategy, mode)
    want = _reference(model, units, clip, len(y))
    before = [w.numpy() for w in model.trainable_variables]
    model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, augmult=k,
              sampling_seed=0, accumulation_steps=accumulation,
              physical_batch_size=physical)
    err = _rel_error(_delta(model, before), want)
    if case == "augmult_identical":
      # Identical copies: the K = 1 step.
      one = _mlp(clip, None, strategy, mode)
      one.fit(x, y, batch_size=len(y), epochs=1, verbose=0, sampling_seed=0,
              accumulation_steps=accumulation, physical_batch_size=physical)
      err = max(err, _rel_error(_delta(one, before), want))
    return err, int(model.optimizer.iterations.numpy())
  assert case == "users"
  x, y, ids = _user_data()
  units = [(x[ids == u], y[ids == u]) for u in (10, 20, 30)]
  clip = _median_clip(units)
  model = _mlp(clip, None, strategy, mode)
  want = _reference(model, units, clip, 3)
  before = [w.numpy() for w in model.trainable_variables]
  model.fit(x, y, batch_size=3, epochs=1, verbose=0, user_ids=ids,
            examples_per_user=7, sampling_seed=0,
            accumulation_steps=accumulation,
            physical_batch_size=None if accumulation == 1 else 2)
  return (_rel_error(_delta(model, before), want),
          int(model.optimizer.iterations.numpy()))


_CASES = ("augmult_identical", "augmult_copies", "users")


def run_loop(case, strategy, jit=True):
  """`run_case` as a custom loop: `tf_pxg.data` input through
  `for_input_pipeline`, the replica-local `dp_gradients` compiled with XLA
  per replica, `dp_apply` in replica context (as
  tests/test_distribute_poisson.py does; `fit(jit_compile=True)` cannot
  compile MirroredStrategy's merge_call on CPU)."""
  r = strategy.num_replicas_in_sync
  if case == "augmult_copies":
    k = 3
    x, y = _data()
    units = [(np.repeat(x[i:i + 1], k, 0), np.repeat(y[i:i + 1], k, 0))
             for i in range(len(y))]
    clip = _median_clip(units, k)
    model = _mlp(clip, k, strategy)
    sampler = dpd.PoissonSampler(len(y), len(y), num_replicas=r, seed=0,
                                 steps_per_epoch=1)
    dataset = dpd.poisson_dataset(sampler, x, y, augmult=k)
    normalizer = len(y)
  else:
    x, y, ids = _user_data()
    units = [(x[ids == u], y[ids == u]) for u in (10, 20, 30)]
    clip = _median_clip(units)
    model = _mlp(clip, None, strategy)
    sampler = dpd.PoissonSampler(3, 3, num_replicas=r, seed=0,
                                 steps_per_epoch=1)
    dataset = dpd.poisson_dataset(sampler, x, y, user_ids=ids,
                                  examples_per_user=7)
    normalizer = 3
  with strategy.scope():
    model.optimizer.build(model.trainable_variables)
    model.build_accumulator()
  want = _reference(model, units, clip, normalizer)
  before = [w.numpy() for w in model.trainable_variables]
  dist = strategy.distribute_datasets_from_function(
      lambda ctx: dpd.for_input_pipeline(dataset, ctx))
  # Without autograph, as Keras traces fit's step (and `traced_step` the
  # DP step): autograph would convert tf_pxg's whole gradient path, once
  # per process (~30 s of this test's subprocess); a Python branch on a
  # tensor there is then an error, not a silent tf.cond. DP steps traced
  # with autograph: tests/test_xla_step.py, tests/test_weights_ledger.py
  # and the multi-worker example (tests/test_distribute_poisson.py).
  grads = tf.function(model.dp_gradients, jit_compile=jit, autograph=False)

  @tf.function(autograph=False)
  def step(b):
    strategy.run(lambda d: model.dp_apply(grads(d)), args=(b,))

  for b in dist:
    step(b)
  return (_rel_error(_delta(model, before), want),
          int(model.optimizer.iterations.numpy()))


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("case", _CASES)
def test_one_step_equals_mean_then_clip(case, mode):
  err, iterations = run_case(case, mode)
  assert iterations == 1
  assert err < 1e-5


@pytest.mark.parametrize("case", _CASES)
def test_one_step_with_accumulation(case):
  err, iterations = run_case(case, "function", accumulation=2)
  assert iterations == 1
  assert err < 1e-5


# Run by tests/_multi_worker.py's shared MirroredStrategy process (2
# logical CPUs, `strategy`; see `mirrored_results`).
MIRRORED_CASES = """
import test_privacy_units as t
cases = {case: (lambda case=case: t.run_case(case, "function", accumulation=1,
                                             strategy=strategy))
         for case in t._CASES}
cases["users_acc"] = lambda: t.run_case("users", "function", accumulation=2,
                                        strategy=strategy)
for case in ("augmult_copies", "users"):
  cases[case + "_xla_loop"] = (
      lambda case=case: t.run_loop(case, strategy, jit=True))
scenarios(**cases)
"""

_MIRRORED_NAMES = _CASES + ("users_acc", "augmult_copies_xla_loop",
                            "users_xla_loop")


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


def test_one_step_under_mirrored_strategy(mirrored):
  """fit (tf.function) for every case, with accumulation for users, and a
  custom loop with the replica step compiled by XLA for augmult and users."""
  for case in _MIRRORED_NAMES:
    err, iterations = multi_worker.scenario(mirrored, case)
    assert iterations == 1, case
    assert err < 1e-5, (case, err)


def test_group_norms_come_from_one_backward_pass_ghost_forms():
  """K = 4 rows per example, as fit(augmult=4) lays them out: the dense
  layers' norms come in the ghost form over each example's 4 rows (cross
  terms included), the bias's from the per-example (summed over rows)
  gradient; nothing runs per row (`per_example` form) or vectorised."""
  from tf_pxg.gradient_tape import GradientTape  # noqa: PLC0415
  inp = keras.Input((64,))
  out = keras.layers.Dense(64)(keras.layers.Dense(64, activation="tanh")(inp))
  model = keras.Model(inp, out)
  rng = np.random.RandomState(0)
  x = rng.randn(32, 64).astype("float32")
  y = rng.randint(0, 3, 32)
  with pxg_testing.trace_rules() as records:
    with GradientTape() as tape:
      losses = keras.losses.sparse_categorical_crossentropy(
          y, model(x), from_logits=True)
      unit = tf.reduce_mean(tf.reshape(losses, [8, 4]), axis=1)
    tape.clipped_gradient_sum(unit, model.trainable_variables, 0.5)
  forms = {(r["op_type"], r["form"], r.get("sq_norm")) for r in records}
  assert {f[2] for f in forms if f[:2] == ("MatMul", "sq_norm")} == {
      "ghost"}, forms
  assert not any(r["form"] == "per_example" for r in records), forms


# The user sampler's law ------------------------------------------------------


def _user_stream(steps, k=3, q=0.2, seed=0):
  rng = np.random.RandomState(4)
  sizes = rng.randint(1, 15, size=40)
  sizes[:3] = (1, 2, 14)
  ids = np.repeat(np.arange(len(sizes)) * 7 + 1, sizes)  # non-contiguous ids
  perm = rng.permutation(len(ids))
  ids = ids[perm]
  n = len(ids)
  x = np.arange(n, dtype=np.int64)  # x is the row's own index
  u = len(sizes)
  sampler = dpd.PoissonSampler(u, q * u, physical_batch_size=24, seed=seed,
                               steps_per_epoch=steps)
  ds = dpd.poisson_dataset(sampler, x, np.zeros(n, np.int32), user_ids=ids,
                           examples_per_user=k)
  return ds, ids, sizes, u, q, k


def test_users_per_step_binomial_at_most_k_and_all_reachable():
  import test_sampling  # noqa: PLC0415
  steps = 2000
  ds, ids, sizes, u, q, k = _user_stream(steps)
  per_step, current = [], 0
  seen = {}
  for x, _, info in ds.as_numpy_iterator():
    mask = info[dpd.MASK]
    rows = x.reshape(len(mask), k)
    row_mask = info[dpd.ROW_MASK].reshape(len(mask), k)
    current += int(mask.sum())
    for p in np.nonzero(mask)[0]:
      chosen = rows[p][row_mask[p] > 0]
      users = set(ids[chosen])
      assert len(users) == 1  # one user's rows
      user = users.pop()
      count = int((ids == user).sum())
      assert len(chosen) == min(k, count) <= k
      assert len(set(chosen)) == len(chosen)  # without replacement
      seen.setdefault(user, set()).update(chosen.tolist())
    assert row_mask[mask == 0].sum() == 0
    if info[dpd.STEP_END][0] > 0.5:
      per_step.append(current)
      current = 0
  assert len(per_step) == steps
  test_sampling.check_binomial_sizes(np.array(per_step), u, q)
  # Every example of every user is reachable (seen within 2000 steps).
  for user in np.unique(ids):
    assert seen[user] == set(np.nonzero(ids == user)[0].tolist()), user


def test_user_ids_errors():
  x, y, ids = _user_data()
  model = _mlp(1.0)
  with pytest.raises(ValueError, match="one user id per example"):
    model.fit(x, y, batch_size=2, user_ids=ids[:-1], examples_per_user=2,
              verbose=0)
  with pytest.raises(ValueError, match="integers or strings"):
    model.fit(x, y, batch_size=2, user_ids=ids.astype(float),
              examples_per_user=2, verbose=0)
  with pytest.raises(ValueError, match="1-D"):
    model.fit(x, y, batch_size=2, user_ids=ids[:, None],
              examples_per_user=2, verbose=0)
  with pytest.raises(ValueError, match="examples_per_user"):
    model.fit(x, y, batch_size=2, user_ids=ids, verbose=0)
  with pytest.raises(ValueError, match="augmult"):
    model.fit(x, y, batch_size=2, augmult=0, verbose=0)
  with pytest.raises(ValueError, match="examples_per_user needs user_ids"):
    model.fit(x, y, batch_size=2, examples_per_user=2, verbose=0)


def test_string_user_ids_and_user_sizes_up_to_1000():
  rng = np.random.RandomState(0)
  sizes = np.array([1, 1000, 3, 250, 1, 40])
  ids = np.repeat(np.array([f"user{i}" for i in range(len(sizes))]), sizes)
  x = rng.randn(len(ids), 5).astype("float32")
  y = rng.randint(0, 3, len(ids)).astype("int32")
  model = _mlp(1.0)
  model.fit(x, y, batch_size=3, epochs=1, verbose=0, user_ids=ids,
            examples_per_user=8, sampling_seed=1)
  assert int(model.optimizer.iterations.numpy()) == 2  # ceil(U / B)


def test_user_level_epsilon_equals_dp_accounting_at_rate_b_over_u():
  import dp_accounting  # noqa: PLC0415
  u, b, sigma, steps, delta = 1000, 25, 1.1, 300, 1e-5
  cb = dpk.PrivacyCallback(num_users=u, batch_size=b, noise_multiplier=sigma,
                           delta=delta)
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          b / u, dp_accounting.GaussianDpEvent(sigma)), steps)
  acc = dp_accounting.rdp.RdpAccountant()
  acc.compose(event)
  want = acc.get_epsilon(delta)
  assert cb.epsilon(steps) == pytest.approx(want, rel=1e-6)
  assert cb.user_level and cb._log_key == "epsilon_user_level"


def test_privacy_callback_logs_user_level_key_and_checks_the_unit():
  x, y, ids = _user_data()
  model = _mlp(1.0)
  model.fit(x, y, batch_size=3, epochs=1, verbose=0, user_ids=ids,
            examples_per_user=2, sampling_seed=0, callbacks=[
                dpk.PrivacyCallback(num_users=3, batch_size=3)])
  hist = model.history.history
  assert "epsilon_user_level" in hist and "epsilon" not in hist
  with pytest.raises(ValueError, match="num_users"):
    model.fit(x, y, batch_size=3, epochs=1, verbose=0, user_ids=ids,
              examples_per_user=2, callbacks=[
                  dpk.PrivacyCallback(3, 3)])
  with pytest.raises(ValueError, match="sampled examples"):
    model.fit(x, y, batch_size=3, epochs=1, verbose=0, callbacks=[
        dpk.PrivacyCallback(num_users=3, batch_size=3)])
  with pytest.raises(ValueError, match="without num_examples"):
    dpk.PrivacyCallback(batch_size=3)


@pytest.mark.parametrize("case", ["augmult_copies", "users"])
def test_overflowed_step_is_finished_with_units(case):
  """A logical step that overflows its physical batch (q = 1, 2 units per
  physical batch) is completed after Keras' epoch by `finish`, which
  rebuilds the rest of the step with the same augmult / user layout."""
  if case == "users":
    x, y, ids = _user_data()
    units = [(x[ids == u], y[ids == u]) for u in (10, 20, 30)]
    clip = _median_clip(units)
    model = _mlp(clip)
    want = _reference(model, units, clip, 3)
    before = [w.numpy() for w in model.trainable_variables]
    model.fit(x, y, batch_size=3, epochs=1, verbose=0, user_ids=ids,
              examples_per_user=7, sampling_seed=0, physical_batch_size=2)
  else:
    x, y = _data()
    units = [(np.repeat(x[i:i + 1], 3, 0), np.repeat(y[i:i + 1], 3, 0))
             for i in range(len(y))]
    clip = _median_clip(units, 3)
    model = _mlp(clip, 3)
    want = _reference(model, units, clip, len(y))
    before = [w.numpy() for w in model.trainable_variables]
    model.fit(x, y, batch_size=len(y), epochs=1, verbose=0, augmult=3,
              sampling_seed=0, physical_batch_size=2)
  assert int(model.optimizer.iterations.numpy()) == 1
  assert _rel_error(_delta(model, before), want) < 1e-5


def test_users_with_augmult_copies_equal_mean_of_copy_means():
  """Users (sizes 1, 2, 7) with augmult K = 2 and a per-copy transform:
  the user's gradient is the mean over their examples of the mean over
  copies, clipped once."""
  x, y, ids = _user_data()
  k = 2
  units = [(np.repeat(x[ids == u], k, 0), np.repeat(y[ids == u], k, 0))
           for u in (10, 20, 30)]
  clip = _median_clip(units, k)
  model = _mlp(clip, k)
  want = _reference(model, units, clip, 3)
  before = [w.numpy() for w in model.trainable_variables]
  model.fit(x, y, batch_size=3, epochs=1, verbose=0, user_ids=ids,
            examples_per_user=7, augmult=k, sampling_seed=0)
  assert int(model.optimizer.iterations.numpy()) == 1
  assert _rel_error(_delta(model, before), want) < 1e-5
