"""The privacy budget is never exceeded, whatever the execution layout.

`PrivacyCallback(target_epsilon=...)` sets the model's step limit to
`max_steps()`, and the compiled train step applies an update only while
`optimizer.iterations` is below it (data-independent, per physical batch).
Keras calls `on_train_batch_end` once per execution, so a check there alone
let `steps_per_execution=8` run 16 logical steps on a 10-step budget (and
`accumulation_steps=2`, 12).

The target ε is the ε of exactly 10 logical steps; the model trains with
sigma = 1 (its plan's, which the callback reads), a fixed noise seed and a
fixed sampling seed, so its weights after the budget must equal a reference
run's weights after its 10th logical step. The reference is run without a
budget with `steps_per_execution=1` and the same `accumulation_steps` and
XLA setting: without XLA the noise is drawn once per logical step, under
XLA at every physical batch (used only at a step's end), so with
`accumulation_steps=2` the two settings draw different streams; within a
setting `steps_per_execution` does not change the stream (the weights
match exactly for 1, 8 and 32). The budget given to `fit` itself
(`target_epsilon=`, `delta=`), or to a callback without N and the batch
size (then its sampler's), holds the same way. Also: two `fit` calls
sharing one
callback, a resume (`iterations` and the privacy ledger restored from saved
weights), and MirroredStrategy over 2 logical CPUs (`iterations` only:
Keras' fit there needs `steps_per_execution=1`).
"""

import math
import textwrap

import _multi_worker as multi_worker
import dp_accounting
import keras
import numpy as np
import pytest

from tf_pxg import accounting
import tf_pxg.keras as dpk

N, BATCH, SIGMA, DELTA, STEPS = 32, 8, 1.0, 1e-5, 10
TARGET = accounting.compute_epsilon(N, BATCH, SIGMA, steps=STEPS, delta=DELTA)


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 3)).astype("float32")
  y = rng.integers(0, 2, N).astype("int32")
  return x, y


def _model(steps_per_execution=1, jit=False):
  keras.utils.set_random_seed(0)
  inp = keras.Input((3,))
  out = keras.layers.Dense(2)(inp)
  model = dpk.DPModel(inp, out, l2_norm_clip=0.5, noise_multiplier=SIGMA,
                      seed=0)
  model.compile(
      optimizer=keras.optimizers.SGD(0.5),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      steps_per_execution=steps_per_execution, jit_compile=jit)
  return model


def _callback():
  return dpk.PrivacyCallback(N, BATCH, delta=DELTA, target_epsilon=TARGET)


class _WeightsAt(keras.callbacks.Callback):
  """The weights when `iterations` first reaches `steps` (one physical
  batch per execution)."""

  def __init__(self, steps):
    super().__init__()
    self.steps, self.weights = steps, None

  def on_train_batch_end(self, batch, logs=None):
    if (self.weights is None and
        int(self.model.optimizer.iterations.numpy()) == self.steps):
      self.weights = [v.numpy() for v in self.model.trainable_variables]


_REFERENCE = {}


def _reference(accumulation_steps, jit=False):
  """Weights after exactly STEPS logical steps, without a budget."""
  key = (accumulation_steps, jit)
  if key not in _REFERENCE:
    x, y = _data()
    model = _model(jit=jit)
    at = _WeightsAt(STEPS)
    model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0, callbacks=[at],
              accumulation_steps=accumulation_steps, sampling_seed=1)
    assert int(model.optimizer.iterations.numpy()) > STEPS
    assert at.weights is not None
    _REFERENCE[key] = at.weights
  return _REFERENCE[key]


def _assert_at_budget(model, history, accumulation_steps, jit=False):
  assert int(model.optimizer.iterations.numpy()) == STEPS
  for v, w in zip(model.trainable_variables,
                  _reference(accumulation_steps, jit)):
    np.testing.assert_allclose(v.numpy(), w, rtol=1e-6, atol=1e-7,
                               err_msg=v.path)
  assert history.history["epsilon"][-1] <= TARGET
  assert model.step_limit is None  # removed at on_train_end


def test_target_is_the_epsilon_of_ten_steps_in_dp_accounting():
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          BATCH / N, dp_accounting.GaussianDpEvent(SIGMA)), STEPS)
  acc = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS))
  acc.compose(event)
  assert TARGET == pytest.approx(acc.get_epsilon(DELTA), rel=1e-9)
  callback = _callback()
  callback.set_model(_model())
  assert callback.max_steps() == STEPS
  assert callback.epsilon(STEPS + 1) > TARGET


@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("steps_per_execution", [1, 8, 32])
def test_budget_holds_for_any_execution_layout(steps_per_execution,
                                               accumulation_steps):
  x, y = _data()
  model = _model(steps_per_execution)
  history = model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                      callbacks=[_callback()],
                      accumulation_steps=accumulation_steps, sampling_seed=1)
  _assert_at_budget(model, history, accumulation_steps)


