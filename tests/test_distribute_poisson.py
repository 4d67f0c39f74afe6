"""Poisson logical steps under real strategies: exact, and noise once.

The cases run in the suite's shared subprocesses (`tests/_multi_worker.py`):
its process on 2 logical CPUs for MirroredStrategy, its 2 worker processes
on 127.0.0.1 for MultiWorkerMirroredStrategy (the last test runs the
example script, which starts its own). In each:
- exactness: with sigma = 0, q = 1 and SGD(1), one logical step over k = 4
  physical batches (each split over 2 replicas, padded and masked) moves
  the weights by `-mean_b clip(g_b)` from a plain `tf.GradientTape` loop
  over single examples, to 1e-5 of the update size;
- noise: a zero-gradient model's update after one logical step (k = 2) has
  std `sigma C / (q N)` within 3% (R = 2 replicas each adding
  `sigma C / sqrt(2)`; sqrt(2) or 2 times too much would fail).
Under Mirrored the step runs through `fit`, and again as a custom loop whose
replica-local half (`dp_gradients`) is compiled with XLA, with its HLO
fetched; under MWMS (where Keras' fit fails upstream) as the custom loop
of `examples/dp_digits_multiworker.py`'s kind. The custom loops are traced
without autograph, as Keras traces fit's step: autograph would first
convert tf_pxg's whole gradient path, ~25 s of CPU per process (the
example's own test below, tests/test_xla_step.py and
tests/test_weights_ledger.py trace DP steps with autograph).
"""

import subprocess
import sys
import textwrap

import _multi_worker as multi_worker
import pytest

_SIGMA, _CLIP, _N, _B = 1.3, 0.7, 64, 16

_COMMON = textwrap.dedent(f"""
    import json, math, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import keras

    def sce():
      return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def mlp(strategy, clip, sigma, lr):
      import tf_pxg.keras as dpk
      with strategy.scope():
        keras.utils.set_random_seed(0)
        inp = keras.Input((5,))
        h = keras.layers.Dense(7, activation="tanh")(inp)
        out = keras.layers.Dense(3)(h)
        model = dpk.DPModel(inp, out, l2_norm_clip=clip,
                            noise_multiplier=sigma, seed=5)
        model.compile(optimizer=keras.optimizers.SGD(lr), loss=sce())
        model.optimizer.build(model.trainable_variables)
        model.build_accumulator()
      return model

    def zero_grad_model(strategy):
      import tf_pxg.keras as dpk
      with strategy.scope():
        inp = keras.Input((200,))
        out = keras.layers.Dense(50, kernel_initializer="zeros")(inp)
        model = dpk.DPModel(inp, out, l2_norm_clip={_CLIP},
                            noise_multiplier={_SIGMA}, seed=7)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
        model.optimizer.build(model.trainable_variables)
        model.build_accumulator()
      return model

    def weights(model):
      return [v.numpy() for v in model.trainable_variables]

    def reference_update(model, x, y, clip):
      total = None
      for b in range(len(y)):
        with tf.GradientTape() as tape:
          loss = sce()(y[b:b + 1], model(x[b:b + 1], training=True))
        g = tape.gradient(loss, model.trainable_variables)
        c = min(1.0, clip / math.sqrt(
            sum(float(tf.reduce_sum(t * t)) for t in g)))
        g = [c * t.numpy() for t in g]
        total = g if total is None else [a + t for a, t in zip(total, g)]
      return [-t / len(y) for t in total]

    def rel_error(model, before, want):
      got = [w - b for w, b in zip(weights(model), before)]
      scale = max(np.abs(w).max() for w in want)
      return float(max(np.abs(g - w).max() for g, w in zip(got, want)) / scale)

    def custom_loop(strategy, model, x, y, batch, k, seed, jit=False):
      from tf_pxg import data as dpd
      r = strategy.num_replicas_in_sync
      sampler = dpd.PoissonSampler(len(y), batch, accumulation_steps=k,
                                   num_replicas=r, seed=seed,
                                   steps_per_epoch=1)
      def input_fn(ctx):
        return dpd.for_input_pipeline(dpd.poisson_dataset(sampler, x, y), ctx)
      dist = strategy.distribute_datasets_from_function(input_fn)
      grads = tf.function(model.dp_gradients, jit_compile=True,
                          autograph=False) if jit else model.dp_gradients
      @tf.function(autograph=False)
      def step(b):
        strategy.run(lambda d: model.dp_apply(grads(d)), args=(b,))
      for b in dist:
        step(b)
      hlo = None
      if jit:
        local = next(iter(input_fn(tf.distribute.InputContext(1, 0, r))))
        hlo = strategy.experimental_local_results(strategy.run(
            lambda: grads.experimental_get_compiler_ir(local)(stage="hlo")))
      return hlo

    def run(strategy, mode):
      rng = np.random.RandomState(1)
      x = (rng.randn(24, 5) * 2).astype("float32")
      y = rng.randint(0, 3, 24).astype("int32")
      out = dict(replicas=strategy.num_replicas_in_sync)
      model = mlp(strategy, 2.5, 0.0, 1.0)
      before = weights(model)
      want = reference_update(model, x, y, 2.5)
      if mode == "fit":
        model.fit(x, y, batch_size=24, epochs=1, verbose=0,
                  accumulation_steps=4, sampling_seed=0)
        out["hlo_len"] = None
      else:
        hlo = custom_loop(strategy, model, x, y, 24, 4, seed=0,
                          jit=(mode == "jit"))
        out["hlo_len"] = None if hlo is None else [len(h) for h in hlo]
      out["exact_error"] = rel_error(model, before, want)
      out["iterations"] = int(model.optimizer.iterations.numpy())
      noisy = zero_grad_model(strategy)
      xz = np.zeros(({_N}, 200), "float32")
      yz = np.zeros(({_N}, 50), "float32")
      if mode == "fit":
        noisy.fit(xz, yz, batch_size={_B}, epochs=1, steps_per_epoch=1,
                  verbose=0, accumulation_steps=2, sampling_seed=0)
      else:
        custom_loop(strategy, noisy, xz, yz, {_B}, 2, seed=0)
      update = np.concatenate([-v.ravel() for v in weights(noisy)])
      out["noise_ratio"] = float(update.std() / ({_SIGMA} * {_CLIP} / {_B}))
      out["noise_iterations"] = int(noisy.optimizer.iterations.numpy())
      return out
    """)

