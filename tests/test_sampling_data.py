"""The in-memory Poisson data path: TF ops, dtypes, resume, process exit.

- strings: a `TextVectorization` model trains on `tf.constant` strings
  through the default Poisson `fit` (and the stream gathers string rows);
- float64: `keras.config.set_floatx("float64")` + `make_private` + `fit`
  with both samplings;
- resume: a run stopped after 2 logical steps, checkpointed, restored into a
  fresh model and continued with the same `sampling_seed` ends with the
  weights of the uninterrupted 4-step run (sigma = 0, to 1e-6), and a run
  continued with another seed does not;
- secure mode reaches the sampler, and a seed with it raises;
- exit: a short DP `fit` in fresh interpreters, repeatedly (bounded in
  time), every process exits with status 0 (the old `from_generator`
  stream could hang at exit).
"""

import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import data as dpd
import tf_pxg.keras as dpk
from tf_pxg.keras import _poisson_fit


def _sce():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(sigma=0.0, seed=0, secure=False):
  keras.utils.set_random_seed(seed)
  inp = keras.Input((5,))
  out = keras.layers.Dense(3)(keras.layers.Dense(6, activation="tanh")(inp))
  model = dpk.make_private(keras.Model(inp, out), l2_norm_clip=1.0,
                           noise_multiplier=sigma, secure_mode=secure)
  model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_sce())
  return model


def _data(n=64):
  rng = np.random.RandomState(0)
  return rng.randn(n, 5).astype("float32"), rng.randint(0, 3, n)


def test_stream_gathers_string_rows():
  words = np.array([f"w{i}" for i in range(30)])
  sampler = dpd.PoissonSampler(30, 6, seed=0, steps_per_epoch=4)
  ds = dpd.poisson_dataset(sampler, tf.constant(words), np.arange(30))
  assert ds.element_spec[0].dtype == tf.string
  for xb, yb, info in ds.as_numpy_iterator():
    np.testing.assert_array_equal(xb, words[yb].astype(bytes))


def test_text_vectorization_trains_on_string_tensors_with_poisson_fit():
  texts = tf.constant(["good movie", "bad film", "great fun", "awful plot"]
                      * 16)
  y = np.array([1, 0, 1, 0] * 16)
  vec = keras.layers.TextVectorization(max_tokens=20,
                                       output_sequence_length=4)
  vec.adapt(texts)
  inp = keras.Input((), dtype="string")
  h = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(vec(inp)))
  model = dpk.make_private(keras.Model(inp, keras.layers.Dense(2)(h)),
                           l2_norm_clip=1.0, noise_multiplier=0.0)
  model.compile(optimizer=keras.optimizers.SGD(0.5), loss=_sce())
  before = model.evaluate(texts, y, verbose=0)
  model.fit(texts, y, batch_size=16, epochs=5, verbose=0, sampling_seed=0)
  assert int(model.optimizer.iterations.numpy()) == 20
  assert model.evaluate(texts, y, verbose=0) < before


@pytest.mark.parametrize("sampling", ["poisson", "shuffled"])
def test_float64_model_fits(sampling):
  old, old_policy = keras.config.floatx(), keras.config.dtype_policy()
  keras.config.set_floatx("float64")
  # The global dtype policy is cached from floatx at its first use (by
  # earlier tests in this process); a program that sets floatx first
  # does not need this.
  keras.config.set_dtype_policy("float64")
  try:
    x, y = _data()
    model = _mlp()
    model.fit(x.astype("float64"), y, batch_size=16, epochs=1, verbose=0,
              sampling=sampling)
    assert model.trainable_variables[0].dtype == "float64"
    assert all(np.all(np.isfinite(v.numpy()))
               for v in model.trainable_variables)
  finally:
    keras.config.set_floatx(old)
    keras.config.set_dtype_policy(old_policy)


def _weights(model):
  return [v.numpy() for v in model.trainable_variables]


