"""`fit(validation_split=...)` on a DP model (issue 40, item 4).

Keras' `validation_split` takes its validation rows from the private arrays
passed as `x` and `y` and logs un-noised `val_*` values on them: before the
fix one held-out row moved `val_loss` without bound, and the quickstart's
`PrivacyCallback(num_examples=len(x))` was refused for a sampling-rate
mismatch that did not say why. It is now refused first, naming the flag and
`validation_data`; the held-out path it points to is checked against a
closed form (the validation loss computed with numpy from the weights).
"""

import numpy as np
import pytest
import keras

import tf_pxg.keras as dpk

N, BATCH = 40, 8


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((N, 5)).astype("float32")
  y = rng.standard_normal((N, 1)).astype("float32")
  return x, y


def _model(kind="sequential", **compile_kw):
  dp = dict(l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
  layers = [keras.Input((5,)), keras.layers.Dense(1)]
  if kind == "sequential":
    model = dpk.DPSequential(layers, **dp)
  else:
    model = dpk.make_private(keras.Sequential(layers), **dp)
  model.compile(keras.optimizers.SGD(0.1), "mse", **compile_kw)
  return model


@pytest.mark.parametrize("sampling", ["poisson", "shuffled"])
@pytest.mark.parametrize("kind", ["sequential", "make_private"])
@pytest.mark.parametrize("run_eagerly", [False, True])
def test_validation_split_is_refused_before_any_step(sampling, kind,
                                                     run_eagerly):
  # Before the fix: fit trained, and the last 10 rows of the private x gave
  # an un-noised val_loss (planting one outlier row there moved it by 2.2).
  x, y = _data()
  model = _model(kind, run_eagerly=run_eagerly)
  before = [w.copy() for w in model.get_weights()]
  with pytest.raises(ValueError) as info:
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              validation_split=0.25, sampling=sampling)
  message = str(info.value)
  assert "validation_split=0.25" in message
  assert "validation_data=(x_val, y_val)" in message
  assert int(model.optimizer.iterations.numpy()) == 0
  for w, w0 in zip(model.get_weights(), before):
    np.testing.assert_array_equal(w, w0)


def test_refusal_comes_before_the_privacy_callback_check():
  # The quickstart's callback counts len(x): with validation_split the
  # sampler would see 30 rows and the callback refuse a rate mismatch; the
  # validation_split refusal comes first and says what to do.
  x, y = _data()
  model = _model()
  callback = dpk.PrivacyCallback(num_examples=len(x), batch_size=BATCH)
  with pytest.raises(ValueError, match="validation_split") as info:
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
              validation_split=0.2, callbacks=[callback])
  message = str(info.value)
  assert "accounts for sampling rate" not in message  # not the callback's
  assert "PrivacyCallback(num_examples=len(x_train))" in message


@pytest.mark.parametrize("no_split", [0.0, None])
def test_no_validation_split_trains(no_split):
  x, y = _data()
  model = _model()
  history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      validation_split=no_split)
  assert int(model.optimizer.iterations.numpy()) == N // BATCH
  assert not any(k.startswith("val_") for k in history.history)


def test_held_out_validation_data_logs_the_closed_form_val_loss():
  # The path the error points to: train on x_train, validate on a held-out
  # set, count only the training rows in the callback.
  x, y = _data()
  x_train, y_train, x_val, y_val = x[:30], y[:30], x[30:], y[30:]
  model = _model()
  callback = dpk.PrivacyCallback(num_examples=len(x_train),
                                 batch_size=BATCH)
  history = model.fit(x_train, y_train, batch_size=BATCH, epochs=1,
                      verbose=0, validation_data=(x_val, y_val),
                      callbacks=[callback])
  kernel, bias = model.get_weights()
  want = float(np.mean((x_val.astype(np.float64) @ kernel + bias - y_val)
                       ** 2))
  np.testing.assert_allclose(history.history["val_loss"][-1], want,
                             rtol=1e-5)
  assert history.history["epsilon"][-1] > 0


def test_callback_mismatch_names_held_out_rows_and_validation_split():
  # A split of one's own with the callback still counting len(x): the
  # mismatch error says why.
  x, y = _data()
  model = _model()
  callback = dpk.PrivacyCallback(num_examples=len(x), batch_size=BATCH)
  with pytest.raises(ValueError, match="sampling rate") as info:
    model.fit(x[:30], y[:30], batch_size=BATCH, epochs=1, verbose=0,
              validation_data=(x[30:], y[30:]), callbacks=[callback])
  message = str(info.value)
  assert "10 more examples than fit trains on" in message
  assert "validation_split" in message and "validation_data" in message
