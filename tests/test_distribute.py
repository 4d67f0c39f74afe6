"""Noise under tf.distribute: the global step gets std sigma*C/B, once.

The cases run in fresh subprocesses (logical devices and TF_CONFIG must be
set before TensorFlow initialises), the suite's shared ones
(`tests/_multi_worker.py`): the MirroredStrategy cases in its process on 2
logical CPUs, the multi-worker case in its cluster of two worker processes. The model has zero inputs, zero weights and an MSE loss to
zero, so every per-example gradient is exactly 0 and the update is
`-lr * noise / B`; its std over 5050 coordinates is compared with
`sigma * C / B` (within 5%), which rules out sqrt(R) (1.41x) or R (2x) times
that, and correlated replica noise.
"""

import textwrap

import _multi_worker as multi_worker
import pytest

_SIGMA, _CLIP, _BATCH, _LR = 1.3, 0.7, 16, 0.1

_COMMON = textwrap.dedent(f"""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import keras

    def run(strategy, use_fit=True):
      import tf_pxg.keras as dpk
      with strategy.scope():
        inp = keras.Input((100,))
        out = keras.layers.Dense(50, kernel_initializer="zeros")(inp)
        model = dpk.DPModel(inp, out, l2_norm_clip={_CLIP},
                            noise_multiplier={_SIGMA}, seed=7)
        model.compile(optimizer=keras.optimizers.SGD({_LR}), loss="mse",
                      jit_compile=False)
      x = np.zeros(({_BATCH}, 100), "float32")
      y = np.zeros(({_BATCH}, 50), "float32")
      ds = tf.data.Dataset.from_tensor_slices((x, y)).batch({_BATCH})
      if use_fit:
        model.fit(ds, epochs=1, verbose=0, sampling="shuffled")
      else:
        # Keras 3.15's fit fails under multi-worker MWMS before any step, for
        # any model (`_maybe_symbolic_build` passes the (x, y) tuple of
        # PerReplica to strategy.reduce; keras-team/keras#20585,
        # tensorflow/tensorflow#72388); run the same train_step as fit does,
        # traced as fit traces it (without autograph).
        with strategy.scope():
          model.optimizer.build(model.trainable_variables)

        @tf.function(autograph=False)
        def step(batch):
          strategy.run(model.train_step, args=(batch,))

        for batch in strategy.experimental_distribute_dataset(ds):
          step(batch)
      update = np.concatenate(
          [v.numpy().ravel() for v in model.trainable_variables]) / -{_LR}
      result = dict(std=float(update.std()),
                    replicas=strategy.num_replicas_in_sync,
                    iterations=int(keras.ops.convert_to_numpy(
                        model.optimizer.iterations)))
      if use_fit:
        # A NaN in the last example (on the last replica): its clip factor
        # is 0 and the step is applied on every replica (never skipped).
        before = [v.numpy() for v in model.trainable_variables]
        x[-1, 0] = np.nan
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch({_BATCH})
        logs = model.fit(ds, epochs=1, verbose=0,
                         sampling="shuffled").history
        result["nan_weights_finite"] = all(
            bool(np.all(np.isfinite(v.numpy())))
            for v in model.trainable_variables)
        result["nan_weights_changed"] = all(
            bool(np.any(b != v.numpy()))
            for b, v in zip(before, model.trainable_variables))
        result["nan_iterations"] = int(keras.ops.convert_to_numpy(
            model.optimizer.iterations))
        result["logged"] = sorted(logs)
      return result
    """)

