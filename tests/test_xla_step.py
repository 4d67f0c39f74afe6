"""The whole DP train step as one XLA program: Poisson masks, accumulation,
noise, the non-finite clip factors and the step limit, with
`jit_compile=True` and `steps_per_execution > 1`.

(Under MirroredStrategy with 2 logical CPUs, see
`test_distribute_poisson.py`: Keras' own `fit` with `jit_compile=True` or
`steps_per_execution > 1` fails there for any model, so the replica-local
half of the DP step is compiled per replica and its HLO checked.)
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import data as dpd
import tf_pxg.keras as dpk

CLIP = 2.5


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(noise=0.0, lr=1.0, steps_per_execution=2):
  keras.utils.set_random_seed(0)
  inp = keras.Input((5,))
  h = keras.layers.Dense(7, activation="tanh")(inp)
  out = keras.layers.Dense(3)(h)
  model = dpk.DPModel(inp, out, l2_norm_clip=CLIP, noise_multiplier=noise,
                      seed=3)
  model.compile(optimizer=keras.optimizers.SGD(lr), loss=_sce(),
                jit_compile=True, steps_per_execution=steps_per_execution,
                metrics=["accuracy"])
  return model


def _data(n=16):
  rng = np.random.RandomState(1)
  return (rng.randn(n, 5).astype("float32") * 2,
          rng.randint(0, 3, n).astype("int32"))


def _reference_update(model, x, y):
  total = None
  for b in range(len(y)):
    with tf.GradientTape() as tape:
      loss = _sce()(y[b:b + 1], model(x[b:b + 1], training=True))
    g = tape.gradient(loss, model.trainable_variables)
    c = min(1.0, CLIP / math.sqrt(sum(float(tf.reduce_sum(t * t))
                                      for t in g)))
    g = [c * t.numpy() for t in g]
    total = g if total is None else [a + t for a, t in zip(total, g)]
  return [-t / len(y) for t in total]


def test_jit_steps_per_execution_logical_step_matches_reference():
  x, y = _data()
  model = _model(steps_per_execution=2)
  before = [v.numpy() for v in model.trainable_variables]
  want = _reference_update(model, x, y)
  # q = 1, k = 2: one logical step of 2 physical batches, run inside one
  # execution (steps_per_execution divides the epoch's 2 physical batches).
  model.fit(x, y, batch_size=16, epochs=1, verbose=0, accumulation_steps=2,
            sampling_seed=0)
  assert int(model.optimizer.iterations) == 1
  got = [v.numpy() - b for v, b in zip(model.trainable_variables, before)]
  scale = max(np.abs(w).max() for w in want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
  model.fit(x, y, batch_size=4, epochs=2, verbose=0, accumulation_steps=2)
  assert int(model.optimizer.iterations) == 1 + 2 * 4  # N/B steps an epoch


def test_jit_non_finite_example_is_dropped_not_skipped():
  x, y = _data()
  x[5, 0] = np.nan
  model = _model(noise=1.0, lr=0.1, steps_per_execution=2)
  before = [v.numpy() for v in model.trainable_variables]
  # q = 1: every logical step holds the NaN example, whose clip factor is
  # 0; every step is applied (exact values: test_non_finite.py).
  history = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                      accumulation_steps=2)
  assert int(model.optimizer.iterations) == 3
  assert "dp_skipped_steps" not in history.history
  for b, v in zip(before, model.trainable_variables):
    assert np.all(np.isfinite(v.numpy())), v.path
    assert np.any(v.numpy() != b), v.path


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_train_step_compiles_to_one_hlo_module_without_host_transfers(noise):
  x, y = _data(32)
  model = _model(noise=noise)
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, accumulation_steps=2)
  sampler = dpd.PoissonSampler(32, 8, accumulation_steps=2, seed=0)
  batch = next(iter(dpd.poisson_dataset(sampler, x, y)))
  step = tf.function(model.train_step, jit_compile=True)
  hlo = step.experimental_get_compiler_ir(batch)(stage="hlo")
  assert "ENTRY" in hlo
  # Nothing leaves the device inside the step.
  for op in ("send(", "recv(", "infeed(", "outfeed(", "custom-call("):
    assert op not in hlo, op
  assert "is-finite(" in hlo  # non-finite examples get clip factor 0
  if noise:
    assert "rng-bit-generator(" in hlo  # noise drawn on device
  # Running the compiled step trains: weights move at the step's end.
  before = [v.numpy() for v in model.trainable_variables]
  it = iter(dpd.poisson_dataset(sampler, x, y))
  for _ in range(2):
    step(next(it))
  assert any(np.any(v.numpy() != b)
             for v, b in zip(model.trainable_variables, before))
