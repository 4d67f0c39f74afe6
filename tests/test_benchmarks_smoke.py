"""Smoke tests of the benchmark suite's code (no timing assertions).

They run each piece once on tiny batches: the modes train, the interleaved
timer and the ratio bookkeeping produce complete records, failures become
status records, the memory probe reports without crashing where the
allocator keeps no statistics, and the report renders.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import memory
from benchmarks import models
from benchmarks import modes
from benchmarks import report
from benchmarks import timing


@pytest.mark.parametrize("name", sorted(
    set(models.SPECS) - set(models.HUB_MODELS)))
def test_models_build_for_keras3_and_take_their_batch(name):
  import keras  # pylint: disable=g-import-not-at-top
  model = models.build(keras, name, 8 if models.SPECS[name].seq_len else 0)
  x, y = models.batch(name, 3, 8)
  out = model(x)
  assert out.shape == (3, models.SPECS[name].classes)
  assert y.shape == (3,) and y.max() < models.SPECS[name].classes


@pytest.mark.parametrize("mode", ["keras", "pxg", "pxg_naive"])
def test_keras3_modes_train_the_embedding_model(mode):
  # Integer inputs, which Keras casts on their way into the model: DP fit
  # must still see them as data. Each step changes the weights.
  step = modes.make(mode, "embed", 4, 6)
  variables = step.model.trainable_variables
  before = [v.numpy().copy() for v in variables]
  modes.sync(step.fn())
  after = [v.numpy() for v in variables]
  assert all(a.shape == b.shape for a, b in zip(before, after))
  assert all(not np.array_equal(a, b) for a, b in zip(before, after))


def test_noise_mode_draws_one_normal_per_weight():
  step = modes.make("noise", "mlp", 4)
  noise = step.fn()
  assert step.info["weights"] == sum(int(np.prod(n.shape)) for n in noise)
  flat = np.concatenate([np.ravel(n) for n in noise])
  assert abs(flat.std() - modes.NOISE_MULTIPLIER * modes.L2_NORM_CLIP) < 0.01


def test_interleaved_rounds_give_ratios_and_failures_become_records():
  def make(name):
    if name == "broken":
      raise NotImplementedError("op 'X' has no rule")
    return modes.make(name, "mlp", 4)

  built = timing.build_group(["keras", "pxg", "broken"], make, log=print)
  results = timing.run_rounds(built, rounds=2, round_seconds=0.01)
  timing.add_ratios(results)
  assert results["broken"]["status"] == "unsupported"
  assert "no rule" in results["broken"]["error"]
  for name in ("keras", "pxg"):
    r = results[name]
    assert r["status"] == "ok" and len(r["round_ms"]) == 2
    assert r["ms"] > 0 and r["cpu_ms"] >= 0
  assert results["pxg"]["baseline"] == "keras"
  assert results["pxg"]["ratio"] > 0
  assert "ratio" not in results["keras"]


def test_error_message_keeps_the_last_line_of_tf_traces():
  exc = TypeError("in user code:\n\n  File x, line 1\n\nTypeError: bad op")
  assert timing.error_message(exc) == (
      "TypeError: in user code: ... TypeError: bad op")


def test_memory_probe_reports_rss_and_allocator_peak_or_none():
  r = memory.measure("keras", "mlp", 4, 0, steps=1)
  assert r["status"] == "ok"
  assert r["rss_base_mb"] > 0 and r["rss_peak_mb"] >= r["rss_base_mb"] * 0.5
  # The allocator peak is a number where TF keeps CPU stats, else None
  # (the case that used to crash with "Cannot reset memory stats").
  assert r["alloc_peak_mb"] is None or r["alloc_peak_mb"] > 0
  bad = memory.measure("keras", "no_such_model", 4, 0, steps=1)
  assert bad["status"] == "error" and "no_such_model" in bad["error"]


_SMALL_TENSORS = """
import json, sys
import tensorflow as tf
from benchmarks import memory

