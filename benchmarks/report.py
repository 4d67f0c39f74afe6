"""Writes a suite result as JSON, a PNG bar chart and Markdown tables.

  python -m benchmarks.report benchmarks/results/full.json   # re-render
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import List, Optional

DP_MODES = ("pxg", "pxg_xla", "pxg_naive", "tfp_dpmodel", "tfp_dpmodel_xla",
            "tfp_optimizer", "jaxp_dpmodel")
LABELS = {
    "pxg": "tf_pxg DPModel",
    "pxg_xla": "tf_pxg DPModel, XLA",
    "pxg_naive": "tf_pxg naive (materialised)",
    "noise": "noise alone (tf_pxg)",
    "tfp_dpmodel": "TF Privacy DPModel",
    "tfp_dpmodel_xla": "TF Privacy DPModel, XLA",
    "tfp_optimizer": "TF Privacy DPKerasSGDOptimizer",
    "jaxp_dpmodel": "jax-privacy Keras API (JAX)",
}


def _git_line(git: Optional[dict]) -> str:
  if not git or not git.get("commit"):
    return ""
  dirty = git.get("tf_pxg_uncommitted") or []
  return (f" Code: commit {git['commit']}"
          + (f" with uncommitted changes to {', '.join(dirty)}" if dirty
             else "") + ".")


def _fmt(x: Optional[float], digits: int = 2, suffix: str = "×") -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "–"
  return f"{x:.{digits}f}{suffix}"


def _mode(res: dict, mode: str) -> dict:
  return res.get("modes", {}).get(mode, {})


def _cell(r: dict) -> str:
  """`wall ratio (CPU ratio)`, or the mode's failure status."""
  if not r:
    return "–"
  if r.get("status") != "ok":
    return r.get("status", "?")
  if r.get("cpu_ratio") is None:
    return _fmt(r.get("ratio"))
  return f"{_fmt(r.get('ratio'))} ({_fmt(r.get('cpu_ratio'))})"


def _pair(row: dict, prefix: str, name: str = "time") -> str:
  """`wall (CPU)` of a summary entry."""
  if prefix:
    wall, cpu = row.get(f"{prefix}{name}"), row.get(f"{prefix}cpu_{name}")
  else:
    wall, cpu = row.get(name), row.get(f"cpu_{name}")
  return f"{_fmt(wall)} ({_fmt(cpu)})"


def summary(result: dict) -> dict:
  """Per model: the headline numbers the targets are stated in."""
  out = {}
  for model, res in result.get("time", {}).items():
    ours, theirs = _mode(res, "pxg"), _mode(res, "tfp_dpmodel")
    row = {}
    for kind, ratio, ms in (("", "ratio", "ms"),
                            ("cpu_", "cpu_ratio", "cpu_ms")):
      a, b = ours.get(ratio), theirs.get(ratio)
      row[f"pxg_{kind}ratio"], row[f"tfp_{kind}ratio"] = a, b
      if ours.get(ms) and theirs.get(ms):
        row[f"pxg_over_tfp_{kind}time"] = ours[ms] / theirs[ms]
      if a and b and b > 1:
        row[f"{kind}overhead_ratio"] = (a - 1) / (b - 1)
    jaxp = _mode(res, "jaxp_dpmodel")
    row["jaxp_ratio"], row["jaxp_cpu_ratio"] = (jaxp.get("ratio"),
                                                jaxp.get("cpu_ratio"))
    mem = result.get("memory", {}).get(model, {})
    row["pxg_alloc_ratio"] = mem.get("pxg", {}).get("alloc_ratio")
    row["tfp_alloc_ratio"] = mem.get("tfp_dpmodel", {}).get("alloc_ratio")
    row["pxg_rss_growth_ratio"] = mem.get("pxg", {}).get("rss_growth_ratio")
    row["tfp_rss_growth_ratio"] = mem.get("tfp_dpmodel", {}).get(
        "rss_growth_ratio")
    row["jaxp_rss_growth_ratio"] = mem.get("jaxp_dpmodel", {}).get(
        "rss_growth_ratio")
    out[model] = row
  return out