# Run by tests/_multi_worker.py's shared processes (`strategy` bound; see
# `mirrored_results` and `multi_worker_results`).
MIRRORED_CASES = _COMMON + textwrap.dedent("""
    scenarios(fit=lambda: run(strategy, "fit"),
              jit=lambda: run(strategy, "jit"))
    """)

MULTI_WORKER_CASES = _COMMON + textwrap.dedent("""
    scenarios(loop=lambda: run(strategy, "loop"))
    """)


def _check(result):
  assert result["replicas"] == 2
  assert result["iterations"] == 1
  assert result["exact_error"] < 1e-5, result
  assert result["noise_iterations"] == 1
  assert abs(result["noise_ratio"] - 1) < 0.03, result


@pytest.fixture(scope="module")
def mirrored(request, tmp_path_factory):
  return multi_worker.mirrored_results(request, tmp_path_factory)


@pytest.fixture(scope="module")
def multi_worker_cluster(request, tmp_path_factory):
  return multi_worker.multi_worker_results(request, tmp_path_factory)


def test_mirrored_fit_poisson_logical_step_exact_and_noise_once(mirrored):
  _check(multi_worker.scenario(mirrored, "fit"))


def test_mirrored_custom_loop_with_xla_replica_step_exact_and_hlo(mirrored):
  result = multi_worker.scenario(mirrored, "jit")
  _check(result)
  assert len(result["hlo_len"]) == 2 and min(result["hlo_len"]) > 1000


def test_multi_worker_poisson_logical_step_exact_and_noise_once(
    multi_worker_cluster):
  results = [multi_worker.scenario(r, "loop") for r in multi_worker_cluster]
  for r in results:
    _check(r)
  # Both workers hold the same (all-reduced) weights.
  assert results[0]["noise_ratio"] == results[1]["noise_ratio"]


@pytest.mark.slow  # ~45 s alone, ~90 s on a loaded 2-core machine
def test_multiworker_example_trains_and_workers_agree():
  import os  # noqa: PLC0415
  import re  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "examples",
                                    "dp_digits_multiworker.py"),
       "--epochs=2", "--target_epsilon=2.0"],
      env=multi_worker.env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  final = [line for line in lines if line.startswith("final:")]
  match = re.fullmatch(
      r"final: test_accuracy=(\S+) epsilon=(\S+) delta=1e-05", final[0])
  assert match, lines
  assert 0.3 < float(match.group(1)) <= 1.0  # 10 classes: chance is 0.1
  assert float(match.group(2)) <= 2.0
  sums = [line.split("weights_checksum=")[1] for line in lines
          if "weights_checksum=" in line]
  assert len(sums) == 2 and sums[0] == sums[1], sums  # same all-reduced model
