"""The generated adversary (issue 49, item 4).

`tf_pxg.testing.adversary` composes small models (one Dense kernel W, B=4)
from an op vocabulary and feeds every input position of every op (values,
sizes, depths, shapes, seeds, conditions, slice bounds, multiples, axes,
permutations, row partitions, table keys, indices) from a constant, a
per-example value or a statistic of the whole batch (float or integer, from
the inputs, the token ids or the labels). Each model runs through
`tf_pxg.GradientTape` eagerly, in `tf.function` and under XLA, and must be
either refused with a `ValueError` naming an op, or exact against a plain
`tf.GradientTape` loop over single examples with a replace-one influence on
the clipped sum of at most 2C. A model that trains with influence above 2C is
a LEAK; the failure names the composition and its seeds, which reproduce it:

    from tf_pxg.testing import adversary
    adversary.check_models(["cond[pred=f.maxabs] > W"], seeds=[234],
                           data_seed=2)

Size: `TF_PXG_ADVERSARY_MODELS=N` or `pytest --adversary-models=N` (default
2,000, in shards of 50 that pytest-xdist spreads over its workers). Each
shard's counts go to `$TF_PXG_ADVERSARY_REPORT/shard_<k>.json` when that
variable names a directory.

Every failure the generator has found is a fixed case in `REGRESSIONS`. A
class the engine still leaks would be marked `xfail(strict=True)` there and
listed in `KNOWN_LEAKS`, whose matches among the generated models are
reported, not failed (a fixed class turns its strict xfail into a failure,
which says to remove both). One is open: eagerly, a variable assigned from a
batch statistic before the tape started and read inside it (the eager tape
sees no graph behind a variable's value, and assignments leave no trace in
its handle: docs/threat_model.md "Provenance", not covered). Closed: eager
tf.cond / tf.while_loop predicates (df52507); a statistic computed before
the tape in tf.function and XLA (the classifier walks the step's graph) and
eagerly (the examples declared to the tape, `tf_pxg.interface.pre_tape`);
a variable assigned from one before the tape in tf.function and XLA
(`tf_pxg.interface.written_state`).
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_pxg.testing import adversary as A
from tf_pxg.testing import adversary_models

PER_SHARD = 50
DEFAULT_MODELS = 2000
# Generated models start at this seed (the regression cases below come
# from searches at other seeds; a longer search goes on past the default).
FIRST_SEED = 0


def _n_models(config) -> int:
  opt = config.getoption("--adversary-models", default=None)
  if opt:
    return int(opt)
  return int(os.environ.get("TF_PXG_ADVERSARY_MODELS", DEFAULT_MODELS))


def pytest_generate_tests(metafunc):
  if "shard" in metafunc.fixturenames:
    n = _n_models(metafunc.config)
    metafunc.parametrize("shard", range(math.ceil(n / PER_SHARD)))


# Leak classes the engine does not close yet: (name, mode, predicate on a
# composition). A generated failure in that mode whose composition matches
# is reported as known; each has an xfail(strict=True) case in REGRESSIONS.
def _stat(src):
  return A.is_stat(src)


def _eager_host_branch(comp: A.Composition) -> bool:
  """A Python-side branch or trip count on a batch statistic: eagerly,
  tf.cond and tf.while_loop read their predicate on the host."""
  for step in comp.steps:
    feeds = dict(step.feeds)
    if step.op == "cond" and _stat(feeds.get("pred", "const")):
      return True
    if step.op == "while_loop" and _stat(feeds.get("n", "const")):
      return True
    if (step.op == "assign" and step.variant == 1 and
        _stat(feeds.get("pred", "const"))):
      return True
  return False


def _laundered_statistic(comp: A.Composition) -> bool:
  """A batch statistic assigned to a variable before the tape started
  (`pvf.` / `pvi.` sources), the variable read inside it."""
  return any(src.split(".")[0] in ("pvf", "pvi")
             for step in comp.steps for _, src in step.feeds)


_LAUNDERED = ("eagerly, a batch statistic assigned to a variable before "
              "the tape starts, read inside it, is taken for a constant "
              "(found 2026-12-07, open: not covered)")

KNOWN_LEAKS: list = [
    (_LAUNDERED, "eager", _laundered_statistic),
    # Closed: "a statistic computed before the tape", eagerly (the examples
  # declared to the tape), and "a statistic assigned to a variable before
  # the tape" in tf.function and XLA (the writes behind a graph's reads).
  # Closed: "eager tf.cond / tf.while_loop on a batch statistic
    # (host-side predicate)", mode "eager", predicate _eager_host_branch
    # (refused since df52507: the tape refuses an eager Python read of a
    # data value); "a statistic computed before the tape" in tf.function
    # and XLA (refused in the working tree of 08:25 UTC).
]


def _known(o: A.Outcome):
  comp = A.Composition.parse(o.composition)
  for name, mode, match in KNOWN_LEAKS:
    if o.mode == mode and match(comp):
      return name
  return None


def _report(outcomes, name, seconds, cpu):
  where = os.environ.get("TF_PXG_ADVERSARY_REPORT")
  if where:
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, f"{name}.json"), "w") as fh:
      json.dump({"counts": A.summarize(outcomes), "seconds": seconds,
                 "cpu_seconds": cpu,
                 "failures": [o.describe() for o in outcomes if o.failed]},
                fh, indent=1)


def test_generated_models(shard):
  seeds = list(range(FIRST_SEED + shard * PER_SHARD,
                     FIRST_SEED + (shard + 1) * PER_SHARD))
  cpu = time.process_time()
  outcomes, seconds = A.search(len(seeds), start=seeds[0])
  _report(outcomes, f"shard_{shard}", seconds, time.process_time() - cpu)
  failures = [o for o in outcomes if o.failed]
  new = [o for o in failures if _known(o) is None]
  counts = A.summarize(outcomes)
  print(f"shard {shard}: {counts}; {len(failures) - len(new)} known")
  assert not new, (
      f"{len(new)} model(s) fail (refused by name, or exact with influence "
      "<= 2C, is required); add each to REGRESSIONS:\n" +
      "\n".join(o.describe() for o in new))


# Every failure the generator found, as a fixed case: (composition, model
# seed, data seed). Also the issue's own classes, written in the
# generator's vocabulary, so each is checked in every mode.
def _case(comp, seed=0, data_seed=0):
  """A fixed case, checked in all three modes in one item."""
  return [pytest.param(comp, seed, data_seed, A.MODES, id=comp)]


def _leaky(comp, seed=0, data_seed=0, leaks=("eager",), reason=_LAUNDERED):
  """A case of an open leak class: one item per mode, the modes in
  `leaks` marked xfail(strict=True) (a fix turns them into failures that
  say to remove the mark)."""
  return [pytest.param(
      comp, seed, data_seed, (mode,), id=f"{comp}-{mode}",
      marks=[pytest.mark.xfail(strict=True, reason=reason)]
      if mode in leaks else []) for mode in A.MODES]


REGRESSIONS = sum([
    # Found by the generator (08:10 UTC): a statistic computed before the
    # tape, accepted in every mode (leaks, then inexact ones); tf.function
    # and XLA refuse them since 08:25 UTC, eager mode since the examples
    # are declared to the tape (tf_pxg.interface.pre_tape).
    _case("W > where3[cond=pi.maxid]"),
    _case("W > where3[cond=pf.mean]"),
    _case("W > where3:1[cond=pf.maxabs]"),
    _case("W > binary:1[y=pf.colmean]"),
    _case("W > matmul[m=pf.mean]"),
    _case("W > assign[value=pf.colmean]"),
    _case("one_hot[idx=ex,depth=pi.maxid] > W"),
    _case("W > sequence_mask[lengths=ex,maxlen=pi.lenmax]"),
    _case("W > random[seed=pi.row0]"),
    _case("W > while_loop[n=pi.count,step=const]"),
    _case("W > slice:1[end=pi.lenmax]"),
    # The same, laundered through a variable assigned before the tape:
    # accepted in every mode; tf.function and XLA refuse them since the
    # classifier follows the writes behind a graph's reads
    # (tf_pxg.interface.written_state); eagerly still open.
    _leaky("W > where3[cond=pvi.maxid]"),
    _leaky("W > where3[cond=pvf.mean]"),
    _leaky("W > binary:1[y=pvf.colmean]"),
    _leaky("W > tile[multiples=pvi.count]"),
    # The largest influences of the final 2,000-model run (08:55 UTC).
    _leaky("assign[value=pvf.colmean,pred=const] > W", 50, 2),
    _leaky("W > matmul[m=pvi.count] > reduce:1[axis=const] > "
           "broadcast_to[shape=const]", 686, 2),
    _case("while_loop[n=const,step=const] > binary:1[y=pi.maxid] > "
          "roll[shift=pi.maxid,axis=const] > W", 893, 1),
    _case("while_loop[n=const,step=pf.colmean] > W", 999, 3),
    # Found by the generator (K = 4, before df52507): eager only, a
    # tf.cond / tf.while_loop predicate read on the host; graph and XLA
    # refused them. Leaks (influence above 2C) first, then inexact ones.
    _case("cond[pred=f.maxabs] > W", 234, 2),
    _case("W > while_loop[n=i.count,step=ex]", 0, 0),
    _case("tile[multiples=const] > cond[pred=i.row0] > W", 849, 1),
    _case("cond[pred=i.fromf] > W > while_loop[n=const,step=ex]", 1311, 3),
    _case("while_loop[n=const,step=ex] > cond[pred=f.row0] > W > "
          "reduce:2[axis=const]", 403, 3),
    _case("sort:1[k=const] > cond[pred=f.row0] > W", 586, 2),
    _case("cond[pred=i.count] > W > gather[idx=ex]", 1177, 1),
    _case("slice:1[begin=i.maxid,end=const] > cond[pred=f.ymean] > "
          "broadcast_to[shape=const] > W", 1077, 1),
    _case("cond[pred=f.row0] > W > where3:1[cond=ex]", 368, 0),
    _case("W > cond[pred=f.mean]", 0, 0),
    _case("cond[pred=i.maxid] > W > gather:1[idx=ex]", 280, 0),
    _case("W > unary:2 > cond[pred=i.maxid]", 179, 3),
    _case("while_loop[n=f.row0,step=ex] > W", 241, 1),
    _case("W > cond[pred=f.hmean]", 1920, 0),
    _case("W > while_loop[n=f.hmean,step=ex] > pad[paddings=const,"
          "value=const]", 797, 1),
    # XLA's stateless normal sampler is not TensorFlow's (a generator
    # artefact, fixed in the generator: the model is not mode-invariant).
    _case("W > random:1[seed=const,lo=const]", 1040, 0),
    # The classes.
    _case("one_hot[idx=ex,depth=i.maxid] > W"),
    _case("W > one_hot[idx=ex,depth=i.maxid]"),
    _case("W > slice:1[end=i.lenmax]"),
    _case("W > where3[cond=i.maxid]"),
    _case("W > where3:1[cond=f.mean]"),
    _case("W > tile[multiples=i.maxid]"),
    _case("W > broadcast_to[shape=i.count]"),
    _case("W > bincount[idx=ex,size=i.maxid]"),
    _case("W > random[seed=i.maxid,lo=const]"),
    _case("W > random[seed=f.ymean,lo=const]"),
    _case("W > assign:1[value=f.colmean,pred=const]"),
    _case("W > assign[value=ex]"),
    _case("W > table[keys=ex,values=ex]"),
    _case("W > table:2[keys=const,values=ex]"),
    _case("W > ragged[lengths=i.count]"),
    _case("W > reduce[axis=batch]"),
    _case("W > cumsum[axis=i.maxid]"),
    _case("W > pad[paddings=i.row0,value=f.maxabs]"),
    _case("W > gather:1[idx=i.row0]"),
    _case("W > reshape_transpose[perm=i.maxid]"),
    _case("W > sort:1[k=i.count]"),
    _case("W > where1:1[cond=ex]"),
    _case("W > matmul[m=f.hmean]"),
    _case("embed[ids=i.maxid] > W"),
], [])


@pytest.mark.parametrize("composition,seed,data_seed,modes", REGRESSIONS)
def test_regression(composition, seed, data_seed, modes):
  outcomes = A.check_models([composition], modes=modes, seeds=[seed],
                            data_seed=data_seed)
  failures = [o for o in outcomes if o.failed]
  assert not failures, "\n".join(o.describe() for o in failures)


# The adversary itself ----------------------------------------------------


def test_generator_is_seeded_and_its_compositions_round_trip():
  seen_ops, seen_sources = set(), set()
  for s in range(2000):
    comp = A.generate(s)
    assert A.generate(s) == comp
    assert A.Composition.parse(str(comp)) == comp
    for step in comp.steps:
      seen_ops.add(step.op)
      seen_sources.update(src for _, src in step.feeds)
  assert seen_ops == set(A.VOCABULARY) | {"W"}
  assert seen_sources == {"const", "ex", "batch"} | {
      f"f.{k}" for k in A.F_KINDS} | {f"i.{k}" for k in A.I_KINDS} | set(
          A.PRE_STATS)


def test_every_statistic_moves_when_one_example_is_replaced():
  """Each batch statistic differs between D and D' (example 0 replaced by
  the extreme one), and its flag (the condition the ops branch on) flips,
  so a position fed by it changes the other examples' outputs."""
  d, d2 = A.make_data(0)
  for kind in A.F_KINDS + A.I_KINDS:
    fam = "f" if kind in A.F_KINDS else "i"
    values, flags = [], []
    for x, ids, y in (d, d2):
      ctx = adversary_models._Ctx(x, ids, tf.eye(A.K), y)  # pylint: disable=protected-access
      ctx.h = x
      stat = ctx.fstat(kind) if fam == "f" else ctx.istat(kind)
      values.append(np.asarray(stat))
      flags.append(bool(ctx.flag(f"{fam}.{kind}")))
    if kind == "uniq":     # the count of distinct ids may stay the same
      continue
    assert not np.array_equal(values[0], values[1]), kind
    if kind != "hmean":    # hmean depends on W and the op's place
      assert flags[0] != flags[1], (kind, values)


