"""A DP run's unsaved state lives in the DPOptimizer's `StepState`.

The noise generator, the step limit and the last `fit`'s sampler are per-run
state (`tf_pxg.dp.step_state`): held by the compiled `DPOptimizer`, none of
them on the Keras model, none saved. A recompile with another optimizer
hands the run over: a seeded noise stream goes on rather than restarting
(a restart would add the same noise to two steps, so their difference
would show the difference of two clipped sums un-noised).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_pxg.data as dpd
import tf_pxg.keras as dpk
from tf_pxg.dp import step_state

N, BATCH, CLIP, SIGMA, LR = 32, 8, 1.0, 2.0, 0.5


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 3)).astype("float32")
  y = rng.integers(0, 2, N).astype("int32")
  return x, y


def _model(seed=7):
  keras.utils.set_random_seed(0)
  inp = keras.Input((3,))
  out = keras.layers.Dense(2)(inp)
  model = dpk.DPModel(inp, out, l2_norm_clip=CLIP, noise_multiplier=SIGMA,
                      seed=seed)
  model.compile(optimizer=keras.optimizers.SGD(LR),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _weights(model):
  return np.concatenate([v.numpy().ravel()
                         for v in model.trainable_variables])


def _steps(model, x, y, recompile_after=None, steps=3):
  """Weights after each of `steps` plain steps on the same batch;
  recompiles with a fresh optimizer (same plan) after step
  `recompile_after`."""
  out = []
  for i in range(steps):
    model.train_on_batch(x[:BATCH], y[:BATCH])
    out.append(_weights(model))
    if i == recompile_after:
      model.compile(optimizer=keras.optimizers.SGD(LR),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
  return out


def test_recompile_continues_the_seeded_noise_stream():
  x, y = _data()
  straight = _steps(_model(), x, y)
  recompiled = _steps(_model(), x, y, recompile_after=0)
  for a, b in zip(straight, recompiled):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
  # The attack a restarted stream allows: the same noise at steps 1 and
  # 2 (from the same weights, the same batch) would make their updates
  # equal. A fresh stream's updates differ by the noise, std sigma C lr /
  # B per coordinate.
  restarted = _model()
  first = _steps(restarted, x, y, steps=1)[0]
  w0 = _model(seed=7)  # the initial weights again
  start = _weights(w0)
  restarted.compile(optimizer=keras.optimizers.SGD(LR),
                    loss=keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
  for v, w in zip(restarted.trainable_variables, w0.trainable_variables):
    v.assign(w)
  second = _steps(restarted, x, y, steps=1)[0]
  scale = SIGMA * CLIP * LR / BATCH
  assert np.abs((second - start) - (first - start)).max() > 0.1 * scale


def test_run_state_is_the_optimizers_not_the_models():
  x, y = _data()
  model = _model()
  model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
            callbacks=[dpk.PrivacyCallback(N, BATCH)])
  state = model.optimizer.step_state
  assert isinstance(state, step_state.StepState)
  assert isinstance(state.generator, tf.random.Generator)
  assert isinstance(state.sampler, dpd.PoissonSampler)
  assert model.dp_plan.sampler is state.sampler
  assert int(state.step_limit.numpy()) == step_state.NO_STEP_LIMIT
  # Nothing of the run is an attribute of the Keras model.
  for name, value in vars(model).items():
    assert not isinstance(value, (tf.random.Generator, dpd.PoissonSampler,
                                  step_state.StepState)), name
    assert value is not state.step_limit, name
  # Nor of the optimizer's tracked (saved) state.
  saved = {id(v) for v in model.optimizer.variables}
  assert id(state.step_limit) not in saved
  assert id(state.generator.state) not in saved


def test_step_limit_needs_a_compiled_model_and_survives_a_recompile():
  inp = keras.Input((3,))
  model = dpk.DPModel(inp, keras.layers.Dense(2)(inp), l2_norm_clip=CLIP,
                      noise_multiplier=SIGMA)
  assert model.step_limit is None
  with pytest.raises(ValueError, match="compile the model first"):
    model.set_step_limit(3)
  model.compile(optimizer="sgd", loss="mse")
  model.set_step_limit(3)
  model.compile(optimizer="adam", loss="mse")  # a new DPOptimizer
  assert model.step_limit == 3
  x, y = _data()
  model.fit(x, np.eye(2, dtype="float32")[y], batch_size=BATCH, epochs=2,
            verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 3