def test_resume_from_checkpoint_continues_the_sampler_stream(tmp_path):
  x, y = _data()
  kw = dict(batch_size=8, steps_per_epoch=2, verbose=0)
  whole = _mlp()
  whole.fit(x, y, epochs=2, sampling_seed=7, **kw)
  assert int(whole.optimizer.iterations.numpy()) == 4

  first = _mlp()
  first.fit(x, y, epochs=1, sampling_seed=7, **kw)
  path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(
      str(tmp_path / "ckpt"))

  def resumed(seed):
    model = _mlp(seed=1)  # other initial weights, overwritten by restore
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(
        path).assert_existing_objects_matched()
    assert int(model.optimizer.iterations.numpy()) == 2
    model.fit(x, y, epochs=1, sampling_seed=seed, **kw)
    return model

  again = resumed(7)
  assert int(again.optimizer.iterations.numpy()) == 4
  for a, b in zip(_weights(again), _weights(whole)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  other = resumed(8)
  assert max(np.abs(a - b).max()
             for a, b in zip(_weights(other), _weights(whole))) > 1e-4


def test_secure_mode_reaches_the_sampler_and_rejects_a_seed():
  x, y = _data()
  model = _mlp(secure=True)
  assert model._dp_secure_mode
  with pytest.raises(ValueError, match="sampling_seed.*secure_mode"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, sampling_seed=3)
  _, feed, _, _ = _poisson_fit.prepare(model, x, y, None, None, 8, 0.0, None,
                                       1, None, None, None)
  assert feed.sampler.secure_mode and feed.sampler.seed is None
  model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  assert int(model.optimizer.iterations.numpy()) == 8


_EXIT_SCRIPT = textwrap.dedent("""
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np, keras
    import tf_pxg.keras as dpk
    x = np.random.randn(256, 8).astype("float32")
    y = np.random.randint(0, 2, 256)
    inp = keras.Input((8,))
    model = dpk.make_private(keras.Model(inp, keras.layers.Dense(2)(inp)),
                             l2_norm_clip=1.0, noise_multiplier=1.0)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    print("FIT_DONE", flush=True)
    """)


def test_processes_exit_after_dp_fit():
  # At least 3 runs, more (up to 5) while 40 s last; each must exit within
  # 120 s of starting (a hang at exit shows as a timeout after FIT_DONE).
  # (The old `from_generator` stream could hang at exit; this was 10 runs
  # or 150 s, which cost CI up to 150 s.)
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  start, runs = time.monotonic(), 0
  while runs < 3 or (runs < 5 and time.monotonic() - start < 40):
    try:
      proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
      pytest.fail(f"run {runs} did not exit within 120 s; finished fit: "
                  f"{'FIT_DONE' in (out or '')}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "FIT_DONE" in proc.stdout
    runs += 1
  assert runs >= 3


def test_poisson_fit_validation_data_and_class_weight():
  """Held-out `validation_data` is evaluated (`validation_split` is refused
  under DP: tests/test_validation_split.py); `class_weight` gives the same
  step as the equivalent per-example `sample_weight`."""
  import tf_pxg.keras as dpk  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  x = rng.standard_normal((40, 5)).astype("float32")
  y = rng.integers(0, 3, 40)

  def run(**kwargs):
    keras.utils.set_random_seed(1)
    model = dpk.DPSequential([keras.layers.Dense(3)], l2_norm_clip=1.0,
                             noise_multiplier=0.0, seed=0)
    model.compile(keras.optimizers.SGD(0.5),
                  keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                        sampling_seed=3, **kwargs)
    return model, history

  _, history = run(validation_data=(x[30:], y[30:]))
  assert "val_loss" in history.history
  with pytest.raises(ValueError, match="validation_split"):
    run(validation_split=0.25)
  weights = {0: 0.5, 1: 2.0, 2: 1.0}
  by_class, _ = run(class_weight=weights)
  by_row, _ = run(sample_weight=np.asarray([weights[c] for c in y],
                                           np.float32))
  for a, b in zip(by_class.trainable_variables, by_row.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match="no weight for classes"):
    run(class_weight={0: 1.0})