# Compositions that mix examples, and compositions that keep them apart.
MIXING = ["W > where3[cond=i.maxid]", "W > reduce[axis=batch]",
          "W > cumsum[axis=i.maxid]", "W > while_loop[n=i.count,step=ex]",
          "W > slice:1[end=i.lenmax]", "W > table[keys=ex,values=ex]",
          "W > assign[value=f.mean]", "W > ragged[lengths=i.count]",
          "W > tile[multiples=i.maxid]", "W > cond[pred=f.maxabs]",
          "W > gather:1[idx=i.row0]", "W > sort:1[k=i.count]",
          "W > random[seed=i.maxid,lo=const]", "W > one_hot[depth=i.count]",
          "W > bincount[idx=ex,size=i.count]"]
ROW_WISE = ["W > table:1[keys=ex,values=ex]", "W > ragged[lengths=ex]",
            "W > assign[value=ex]", "W > where1[cond=ex]",
            "W > sort:2 > gather[idx=ex] > one_hot[idx=ex]",
            "W > unary:2 > binary[y=ex] > matmul[m=ex] > embed[ids=ex] > "
            "concat[y=ex]", "W > random[seed=const,lo=const]",
            "W > where3[cond=ex] > cumsum[axis=const]"]


def test_the_judge_catches_an_engine_that_trusts_every_op():
  """The adversary has teeth: judged as if the engine had accepted each
  model and followed the batch (per-example rows of the batch Jacobian),
  every mixing composition fails (leak or inexact) and every row-wise one
  passes."""
  for o in A.unguarded(MIXING + ROW_WISE):
    if o.composition in MIXING:
      assert o.status in ("leak", "inexact"), o.describe()
    else:
      assert o.status == "exact", o.describe()