@pytest.mark.parametrize("how", ["fit", "callback_without_n_or_b"])
def test_budget_as_an_argument_of_fit(how):
  """`fit(target_epsilon=, delta=)` with no callback, or a
  `PrivacyCallback` given only the budget (N and the batch size from
  fit's sampler), hold the budget exactly as `_callback()` does: the
  weights of the reference's 10th step, then no further step."""
  x, y = _data()
  model = _model(steps_per_execution=8)
  budget = (dict(target_epsilon=TARGET, delta=DELTA) if how == "fit" else
            dict(callbacks=[dpk.PrivacyCallback(delta=DELTA,
                                                target_epsilon=TARGET)]))
  history = model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                      sampling_seed=1, **budget)
  _assert_at_budget(model, history, 1)


def test_budget_under_xla():
  x, y = _data()
  model = _model(steps_per_execution=8, jit=True)
  history = model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                      callbacks=[_callback()], accumulation_steps=2,
                      sampling_seed=1)
  # Against an XLA reference: XLA draws the noise at every physical batch.
  _assert_at_budget(model, history, 2, jit=True)


def test_two_fit_calls_share_the_budget():
  x, y = _data()
  model = _model(steps_per_execution=8)
  callback = _callback()
  # 4 logical steps an epoch: the first fit stays within the budget.
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[callback],
            sampling_seed=1)
  first = int(model.optimizer.iterations.numpy())
  assert 0 < first < STEPS
  history = model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                      callbacks=[callback], sampling_seed=2)
  assert int(model.optimizer.iterations.numpy()) == STEPS
  assert history.history["epsilon"][-1] <= TARGET
  with pytest.raises(ValueError, match="exceeded by the next step"):
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[callback])
  assert int(model.optimizer.iterations.numpy()) == STEPS


def test_resumed_iterations_get_the_rest_of_the_budget(tmp_path):
  # 7 steps, saved with the optimizer (its `iterations` and the privacy
  # ledger, which the callback reads) and restored into a fresh model.
  x, y = _data()
  first = _model()
  first.set_step_limit(7)
  first.fit(x, y, batch_size=BATCH, epochs=4, verbose=0, sampling_seed=1)
  assert int(first.optimizer.iterations.numpy()) == 7
  first.save_weights(tmp_path / "m.weights.h5")
  model = _model(steps_per_execution=32)
  model.optimizer.build(model.trainable_variables)
  model.load_weights(tmp_path / "m.weights.h5")
  assert int(model.optimizer.iterations.numpy()) == 7
  model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
            callbacks=[_callback()], sampling_seed=1)
  assert int(model.optimizer.iterations.numpy()) == STEPS


def test_limit_removed_after_fit_and_settable_by_hand():
  x, y = _data()
  model = _model(steps_per_execution=8)
  model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
            callbacks=[_callback()], sampling_seed=1)
  assert model.step_limit is None
  # A later fit without the callback trains on.
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, sampling_seed=1)
  assert int(model.optimizer.iterations.numpy()) > STEPS
  done = int(model.optimizer.iterations.numpy())
  model.set_step_limit(done + 2)  # by hand: stays until changed
  assert model.step_limit == done + 2
  model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, sampling_seed=1)
  assert int(model.optimizer.iterations.numpy()) == done + 2
  model.set_step_limit(None)
  assert model.step_limit is None
  with pytest.raises(ValueError, match="non-negative integer"):
    model.set_step_limit(-1)


def test_max_steps_is_consistent_with_compute_epsilon():
  callback = _callback()
  callback.set_model(_model())
  m = callback.max_steps()
  assert callback.epsilon(m) <= TARGET < callback.epsilon(m + 1)
  assert math.isfinite(TARGET)


# Run by tests/_multi_worker.py's shared MirroredStrategy process (2
# logical CPUs, `strategy`; see `mirrored_results`).
MIRRORED_CASES = textwrap.dedent("""
    import test_budget as t

    def budget():
      x, y = t._data()
      with strategy.scope():
        model = t._model()
      history = model.fit(x, y, batch_size=t.BATCH, epochs=4, verbose=0,
                          callbacks=[t._callback()], accumulation_steps=2,
                          physical_batch_size=8, sampling_seed=1)
      return dict(
          iterations=int(model.optimizer.iterations.numpy()),
          epsilon=history.history["epsilon"][-1],
          replicas=strategy.num_replicas_in_sync)

    scenarios(budget=budget)
    """)


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


def test_budget_under_mirrored_strategy(mirrored):
  result = multi_worker.scenario(mirrored, "budget")
  assert result["replicas"] == 2
  assert result["iterations"] == STEPS
  assert result["epsilon"] <= TARGET