def markdown(result: dict) -> str:
  """The tables of a result as Markdown."""
  m = result.get("machine", {})
  lines = [
      f"Run {result.get('date')} on {m.get('model_name', '?')} "
      f"({m.get('cores')} cores, {m.get('mem_total_gb')} GB), load average "
      f"{result.get('load_average_start')} at the start, "
      f"{result.get('load_average_end')} at the end; "
      f"{'quick' if result.get('settings', {}).get('quick') else 'full'} run, "
      f"{result.get('settings', {}).get('rounds')} interleaved rounds, "
      f"{result.get('seconds')} s. Versions: "
      + ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
      + (("; jax-privacy's venv: " + ", ".join(
          f"{k} {v}" for k, v in result["versions_jax"].items()))
         if result.get("versions_jax") else "")
      + "." + _git_line(result.get("git")), ""]
  time_res = result.get("time", {})
  if time_res:
    lines += [
        "**Step time**, ratio to the same framework's non-private `fit` "
        "step (Keras 3 for tf_pxg, tf_keras for TF Privacy; XLA modes to "
        "the XLA baseline); median of per-round ratios of wall time, and "
        "in parentheses of process CPU time:", "",
        "| model (batch) | Keras 3 step | " + " | ".join(
            LABELS[k] for k in DP_MODES) + " | noise alone | "
        "tf_pxg / TF Privacy DP step | our overhead / theirs |",
        "|---" * (len(DP_MODES) + 5) + "|"]
    summ = summary(result)
    for model, res in time_res.items():
      size = f"{res['batch_size']}" + (f", T={res['seq_len']}"
                                       if res.get("seq_len") else "")
      base = _mode(res, "keras")
      lines.append(
          f"| {model} ({size}) | "
          f"{_fmt(base.get('ms'), 1, ' ms') if base.get('ms') else _cell(base)}"
          " | " + " | ".join(_cell(_mode(res, k)) for k in DP_MODES) + " | "
          + _cell(_mode(res, "noise")) + " | "
          + _pair(summ[model], "pxg_over_tfp_") + " | "
          + _pair(summ[model], "", "overhead_ratio") + " |")
    paths = {f"{model}: {_mode(res, 'tfp_dpmodel').get('path')}"
             for model, res in time_res.items()
             if _mode(res, "tfp_dpmodel").get("path")}
    lines += ["", "TF Privacy DPModel's path: " + "; ".join(sorted(paths))
              + "."]
    errors = [f"{model} {k}: {r.get('error')}"
              for model, res in time_res.items()
              for k, r in res["modes"].items() if r.get("status") != "ok"]
    if errors:
      lines += ["", "Not run: " + "; ".join(errors) + "."]
    lines.append("")
  lines += _real_lines(result)
  lines += _finetune_lines(result)
  lines += _profile_lines(result)
  lines += _floor_lines(result)
  lines += _target_lines(result)
  growth = result.get("growth", [])
  if growth:
    modes = [k for k in ("pxg", "tfp_dpmodel")
             if any(k in g["modes"] for g in growth)]
    lines += ["**Cost growth**, DP / non-private step:", "",
              "| model | size | " + " | ".join(LABELS[k] for k in modes)
              + " |", "|---|---|" + "---|" * len(modes)]
    for g in growth:
      lines.append(f"| {g['model']} | {g['axis']} {g['size']} | " +
                   " | ".join(_cell(g["modes"].get(k, {})) for k in modes)
                   + " |")
    lines.append("")
  memory = result.get("memory", {})
  if memory:
    modes = [k for k in DP_MODES if any(k in v for v in memory.values())]
    lines += [
        "**Peak memory**, each mode in its own process: TF allocator peak "
        "over a step / the baseline's (RSS peak ratio in parentheses):", "",
        "| model | baseline alloc peak | " + " | ".join(
            LABELS[k] for k in modes) + " |",
        "|---|---|" + "---|" * len(modes)]
    for model, mem in memory.items():
      base = mem.get("keras", {})
      cells = []
      for k in modes:
        r = mem.get(k, {})
        if r.get("status") != "ok":
          cells.append(r.get("status", "–"))
        else:
          cells.append(f"{_fmt(r.get('alloc_ratio'))} "
                       f"({_fmt(r.get('rss_ratio'))})")
      lines.append(f"| {model} | {_fmt(base.get('alloc_peak_mb'), 1, ' MB')}"
                   " | " + " | ".join(cells) + " |")
    lines.append("")
  return "\n".join(lines)