@tf.function
def step(x):
  parts = [x * float(i) for i in range(64)]  # 64 live [64, 128]: 32 KB each
  return tf.reduce_sum(tf.stack(parts))

x = tf.ones([64, 128])
step(x)
has = memory.reset_allocator_stats()
step(x).numpy()
print(json.dumps({"has": has, "peak": memory.allocator_peak_bytes()}))
"""


def test_memory_probe_allocator_counts_small_tensors():
  """Under `memory.ALLOCATOR_ENV` the allocator's peak includes tensors of
  32 KB: 64 of them live at once and their 2 MB stack need at least 4 MB
  (TF's oneDNN CPU allocator left such tensors out of its statistics)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **memory.ALLOCATOR_ENV)
  out = subprocess.run([sys.executable, "-c", _SMALL_TENSORS], env=env,
                       capture_output=True, text=True, check=True,
                       cwd=str(pathlib.Path(memory.__file__).parents[1]))
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["has"], "the BFC allocator keeps statistics"
  assert result["peak"] >= 4 * 2**20, result


def test_memory_profile_finds_the_live_tensors_at_the_peak():
  """`memory_profile.live_at_peak` replays allocations and frees in time
  order: the peak is the largest sum of live requested bytes, grouped by
  op with step numbers folded."""
  from benchmarks import memory_profile  # pylint: disable=g-import-not-at-top
  ev = memory_profile.Event
  events = [ev(1, 10, 100, "a/cell_1/mul", "[4]"),
            ev(2, 11, 100, "a/cell_2/mul", "[4]"),
            ev(3, 12, 150, "b/concat", "[8]"),  # 350 live: the peak
            ev(4, 10, 0, "", ""),
            ev(5, 11, 0, "", ""),
            ev(6, 13, 120, "c", "[2]")]  # 270 live
  peak, groups = memory_profile.live_at_peak(events)
  assert peak == 350
  assert groups == {("a/cell_N/mul", "[4]"): 200, ("b/concat", "[8]"): 150}


def test_allocator_helpers_do_not_raise():
  has = memory.reset_allocator_stats()
  peak = memory.allocator_peak_bytes()
  assert isinstance(has, bool)
  assert peak is None or peak >= 0


def test_report_renders_tables_and_writes_json(tmp_path):
  ok = {"status": "ok", "ms": 2.0, "cpu_ms": 2.0, "ratio": 1.5,
        "cpu_ratio": 1.4}
  result = {
      "date": "2026-01-01T00:00:00+00:00",
      "machine": {"model_name": "CPU", "cores": 2, "mem_total_gb": 1.0},
      "settings": {"quick": True, "rounds": 1},
      "time": {"mlp": {"batch_size": 4, "seq_len": None, "modes": {
          "keras": {"status": "ok", "ms": 1.0, "cpu_ms": 1.0},
          "pxg": ok,
          "noise": {"status": "ok", "ms": 0.5, "cpu_ms": 0.5,
                    "weights": 1000},
          "tf_keras": {"status": "ok", "ms": 1.0, "cpu_ms": 1.0},
          "tfp_dpmodel": dict(ok, ratio=3.0, cpu_ratio=3.0, ms=4.0,
                              cpu_ms=4.0, path="registry fast path"),
          "tfp_optimizer": {"status": "error", "error": "TypeError: x"}}}},
      "growth": [{"model": "mlp", "axis": "batch", "size": 32,
                  "modes": {"pxg": ok}}],
      "memory": {"mlp": {"keras": {"status": "ok", "alloc_peak_mb": 2.0},
                         "pxg": {"status": "ok", "alloc_ratio": 1.2,
                                 "rss_ratio": 1.0}}},
  }
  md = report.markdown(result)
  assert "| mlp (4) | 1.0 ms | 1.50× (1.40×)" in md
  # tf_pxg time / TF Privacy's, and overhead ratios (1.5-1)/(3-1) etc.
  assert "| 0.50× (0.50×) | 0.25× (0.20×) |" in md
  assert "registry fast path" in md and "TypeError: x" in md
  assert "| mlp | batch 32 | 1.50× (1.40×) |" in md
  # Generator floor: 1 + 0.5 ms / 1.0 ms, above the MLP's 1.15x target;
  # no kernel measurements, so no memory floor.
  assert ("| mlp | 1,000 | 0.50 ms | 1.00 ms | 1.50× | – | 1.40× | "
          "1.15× (below the generator floor) |") in md
  # Memory floor: 1 + 1000 weights x 200 ns (the cheaper pass) / 1.0 ms.
  result["noise_kernels"] = {
      "threefry_ns_per_gaussian": 4.0, "philox_ns_per_word": 5.0,
      "box_muller_ns_per_gaussian": 7.0, "tf_normal_ns_per_gaussian": 12.0,
      "copy_ns_per_float": 200.0, "dense_update_ns_per_float": 300.0,
      "elements": 10}
  assert ("| mlp | 1,000 | 0.50 ms | 1.00 ms | 1.50× | 1.20× | 1.40× | "
          "1.15× (below the memory floor: out of reach) |"
          in report.markdown(result))
  result["noise_kernels"].update(threefry_rounds_ns_per_gaussian=0.5,
                                 normal_pairs_ns_per_gaussian=0.9,
                                 add_noise_ns_per_gaussian=1.0)
  assert "the Threefry-2x32-20 rounds 0.50 ns per" in report.markdown(result)
  del result["noise_kernels"]
  assert ("| mlp | ≤ 1.15 | 1.50 ✗ | 1.40 ✗ | 1.20 ✓ | 0.25 ✓ | 0.20 ✓ |"
          in md)
  paths = report.write(result, tmp_path, "t")
  saved = json.loads((tmp_path / "t.json").read_text())
  assert saved["summary"]["mlp"]["overhead_ratio"] == pytest.approx(0.25)
  assert (tmp_path / "t.md").exists() and len(paths) >= 2


def test_profile_attributes_op_time_to_the_fused_noise_kernel():
  from benchmarks import profile  # pylint: disable=g-import-not-at-top
  from tf_pxg import native  # pylint: disable=g-import-not-at-top
  times = profile.profile("mlp", "noise", steps=2, batch=4)
  # The fused Threefry noise: the native op (one per weight tensor) where
  # it builds, else one XLA cluster.
  kernel = ("TfPxgAddNormalNoise" if native.library() is not None else
            "XlaLaunch")
  noise = [v for k, v in times.items() if k.endswith(":" + kernel)]
  assert noise and all(us > 0 and calls >= 2 for us, calls in noise)
  lines = profile.report(times, steps=2, top=3)
  assert len(lines) <= 3 and kernel in "".join(lines)


def test_tape_benchmark_steps_and_comparison():
  from benchmarks import tape_benchmark  # pylint: disable=g-import-not-at-top
  fns = tape_benchmark.steps("mlp", 8)
  plain, (dp, norms) = fns["plain"].fn(), fns["dp"].fn()
  assert [p.shape for p in plain] == [d.shape for d in dp]
  assert norms.shape == (8,)
  # The clipped sum of 8 examples at C = 1 has norm <= 8.
  assert float(tf.linalg.global_norm(dp)) <= 8.0 + 1e-4
  line = tape_benchmark.compare("mlp", 8, rounds=1)
  assert line.startswith("tape mlp B=8") and "wall" in line


def test_native_sampling_times_the_ops_code_on_one_core():
  from benchmarks import limits  # pylint: disable=g-import-not-at-top
  times = limits.native_sampling()  # this machine has g++
  keys = ("threefry_rounds_ns_per_gaussian", "normal_pairs_ns_per_gaussian",
          "add_noise_ns_per_gaussian")
  assert sorted(times) == sorted(keys)
  # Timings only: their order is not asserted (a shared machine's load can
  # reorder close measurements); they must be real durations.
  assert all(math.isfinite(times[k]) and times[k] > 0 for k in keys)


# The real architectures (issue 22), at the tiny size of `Spec.tiny`.


@pytest.mark.parametrize("name", models.REAL_MODELS)
def test_real_models_train_a_dp_step_and_a_plain_step_at_tiny_size(name):
  """Keras 3's non-private fit step and tf_pxg's DP fit step both run on
  the real architecture's tiny size: the DP step changes every weight (the
  noise), the plain step most (behind ConvNeXt's LayerScale, initialised
  to 1e-6, a step of SGD(0.01) is below float32's resolution)."""
  for mode in ("keras", "pxg"):
    step = modes.make(mode, name, 4, size="tiny")
    variables = step.model.trainable_variables
    before = [v.numpy().copy() for v in variables]
    modes.sync(step.fn())
    after = [v.numpy() for v in variables]
    assert all(np.isfinite(a).all() for a in after), (name, mode)
    changed = sum(not np.array_equal(a, b) for a, b in zip(before, after))
    least = len(variables) if mode == "pxg" else 0.9 * len(variables)
    assert changed >= least, (name, mode, changed, len(variables))


@pytest.mark.parametrize("name", models.HUB_MODELS)
def test_finetune_models_train_a_dp_step_and_a_plain_step_at_tiny_size(
    name):
  """The KerasHub fine-tuning models (issue 28) at the tiny size: Keras'
  step and tf_pxg's DP step run; the DP step changes every trainable
  weight (the noise). LoRA trains only query and value; the causal LM's
  labels are the next tokens."""
  pytest.importorskip("keras_hub")
  x, y = models.batch(name, 4, size="tiny")
  if models.SPECS[name].lm:
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
  for mode in ("keras", "pxg"):
    step = modes.make(mode, name, 4, size="tiny")
    variables = step.model.trainable_variables
    if name.endswith("_lora"):
      # enable_lora: the LoRA factors and the biases of query and value.
      assert any("lora_kernel" in v.path for v in variables)
      assert all(v.path.split("/")[-2] in ("query", "value")
                 for v in variables), [v.path for v in variables]
    before = [v.numpy().copy() for v in variables]
    modes.sync(step.fn())
    after = [v.numpy() for v in variables]
    assert all(np.isfinite(a).all() for a in after), (name, mode)
    if mode == "pxg":
      assert all(not np.array_equal(a, b) for a, b in zip(before, after))


def test_report_renders_the_finetune_table():
  ok = lambda ms, **kw: dict(  # noqa: E731
      {"status": "ok", "ms": ms, "cpu_ms": ms}, **kw)
  growth = [{"model": "gpt2_lora", "axis": "seq_len", "size": 256,
             "batch_size": 8, "load_before": [3.0], "load_after": [4.0],
             "modes": {"keras": ok(1000.0),
                       "pxg": ok(1050.0, ratio=1.05, cpu_ratio=1.04,
                                 ratio_min_max=[1.0, 1.2])},
             "memory": {"keras": {"status": "ok", "alloc_peak_mb": 900.0},
                        "pxg": {"status": "ok", "alloc_ratio": 1.3,
                                "rss_growth_ratio": 1.1}}},
            {"model": "gpt2_ft", "axis": "seq_len", "size": 128,
             "batch_size": 8, "modes": {"keras": ok(10.0), "pxg": {
                 "status": "unsupported", "error": "NotImplementedError"}}}]
  md = report.markdown({"settings": {"size": "small"}, "growth": growth})
  assert ("| GPT-2 causal LM, LoRA (`gpt2_lora`) | 4 × 768 | 8 | 256 | 1000 ms | "
          "1050 ms | 1.05 ✓ (1.04×) [1.00×–1.20×] | 1.30 ✗ (1.10×) | "
          "900 MB | [3.0] → [4.0] |") in md
  assert "pxg: unsupported NotImplementedError" in md
  assert md.index("`gpt2_ft`") < md.index("`gpt2_lora`")


def test_keras_tfconv_runs_grouped_convs_on_tfs_kernels_with_equal_loss():
  """The second ConvNeXt baseline: Keras' step with grouped convolutions on
  TF's Conv2D kernels instead of Keras' XLA-compiled function takes the
  same first step (same weights and batch: same loss), and a DP mode gets
  its ratio to it."""
  keras_loss = float(modes.make("keras", "convnext", 4, size="tiny").fn()[
      "loss"])
  tfconv = modes.make("keras_tfconv", "convnext", 4, size="tiny")
  assert tfconv.info["first_loss"] == pytest.approx(keras_loss, rel=1e-5)
  modes.sync(tfconv.fn())
  results = {"pxg": {"status": "ok", "round_ms": [2.0, 4.0],
                     "round_cpu_ms": [2.0, 4.0]},
             "keras": {"status": "ok", "round_ms": [1.0, 1.0],
                       "round_cpu_ms": [1.0, 1.0]},
             "keras_tfconv": {"status": "ok", "round_ms": [2.0, 2.0],
                              "round_cpu_ms": [2.0, 2.0]}}
  timing.add_ratios(results)
  assert results["pxg"]["ratio"] == 3.0
  assert results["pxg"]["ratio_to"]["keras_tfconv"]["ratio"] == 1.5


def test_real_models_full_sizes_are_the_issues_architectures():
  """Weights of the full sizes (built, not trained): ConvNeXtTiny 28M,
  WRN-16-4 2.7M, ViT-S/4 at d=384 and the BERT-style encoder with its
  30000 x 256 embedding; the tiny sizes are small."""
  import keras  # pylint: disable=g-import-not-at-top
  counts = {name: models.build(keras, name).count_params()
            for name in ("convnext", "wrn_gn")}
  assert counts == {"convnext": 27_827_818, "wrn_gn": 2_748_890}
  for name in models.REAL_MODELS:
    tiny = models.build(keras, name, size="tiny")
    assert tiny.count_params() < 20_000, name
    x, _ = models.batch(name, 2, size="tiny")
    assert tiny(x).shape == (2, models.SPECS[name].classes)


def test_profile_families_split_a_dp_step_from_its_graph():
  """`profile.graph_families` finds the clip factors, the norms before
  them, the weighted sums after them and the noise in tf_pxg's DP step of
  a tiny real model; Keras' step has only forward, backward, optimizer."""
  from benchmarks import profile  # pylint: disable=g-import-not-at-top
  dp = profile.profile_families("bert", "pxg", steps=1, batch=3,
                                size="tiny")
  fams = dp["families"]
  assert set(fams) == set(profile.FAMILIES)
  for fam in ("forward", "backward", "clip norms", "weighted sums", "noise"):
    assert fams[fam] > 0, (fam, fams)
  assert dp["op_ms_per_step"] == pytest.approx(sum(fams.values()))
  plain = profile.profile_families("bert", "keras", steps=1, batch=3,
                                   size="tiny")["families"]
  assert plain["clip norms"] == plain["weighted sums"] == plain["noise"] == 0
  assert plain["forward"] > 0 and plain["backward"] > 0
  assert plain["optimizer"] > 0


def test_profile_attribute_strips_call_prefixes_and_uses_scopes():
  from benchmarks import profile  # pylint: disable=g-import-not-at-top
  family = {"gradient_tape_4/MatMul": "backward", "cond_3": "optimizer",
            "m/dense/MatMul": "forward", "m/dense/BiasAdd": "forward",
            "StatefulPartitionedCall": "clip norms"}
  scopes = profile._scope_families(family)  # pylint: disable=protected-access
  assert profile.attribute("StatefulPartitionedCall/gradient_tape_4/MatMul",
                           family, scopes) == "backward"
  assert profile.attribute("cond_3/then/_5/cond_3/sgd/Mul", family,
                           scopes) == "optimizer"
  assert profile.attribute("m/dense/ArithmeticOptimizer/AddOps", family,
                           scopes) == "forward"
  assert profile.attribute("nowhere", family, scopes) == "other"


def test_time_group_names_the_mode_that_killed_its_process():
  from benchmarks import time_group  # pylint: disable=g-import-not-at-top
  log = ("    building keras\n    built keras in 1.0 s\n"
         "    building tfp_dpmodel\nfree(): invalid size\n")
  assert time_group._building(log) == "tfp_dpmodel"  # pylint: disable=W0212
  log += "    tfp_dpmodel: error: TypeError: x\n"
  assert time_group._building(log) is None  # pylint: disable=W0212


def test_jax_anchor_records_statuses_instead_of_raising(monkeypatch):
  """No package index: every jax-privacy mode gets an `unavailable`
  record; a process that ran out of memory or died gets its status."""
  from benchmarks import jax_anchor  # pylint: disable=g-import-not-at-top
  from benchmarks import venv  # pylint: disable=g-import-not-at-top

  def no_index(log=print):
    raise subprocess.CalledProcessError(
        1, "pip", stderr="ERROR: No matching distribution found for "
        "jax-privacy==2.0.0")
  monkeypatch.setattr(venv, "ensure_jax", no_index)
  out = jax_anchor.run_time("wrn_gn", 4, 1, 0.01, size="tiny")
  assert set(out) == set(jax_anchor.JAX_MODES)
  assert all(r["status"] == "unavailable" and "No matching" in r["error"]
             for r in out.values())
  mem = jax_anchor.run_memory("jaxp_dpmodel", "wrn_gn", 4, size="tiny")
  assert mem["status"] == "unavailable" and mem["mode"] == "jaxp_dpmodel"
  oom = subprocess.CompletedProcess(
      [], 1, stdout="", stderr="jax.errors.JaxRuntimeError: "
      "RESOURCE_EXHAUSTED: Out of memory allocating 238906983808 bytes.")
  r = jax_anchor._failure(oom, "x")  # pylint: disable=protected-access
  assert r["status"] == "out of memory" and "238906983808" in r["error"]
  killed = subprocess.CompletedProcess([], -9, stdout="", stderr="")
  assert "signal 9" in jax_anchor._failure(killed, "x")["error"]  # pylint: disable=W0212


@pytest.mark.skipif(not os.environ.get("TF_PXG_BENCH_JAX"),
                    reason="set TF_PXG_BENCH_JAX=1 (needs benchmarks/"
                    ".venv-jaxp or the package index; about a minute)")
def test_jax_anchor_times_jax_privacy_on_a_tiny_model():
  from benchmarks import jax_anchor  # pylint: disable=g-import-not-at-top
  out = jax_anchor.run_time("wrn_gn", 4, 2, 0.05, size="tiny")
  assert out["keras_jax"]["status"] == "ok", out
  assert out["jaxp_dpmodel"]["status"] == "ok", out
  assert out["jaxp_dpmodel"]["ratio"] > 0
  assert "jax_privacy 2.0.0" in out["jaxp_dpmodel"]["path"]


def test_report_renders_the_real_architectures_table(tmp_path):
  ok = lambda ms, ratio=None, **kw: dict(  # noqa: E731
      {"status": "ok", "ms": ms, "cpu_ms": ms}, **(
          {"ratio": ratio, "cpu_ratio": ratio} if ratio else {}), **kw)
  result = {
      "date": "2026-01-01T00:00:00+00:00",
      "machine": {"model_name": "CPU", "cores": 2, "mem_total_gb": 1.0},
      "settings": {"quick": False, "rounds": 1},
      "time": {"wrn_gn": {"batch_size": 32, "seq_len": None,
                          "load_before": [1.0, 1.0, 1.0],
                          "load_after": [2.0, 1.0, 1.0], "modes": {
          "keras": ok(200.0), "pxg": ok(300.0, 1.5),
          "noise": ok(1.0, weights=2_748_890),
          "tf_keras": ok(100.0),
          "tfp_dpmodel": ok(3000.0, 30.0, path="vectorized fallback"),
          "keras_jax": ok(500.0), "jaxp_dpmodel": {
              "status": "out of memory", "error": "RESOURCE_EXHAUSTED"}}}},
      "memory": {"wrn_gn": {
          "pxg": {"status": "ok", "alloc_ratio": 1.1, "rss_growth_ratio":
                  1.2},
          "jaxp_dpmodel": {"status": "ok", "rss_growth_ratio": 2.0,
                           "rss_ratio": 1.5}}},
      "profile": {"wrn_gn": {
          "keras": {"status": "ok", "batch_size": 32, "steps": 2,
                    "op_ms_per_step": 10.0, "families": {
                        "forward": 4.0, "backward": 6.0}},
          "pxg": {"status": "ok", "batch_size": 32, "steps": 2,
                  "op_ms_per_step": 15.0, "families": {
                      "forward": 4.0, "backward": 3.0, "clip norms": 2.0,
                      "weighted sums": 5.0, "noise": 1.0}}}},
  }
  md = report.markdown(result)
  assert ("| WRN-16-4 GN (`wrn_gn`, B=32, 2.7M weights) | 1.50× (1.50×) "
          "(300 ms / 200 ms) | 30.00× (30.00×) fallback (3000 ms / 100 ms) "
          "| out of memory | 1.10× (RSS growth 1.20×) | – | 2.00× (RSS "
          "1.50×) | ≤ 1.2× ✗ | [1.0, 1.0, 1.0] → [2.0, 1.0, 1.0] |") in md
  assert "jaxp_dpmodel: out of memory: RESOURCE_EXHAUSTED" in md
  assert "| clip norms | – | 2.0 | 13% |" in md
  assert "| **all ops** | 10.0 | 15.0 | 1.50× Keras |" in md
  report.write(result, tmp_path, "real")
  assert (tmp_path / "real.md").exists()


def test_recsys_steps_update_the_rows_each_mode_should():
  """benchmarks/recsys.py at tiny size: every mode steps; the non-private
  step changes only the batch's rows, dense DP-SGD every row, DP-FEST
  exactly its fixed rows, DP-AdaFEST every row at tau = -1e9 (p = 1) and
  none at a huge tau; the AUC against hand-counted pairs."""
  from benchmarks import recsys  # pylint: disable=g-import-not-at-top
  num_rows, seq_len, batch = 300, 4, 8
  hist, cand, label = recsys.make_data(batch, num_rows, seq_len, 1.05, 0)
  assert hist.max() < num_rows and cand.min() >= 0
  model = recsys.build_model(num_rows, 8, seq_len, 0)
  fixed = [((tf.constant(hist), tf.constant(cand)), tf.constant(label))]
  touched = set(hist.ravel().tolist()) | set(cand.tolist())
  steps, info = recsys.make_steps(
      model, ["keras", "dense", "fest", "adafest"], 1.0, batch, 16, -1e9,
      3.0, 1.0, 0.1, 0)
  changed = recsys.rows_updated(model, steps, fixed, list(steps))
  assert changed["dense"] == num_rows
  assert 0 < changed["keras"] <= len(touched)
  assert changed["fest"] == 16
  assert changed["adafest"] == num_rows
  assert info["false_positive_rate"] == 1.0
  steps, info = recsys.make_steps(model, ["adafest"], 1.0, batch, 16, 1e9,
                                  3.0, 1.0, 0.1, 0)
  assert recsys.rows_updated(model, steps, fixed, ["adafest"]) == {
      "adafest": 0}
  assert info["false_positive_rate"] == 0.0
  assert recsys.auc(np.array([0, 1, 0, 1.0]),
                    np.array([0.1, 0.9, 0.2, 0.8])) == 1.0
  assert recsys.auc(np.array([0, 1, 0, 1.0]),
                    np.array([0.3, 0.2, 0.1, 0.4])) == 0.75