_EXACT = textwrap.dedent("""
    def exact(strategy, num, with_reg):
      import tf_pxg.keras as dpk
      CLIP, LR, REG = 0.3, 0.5, 0.25
      rng = np.random.default_rng(0)
      x = rng.standard_normal((num, 4)).astype("float32")
      y = rng.standard_normal((num, 3)).astype("float32")

      def build(dp):
        keras.utils.set_random_seed(0)
        inp = keras.Input((4,))
        out = keras.layers.Dense(
            3, kernel_regularizer=keras.regularizers.L2(REG) if with_reg
            else None)(inp)
        if not dp:
          return keras.Model(inp, out)
        return dpk.DPModel(inp, out, l2_norm_clip=CLIP, noise_multiplier=0.0)

      # Reference without a strategy: per step, the mean over the step's
      # examples of the clipped gradients, plus the regulariser's gradient.
      ref = build(False)
      w = [v.numpy().astype("float64") for v in ref.trainable_variables]
      for start in range(0, num, 4):
        xs, ys = x[start:start + 4], y[start:start + 4]
        total = [np.zeros_like(t) for t in w]
        for b in range(len(xs)):
          for v, t in zip(ref.trainable_variables, w):
            v.assign(t)
          with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ref(xs[b:b + 1]) - ys[b:b + 1]))
          g = [t.numpy() for t in tape.gradient(loss, ref.trainable_variables)]
          f = min(1.0, CLIP / np.sqrt(sum((t * t).sum() for t in g)))
          total = [a + f * t for a, t in zip(total, g)]
        grads = [t / len(xs) for t in total]
        if with_reg:
          grads[0] = grads[0] + 2 * REG * w[0]
        w = [t - LR * g for t, g in zip(w, grads)]

      with strategy.scope():
        model = build(True)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
      ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
      import inspect
      fixed = ({"sampling": "shuffled"} if "sampling" in
               inspect.signature(model.fit).parameters else {})
      model.fit(ds, epochs=1, verbose=0, **fixed)
      got = [v.numpy().astype("float64") for v in model.trainable_variables]
      err = max(float(np.abs(a - b).max()) for a, b in zip(got, w))
      size = max(float(np.abs(a - b).max())
                 for a, b in zip(w, [v.numpy() for v in
                                     build(False).trainable_variables]))
      return dict(
          err=err, size=size, replicas=strategy.num_replicas_in_sync,
          iterations=int(keras.ops.convert_to_numpy(
              model.optimizer.iterations)))
    """)

# Run by tests/_multi_worker.py's shared processes (`strategy` bound; see
# `mirrored_results` and `multi_worker_results`), each case its own models.
MIRRORED_CASES = _COMMON + _EXACT + textwrap.dedent("""
    scenarios(noise=lambda: run(strategy),
              regularizer=lambda: exact(strategy, 8, True),
              uneven=lambda: exact(strategy, 7, False))
    """)

MULTI_WORKER_CASES = _COMMON + textwrap.dedent("""
    scenarios(noise=lambda: run(strategy, use_fit=False))
    """)


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


@pytest.fixture(scope="module")
def multi_worker_cluster(request, tmp_path_factory):
  return multi_worker.multi_worker_results(request, tmp_path_factory)


def _check(result, replicas):
  assert result["replicas"] == replicas
  assert result["iterations"] == 1
  expected = _SIGMA * _CLIP / _BATCH
  ratio = result["std"] / expected
  assert abs(ratio - 1) < 0.05, (
      f"update std {result['std']:.5g} vs sigma*C/B {expected:.5g} "
      f"(ratio {ratio:.3f}; sqrt(R) would be {replicas ** 0.5:.3f})")


def test_mirrored_two_replicas_total_noise_and_non_finite_example_dropped(
    mirrored):
  result = multi_worker.scenario(mirrored, "noise")
  _check(result, replicas=2)
  assert result["nan_weights_finite"]
  assert result["nan_weights_changed"]
  assert result["nan_iterations"] == 2
  assert "dp_skipped_steps" not in result["logged"]


def test_multi_worker_two_processes_total_noise_is_sigma_clip_over_batch(
    multi_worker_cluster):
  results = [multi_worker.scenario(r, "noise") for r in multi_worker_cluster]
  for r in results:
    _check(r, replicas=2)
  # Both workers hold the same (all-reduced) weights.
  assert results[0]["std"] == pytest.approx(results[1]["std"], rel=1e-6)


def _exact(mirrored, name, num):
  result = multi_worker.scenario(mirrored, name)
  assert result["replicas"] == 2
  assert result["iterations"] == -(-num // 4)
  assert result["size"] > 1e-3
  return result


def test_mirrored_regularizer_gradient_counted_once(mirrored):
  """Two replicas: the weight regulariser's gradient (divided by R on each
  replica, summed by the all-reduce) is added once, unclipped."""
  result = _exact(mirrored, "regularizer", 8)
  assert result["err"] <= 1e-5 * max(1.0, result["size"]), result


def test_mirrored_uneven_last_batch_divides_by_its_examples(mirrored):
  """7 examples, global batch 4: the last batch of 3 splits 2/1 over the
  replicas; its update is the mean over those 3 clipped gradients."""
  result = _exact(mirrored, "uneven", 7)
  assert result["err"] <= 1e-5 * max(1.0, result["size"]), result