# Issue 28: DP / non-private step of the fine-tuning models; memory 1.2x.
FINETUNE_MEMORY_TARGET = 1.2
FINETUNE_SIZES = {"full": "12 × 768", "small": "4 × 768",
                  "tiny": "tiny"}  # layers x d (`benchmarks.models`)
FINETUNE_TARGETS = {"gpt2_ft": 1.15, "gpt2_lora": 1.1, "bert_ft": 1.15}
FINETUNE_LABELS = {"gpt2_ft": "GPT-2 causal LM, full",
                   "gpt2_lora": "GPT-2 causal LM, LoRA",
                   "bert_ft": "BERT classifier, full"}


def _finetune_rows(result: dict) -> List[dict]:
  """(model, T, batch, timing modes, memory modes, load) of each
  fine-tuning model's measurement: its `time` entry, its growth points."""
  rows = []
  for model, res in result.get("time", {}).items():
    if model in FINETUNE_TARGETS:
      rows.append(dict(model=model, seq_len=res.get("seq_len"),
                       model_size=res.get("model_size"),
                       batch_size=res.get("batch_size"),
                       modes=res.get("modes", {}),
                       memory=result.get("memory", {}).get(model, {}),
                       load=(res.get("load_before"), res.get("load_after"))))
  for g in result.get("growth", []):
    if g["model"] in FINETUNE_TARGETS and g["axis"] == "seq_len":
      rows.append(dict(model=g["model"], seq_len=g["size"],
                       model_size=g.get("model_size"),
                       batch_size=g.get("batch_size"), modes=g["modes"],
                       memory=g.get("memory", {}),
                       load=(g.get("load_before"), g.get("load_after"))))
  return sorted(rows, key=lambda r: (
      list(FINETUNE_TARGETS).index(r["model"]),
      FINETUNE_SIZES.get(r["model_size"] or "", ""), r["seq_len"] or 0))


def _finetune_lines(result: dict) -> List[str]:
  """Issue 28's table: each fine-tuning model and T, the DP step's time
  and peak memory against Keras' non-private step, and the targets."""
  rows = _finetune_rows(result)
  if not rows:
    return []
  size = result.get("settings", {}).get("size", "full")
  lines = [
      "**Fine-tuning** (KerasHub backbones, random weights; layers × d: "
      "12 × 768 is GPT-2 small (vocabulary 50257) and BERT base (30522), "
      "4 × 768 the `small` size (GPT-2's vocabulary 16384)): tf_pxg's DP `fit` step / Keras 3's non-private "
      "`fit` step of the same model in the same process, median of "
      "per-round wall-time ratios (CPU-time ratio; min–max over rounds); "
      "peak memory: TF allocator peak over a step, DP / non-private (RSS "
      f"growth ratio); targets ≤ {', '.join(f'{k} {v}×' for k, v in FINETUNE_TARGETS.items())}, "
      f"memory ≤ {FINETUNE_MEMORY_TARGET}× (✓ met, ✗ missed):", "",
      "| model | layers × d | B | T | Keras step | DP step | time ratio (CPU) [min–max] "
      "| memory ratio (RSS growth) | Keras alloc peak | load before → after |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base, dp = r["modes"].get("keras", {}), r["modes"].get("pxg", {})
    target = FINETUNE_TARGETS[r["model"]]
    if dp.get("status") == "ok" and base.get("status") == "ok":
      lo, hi = dp.get("ratio_min_max", [None, None])
      time_cell = (f"{_met(dp.get('ratio'), target)} "
                   f"({_fmt(dp.get('cpu_ratio'))}) "
                   f"[{_fmt(lo)}–{_fmt(hi)}]")
    else:
      time_cell = "; ".join(f"{k}: {v.get('status')} {v.get('error', '')}"
                            for k, v in (("keras", base), ("pxg", dp))
                            if v.get("status") != "ok") or "–"
    mem, mbase = r["memory"].get("pxg", {}), r["memory"].get("keras", {})
    if mem.get("status") == "ok":
      mem_cell = (f"{_met(mem.get('alloc_ratio'), FINETUNE_MEMORY_TARGET)} "
                  f"({_fmt(mem.get('rss_growth_ratio'))})")
    else:
      mem_cell = mem.get("status", "–")
    lines.append(
        f"| {FINETUNE_LABELS[r['model']]} (`{r['model']}`) | "
        f"{FINETUNE_SIZES.get(r['model_size'] or size, '?')} | "
        f"{r['batch_size']} | {r['seq_len']} | "
        f"{_fmt(base.get('ms'), 0, ' ms')} | {_fmt(dp.get('ms'), 0, ' ms')} "
        f"| {time_cell} | {mem_cell} | "
        f"{_fmt(mbase.get('alloc_peak_mb'), 0, ' MB')} | "
        f"{r['load'][0]} → {r['load'][1]} |")
  return lines + [""]


TARGETS = {"mlp": 1.15, "cnn": 1.4, "embed": 1.2, "transformer": 1.15}


def _floor_lines(result: dict) -> List[str]:
  """The floors per model, in CPU time.

  A DP step adds one Gaussian per weight, so its update is dense:
  * generator floor: 1 + (noise alone) / (non-private step), the noise as
    tf_pxg draws it (generated, scaled and added in one fused pass);
  * memory floor: 1 + weights x (cheapest measured read-modify-write pass
    per float) / (non-private step): what a dense update costs with a free
    generator. A target below it is out of reach on this machine.
  """
  kernels = result.get("noise_kernels") or {}
  pass_ns = min((kernels[k] for k in ("copy_ns_per_float",
                                      "dense_update_ns_per_float")
                 if k in kernels), default=None)
  time_res = result.get("time", {})
  rows = []
  for model, res in time_res.items():
    noise, base = _mode(res, "noise"), _mode(res, "keras")
    if "cpu_ms" not in noise or not base.get("cpu_ms"):
      continue
    floor = 1 + noise["cpu_ms"] / base["cpu_ms"]
    weights = noise.get("weights")
    memory = (None if pass_ns is None or not weights else
              1 + weights * pass_ns * 1e-6 / base["cpu_ms"])
    target = TARGETS.get(model)
    if not target:
      verdict = "–"
    elif memory is not None and target < memory:
      verdict = f"{target}× (below the memory floor: out of reach)"
    elif target < floor:
      verdict = f"{target}× (below the generator floor)"
    else:
      verdict = f"{target}× (above both floors)"
    rows.append(
        f"| {model} | {weights or 0:,} | "
        f"{noise['cpu_ms']:.2f} ms | {base['cpu_ms']:.2f} ms | "
        f"{floor:.2f}× | {_fmt(memory)} | "
        f"{_fmt(_mode(res, 'pxg').get('cpu_ratio'))} | {verdict} |")
  if not rows:
    return []
  lines = ["**The floors.** A DP step adds one Gaussian per weight, so its "
           "update is dense and no clipping engine removes that. In CPU "
           "time the DP / non-private ratio is at least the *generator "
           "floor* 1 + (noise alone) / (non-private step), and with any "
           "generator at least the *memory floor* 1 + weights × (one "
           "read-modify-write pass per float) / (non-private step)."]
  if kernels:
    lines[0] += (
        f" On this CPU (CPU time per element over {kernels['elements']:,}): "
        "tf_pxg's fused Threefry noise "
        f"{kernels.get('threefry_ns_per_gaussian', float('nan')):.2f} ns "
        "per Gaussian (generated, scaled and added; "
        f"{kernels.get('threefry_xla_ns_per_gaussian', float('nan')):.2f} "
        "ns as the XLA loop of XLA-compiled steps); TF's Philox generator "
        f"{kernels['philox_ns_per_word']:.2f} ns per 32-bit word, "
        "Box-Muller on TF kernels "
        f"{kernels['box_muller_ns_per_gaussian']:.2f} ns and TF's own "
        f"normal {kernels['tf_normal_ns_per_gaussian']:.2f} ns per "
        f"Gaussian; one pass over memory {pass_ns:.2f} ns per float.")
    if "threefry_rounds_ns_per_gaussian" in kernels:
      lines[0] += (
          " The native op's sampling code alone, on one core "
          "(`benchmarks/threefry_rounds.cc`): the Threefry-2x32-20 rounds "
          f"{kernels['threefry_rounds_ns_per_gaussian']:.2f} ns per "
          "Gaussian, with the Box-Muller transform "
          f"{kernels['normal_pairs_ns_per_gaussian']:.2f} ns, also added "
          f"into a gradient {kernels['add_noise_ns_per_gaussian']:.2f} ns.")
  lines += ["", "| model | weights | noise alone (CPU) | non-private step "
            "(CPU) | generator floor | memory floor | tf_pxg DP (CPU) | "
            "target |", "|---|---|---|---|---|---|---|---|"] + rows + [""]
  return lines


MEMORY_TARGET = 1.3
OVERHEAD_TARGET = 0.33
# Issue 22's targets for the real architectures (DP / non-private step).
REAL_TARGETS = {"convnext": 1.3, "wrn_gn": 1.2, "vit": 1.2, "bert": 1.2}
REAL_MODELS = ("convnext", "wrn_gn", "vit", "bert", "lstm")
REAL_NAMES = {"convnext": "ConvNeXtTiny", "wrn_gn": "WRN-16-4 GN",
              "vit": "ViT-S/4-style", "bert": "BERT-style encoder",
              "lstm": "LSTM(128)"}


def _status_or(r: dict, text: str) -> str:
  if not r:
    return "–"
  if r.get("status") != "ok":
    return str(r.get("status", "?"))
  return text


def _mem_cell(r: dict, key: str = "alloc_ratio") -> str:
  """A memory ratio cell: `alloc (RSS growth)` or `RSS growth`."""
  if r.get("status") != "ok":
    return _status_or(r, "")
  growth = r.get("rss_growth_ratio")
  if key == "rss_growth_ratio":
    return f"{_fmt(growth)} (RSS {_fmt(r.get('rss_ratio'))})"
  return f"{_fmt(r.get(key))} (RSS growth {_fmt(growth)})"


def _real_lines(result: dict) -> List[str]:
  """Issue 22's table: the real architectures, three libraries."""
  time_res = result.get("time", {})
  models = [m for m in REAL_MODELS if m in time_res]
  if not models:
    return []
  memory = result.get("memory", {})
  rows = []
  for model in models:
    res = time_res[model]
    keras, pxg = _mode(res, "keras"), _mode(res, "pxg")
    tfk, tfp = _mode(res, "tf_keras"), _mode(res, "tfp_dpmodel")
    kjax, jaxp = _mode(res, "keras_jax"), _mode(res, "jaxp_dpmodel")
    mb1 = _mode(res, "jaxp_dpmodel_mb1")
    weights = _mode(res, "noise").get("weights")
    mem = memory.get(model, {})
    target = REAL_TARGETS.get(model)
    tfp_path = tfp.get("path", "")
    tfp_path = (" fallback" if "fallback" in tfp_path else
                " fast path" if "fast" in tfp_path else "")
    size = f"{res['batch_size']}" + (f", T={res['seq_len']}"
                                     if res.get("seq_len") else "")
    ms = lambda r: (f"{r['ms']:.0f} ms" if r.get("ms", 0) >= 10 else  # noqa: E731
                    _fmt(r.get("ms"), 1, " ms") if r.get("ms") else
                    _status_or(r, "–"))
    alt = (pxg.get("ratio_to") or {}).get("keras_tfconv")
    alt_text = ""
    if alt:
      alt_text = (f"; {_fmt(alt['ratio'])} ({_fmt(alt['cpu_ratio'])}) of "
                  "Keras' step with TF's grouped-conv kernels, "
                  f"{ms(_mode(res, 'keras_tfconv'))}")
    alt_mem = (mem.get("pxg", {}).get("alloc_ratio_to") or {}).get(
        "keras_tfconv")
    alt_mem_text = (f"; {_fmt(alt_mem)} of Keras' with TF's grouped convs"
                    if alt_mem else "")
    rows.append(
        f"| {REAL_NAMES.get(model, model)} (`{model}`, B={size}"
        f"{_weights(weights)}) | "
        f"{_status_or(pxg, _cell(pxg) + ' (' + ms(pxg) + ' / ' + ms(keras) + ')' + alt_text)} | "
        f"{_status_or(tfp, _cell(tfp) + tfp_path + ' (' + ms(tfp) + ' / ' + ms(tfk) + ')')} | "
        f"{_status_or(jaxp, _cell(jaxp) + ' (' + ms(jaxp) + ' / ' + ms(kjax) + ')')}"
        f"{'; microbatch_size=1: ' + _status_or(mb1, _cell(mb1) + ' (' + ms(mb1) + ')') if mb1 else ''} | "
        f"{_mem_cell(mem.get('pxg', {}))}{alt_mem_text} | "
        f"{_mem_cell(mem.get('tfp_dpmodel', {}))} | "
        f"{_mem_cell(mem.get('jaxp_dpmodel', {}), 'rss_growth_ratio')}"
        f"{'; microbatch_size=1: ' + _mem_cell(mem['jaxp_dpmodel_mb1'], 'rss_growth_ratio') if mem.get('jaxp_dpmodel_mb1') else ''} | "
        f"{'≤ %s×' % target if target else '–'} "
        f"{_met_mark(alt['ratio'] if alt else pxg.get('ratio'), target)} | "
        f"{res.get('load_before')} → {res.get('load_after')} |")
  errors = [f"`{model}` {k}: {r.get('status')}: {r.get('error')}"
            for model in models
            for k, r in {**time_res[model]["modes"],
                         **{f"{m} (memory)": v for m, v in
                            memory.get(model, {}).items()}}.items()
            if r.get("status") != "ok" and k.split(" ")[0] in
            ("pxg", "tfp_dpmodel", "jaxp_dpmodel", "keras", "tf_keras",
             "keras_jax")]
  lines = [
      "**Real architectures** (issue 22): DP step / the same framework's "
      "non-private step, median of per-round ratios of wall time (CPU time "
      "in parentheses), with the two steps' median wall times; tf_pxg "
      "against Keras 3 (TF backend), TF Privacy's DPModel against tf_keras, "
      "jax-privacy's Keras API against Keras 3 on JAX (its own process, "
      "`jit`). Peak memory, each mode in a process of its own: TF "
      "allocator peak ratio (RSS growth ratio: peak RSS minus RSS before "
      "the first step, over the baseline's), and for JAX, whose CPU client "
      "keeps no allocator statistics, the RSS growth ratio (peak RSS "
      "ratio). Load: the 1/5/15-minute load averages before and after the "
      "model's timing (2 cores). ConvNeXt's 7×7 depthwise convolutions "
      "are grouped `Conv2D`s, which Keras' TF backend compiles with XLA on "
      "CPU (`keras_tfconv` runs them on TF's kernels, as tf_pxg's DP step "
      "does; `benchmarks/modes.py`).", "",
      "| model | tf_pxg | TF Privacy 0.9 DPModel (tf_keras) | jax-privacy "
      "2.0 Keras API (Keras 3, JAX) | memory tf_pxg | memory TF Privacy | "
      "memory jax-privacy | target (tf_pxg wall; ConvNeXt: against Keras "
      "with TF's grouped convs) | load |",
      "|---|---|---|---|---|---|---|---|---|---|"] + rows + [""]
  if errors:
    lines += ["Not measured: " + "; ".join(errors) + ".", ""]
  return lines


def _weights(n: Optional[int]) -> str:
  if not n:
    return ""
  return f", {n / 1e6:.1f}M weights" if n >= 1e5 else f", {n:,} weights"


def _met_mark(value: Optional[float], target: Optional[float]) -> str:
  if value is None or target is None:
    return ""
  return "✓" if value <= target else "✗"


def _profile_lines(result: dict) -> List[str]:
  """Where the time goes: op time per family, Keras' step and tf_pxg's."""
  prof = result.get("profile") or {}
  if not prof:
    return []
  from benchmarks import profile as profile_lib  # noqa: PLC0415
  lines = [
      "**Where the time goes** (`python -m benchmarks.profile --families`): "
      "op time per step under the TF profiler (summed over both cores' "
      "threads, so not wall time), by family: the model's forward pass "
      "and loss; the backward pass that reaches the update without the "
      "clip factors (output gradients through the model; in Keras' step "
      "also the weight gradients, which in the DP step are the weighted "
      "sums; in the DP step also whatever the norms and the sums share); "
      "the clip norms (what only the factors need); the weighted sums "
      "(everything after the factors up to the noise); the noise; the "
      "optimizer's update; other (metrics, shapes, ops not in the graph).",
      ""]
  for model, modes in prof.items():
    keras, pxg = modes.get("keras", {}), modes.get("pxg", {})
    if keras.get("status") != "ok" and pxg.get("status") != "ok":
      lines += [f"`{model}`: not profiled: keras {keras.get('error')}; "
                f"pxg {pxg.get('error')}.", ""]
      continue
    kf, pf = keras.get("families", {}), pxg.get("families", {})
    ktot, ptot = keras.get("op_ms_per_step"), pxg.get("op_ms_per_step")
    lines += [f"`{model}` (batch {pxg.get('batch_size') or keras.get('batch_size')}"
              f", {pxg.get('steps') or keras.get('steps')} steps each):", "",
              "| family | Keras 3 step (ms) | tf_pxg DP step (ms) | share of "
              "DP op time |", "|---|---|---|---|"]
    for fam in profile_lib.FAMILIES:
      k, d = kf.get(fam), pf.get(fam)
      lines.append(
          f"| {fam} | {'–' if k is None else '%.1f' % k} | "
          f"{'–' if d is None else '%.1f' % d} | "
          f"{'–' if d is None or not ptot else '%.0f%%' % (100 * d / ptot)}"
          " |")
    lines.append(
        f"| **all ops** | {'–' if ktot is None else '%.1f' % ktot} | "
        f"{'–' if ptot is None else '%.1f' % ptot} | "
        f"{'–' if not (ktot and ptot) else '%.2f× Keras' % (ptot / ktot)} |")
    lines.append("")
    top = pxg.get("top") or []
    if top:
      lines += ["Largest ops of the DP step (ms per step, family): " + "; ".join(
          f"`{name.rsplit(':', 1)[1]}` {ms:.1f} ({fam})"
          for ms, fam, name in top[:6]) + ".", ""]
  return lines


def _met(value: Optional[float], target: float) -> str:
  if value is None:
    return "–"
  return f"{value:.2f} {'✓' if value <= target else '✗'}"


def _target_lines(result: dict) -> List[str]:
  """Issue 8's targets against this run (✓ met, ✗ missed)."""
  summ = summary(result)
  rows = []
  for model, row in summ.items():
    if model not in TARGETS:
      continue
    t = TARGETS[model]
    rows.append(
        f"| {model} | ≤ {t} | {_met(row.get('pxg_ratio'), t)} | "
        f"{_met(row.get('pxg_cpu_ratio'), t)} | "
        f"{_met(row.get('pxg_alloc_ratio'), MEMORY_TARGET)} | "
        f"{_met(row.get('overhead_ratio'), OVERHEAD_TARGET)} | "
        f"{_met(row.get('cpu_overhead_ratio'), OVERHEAD_TARGET)} |")
  if not rows:
    return []
  return [
      "**Targets** (✓ met, ✗ missed): tf_pxg DP / non-private step, wall "
      f"and CPU; peak memory (allocator) ≤ {MEMORY_TARGET}×; our overhead / "
      f"TF Privacy DPModel's ≤ {OVERHEAD_TARGET}, wall and CPU:", "",
      "| model | time target | wall | CPU | memory | overhead ratio (wall) "
      "| overhead ratio (CPU) |",
      "|---|---|---|---|---|---|---|"] + rows + [""]


def plot(result: dict, path: pathlib.Path) -> Optional[pathlib.Path]:
  """A PNG: time ratio per model and mode, memory ratio, cost growth."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
  time_res = result.get("time", {})
  models = list(time_res)
  modes = [k for k in DP_MODES + ("noise",)
           if any("ratio" in _mode(r, k) for r in time_res.values())]
  width = 0.8 / max(1, len(modes))
  ax = axes[0]
  for i, k in enumerate(modes):
    ys = [_mode(time_res[mo], k).get("ratio", float("nan")) for mo in models]
    ax.bar([j + i * width for j in range(len(models))], ys, width,
           label=LABELS[k])
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_yscale("log")
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))])
  ax.set_xticklabels(models)
  ax.set_ylabel("step time / non-private step (log)")
  ax.set_title("Step time ratio")
  ax.legend(fontsize=7)
  ax = axes[1]
  memory = result.get("memory", {})
  mmodes = [k for k in DP_MODES
            if any("alloc_ratio" in v.get(k, {}) for v in memory.values())]
  mmodels = list(memory)
  width = 0.8 / max(1, len(mmodes))
  for i, k in enumerate(mmodes):
    ys = [memory[mo].get(k, {}).get("alloc_ratio", float("nan"))
          for mo in mmodels]
    ax.bar([j + i * width for j in range(len(mmodels))], ys, width,
           label=LABELS[k])
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_yscale("log")
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(mmodels))])
  ax.set_xticklabels(mmodels)
  ax.set_ylabel("TF allocator peak / non-private (log)")
  ax.set_title("Peak memory ratio")
  ax.legend(fontsize=7)
  ax = axes[2]
  growth = result.get("growth", [])
  for model in dict.fromkeys(g["model"] for g in growth):
    rows = [g for g in growth if g["model"] == model]
    for k, style in (("pxg", "-o"), ("tfp_dpmodel", "--s")):
      ys = [g["modes"].get(k, {}).get("ratio", float("nan")) for g in rows]
      if not all(math.isnan(y) for y in ys):
        ax.plot([g["size"] for g in rows], ys, style,
                label=f"{model} ({rows[0]['axis']}) {LABELS[k]}")
  ax.set_xscale("log", base=2)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xlabel("batch size or sequence length")
  ax.set_ylabel("DP step / non-private step")
  ax.set_title("Cost growth")
  ax.legend(fontsize=7)
  fig.suptitle(f"tf_pxg vs TF Privacy 0.9.0, {result.get('date')}, "
               f"{result.get('machine', {}).get('model_name', '')}")
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def write(result: dict, out_dir: pathlib.Path, stem: str) -> List[pathlib.Path]:
  """Writes `<stem>.json`, `<stem>.png` (if matplotlib) and `<stem>.md`."""
  out_dir.mkdir(parents=True, exist_ok=True)
  result = dict(result, summary=summary(result))
  json_path = out_dir / f"{stem}.json"
  json_path.write_text(json.dumps(result, indent=1) + "\n")
  md_path = out_dir / f"{stem}.md"
  md_path.write_text(markdown(result))
  png = plot(result, out_dir / f"{stem}.png")
  return [p for p in (json_path, png, md_path) if p]


if __name__ == "__main__":
  source = pathlib.Path(sys.argv[1])
  write(json.loads(source.read_text()), source.parent, source.stem)
