"""`tf_pxg.data.beam` on the DirectRunner, read back with `PoissonShards`.

Skipped when `apache_beam` is not importable (`pip install tf_pxg[beam]`;
CI installs it). Against closed forms and against the in-memory path:

- law: N = 1000, B = 50, E = 100 epochs of T = 20 steps (2000 steps):
  realised sizes vs Binomial(N, q) (mean, variance, chi-square), inclusion
  counts vs Binomial(2000, q), and independence across examples and steps
  (lag-pair counts), the same checks as the in-memory sampler's
  (`test_sampling.py`, `test_sampling_scale.py`);
- exactness of the writing: every example appears in exactly the steps
  `joined_steps` draws for it (nothing dropped on overflow, nothing added),
  the layout is `poisson.layout`'s (m = max(k, ceil(n / P)), step_end on
  the last), steps in order;
- determinism: the same seed writes byte-identical files, another does not;
- training: a model trained from the shards equals, step for step at
  sigma = 0, the same model fed the same physical batches from memory
  (`poisson_dataset(..., batches=...)`), to 1e-6;
- multi-worker reading: each input pipeline's slices are the global
  batch's rows of its replicas;
- cyclic Poisson sampling (`num_groups` b = 4, q = B b / N, `group_seed`):
  every example joins only steps of one residue mod b (its group), its
  participations a multiple of b apart; that group is the documented keyed
  hash of its id under the group seed (BLAKE2b recomputed here), the same
  in secure mode and whatever the sampling seed; the group sizes are
  Binomial(N, 1/b) (uniform groups), each example's count over its group's
  steps Binomial(T / b, q), each step's size Binomial(|its group|, q);
  exactly the steps `joined_steps` draws for the example's group; the
  manifest records the group seed; b > 1 without a group seed is refused.
"""

import math
import os

import numpy as np
import pytest
import tensorflow as tf

beam = pytest.importorskip("apache_beam")

from tf_pxg import data as dpd  # noqa: E402
from tf_pxg.data import beam as dp_beam  # noqa: E402
from tf_pxg.data import poisson  # noqa: E402

import test_sampling as base  # noqa: E402
import test_sampling_scale as scale  # noqa: E402

N, B = 1000, 50


def _records(n, dim=0, seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for i in range(n):
    feat = {"id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))}
    if dim:
      feat["x"] = tf.train.Feature(float_list=tf.train.FloatList(
          value=rng.randn(dim).astype("float32")))
      feat["y"] = tf.train.Feature(int64_list=tf.train.Int64List(
          value=[int(rng.randint(0, 3))]))
    out.append(tf.train.Example(features=tf.train.Features(
        feature=feat)).SerializeToString())
  return out


def _run(records, out, **config):
  with beam.Pipeline(runner="DirectRunner") as p:
    _ = (p | beam.Create(records)
         | dp_beam.WritePoissonShards(str(out), dp_beam.PoissonConfig(**config)))
  return dpd.PoissonShards(str(out))


def _parse_ids(serialized):
  f = tf.io.parse_example(serialized,
                          {"id": tf.io.FixedLenFeature([], tf.int64)})
  return f["id"], f["id"]


def _steps(shards, dataset=None):
  """Per logical step: its physical batches as (ids, mask) lists."""
  steps, current = [], []
  for ids, _, info in (dataset or shards.dataset(_parse_ids)
                       ).as_numpy_iterator():
    current.append((ids, info[dpd.MASK]))
    if info[dpd.STEP_END][0]:
      steps.append(current)
      current = []
  assert not current
  return steps


@pytest.fixture(scope="module")
def law_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("law")
  records = _records(N)
  shards = _run(records, out, expected_batch_size=B, epochs=100,
                accumulation_steps=2, num_replicas=2, steps_per_shard=250,
                seed=3)
  return records, shards, _steps(shards)


def test_manifest_sizes(law_run):
  _, shards, steps = law_run
  assert shards.num_examples == N and shards.steps_per_epoch == 20
  assert shards.num_groups == 1 and shards.sampling_rate == B / N
  assert shards.group_seed is None
  assert shards.total_steps == 2000 == len(steps)
  assert shards.num_shards == 8
  assert sum(shards.physical_batches) == sum(len(s) for s in steps)
  assert shards.physical_batch_size == dpd.default_physical_batch_size(B, 2, 2)


def test_shards_state_their_event(law_run):
  """The shards' sampler event composed with the mechanism's: the DP-SGD
  event of tf_pxg.accounting at the manifest's rate; other schemas refused."""
  from tf_pxg import accounting  # noqa: PLC0415
  from tf_pxg import mf  # noqa: PLC0415
  from tf_pxg.dp import mechanisms  # noqa: PLC0415
  _, shards, _ = law_run
  event = shards.dp_event(mechanisms.IndependentGaussian(), 1.3, 57)
  assert event == accounting.dp_event(N, B, 1.3, steps=57)
  with pytest.raises(ValueError, match="num_groups=1"):
    shards.dp_event(mechanisms.BandMF(mf.BandedToeplitz(2)), 1.3, 57)


def test_beam_output_has_the_poisson_law(law_run):
  _, shards, steps = law_run
  inc = np.zeros((len(steps), N), bool)
  for t, batches in enumerate(steps):
    for ids, mask in batches:
      real = ids[mask == 1]
      assert not inc[t, real].any()  # no example twice in a step
      inc[t, real] = True
  scale._check_law(inc, B / N)
  scale._check_independent(inc, B / N)


def test_every_example_in_exactly_its_drawn_steps(law_run):
  records, shards, steps = law_run
  got = {}
  for t, batches in enumerate(steps):
    for ids, mask in batches:
      for i in ids[mask == 1]:
        got.setdefault(int(i), []).append(t)
  for i, rec in enumerate(records):
    uid, _ = dp_beam.example_id(rec)
    want = dp_beam.joined_steps(uid, 2000, B / N, 3)
    assert got.get(i, []) == want


def test_layout_and_overflow_carried(tmp_path):
  # P = 4, k = 2: any step with more than 8 examples overflows.
  records = _records(100)
  shards = _run(records, tmp_path, expected_batch_size=10, epochs=20,
                physical_batch_size=4, accumulation_steps=2,
                steps_per_shard=7, seed=4)
  steps = _steps(shards)
  assert len(steps) == 200
  overflowed = 0
  for t, batches in enumerate(steps):
    n = int(sum(m.sum() for _, m in batches))
    assert len(batches) == max(2, math.ceil(n / 4))
    overflowed += len(batches) > 2
    want = sorted(i for i, rec in enumerate(records)
                  if t in dp_beam.joined_steps(
                      dp_beam.example_id(rec)[0], 200, 0.1, 4))
    assert sorted(int(i) for ids, m in batches for i in ids[m == 1]) == want
  assert overflowed > 10  # P(n > 8) = 0.41 at Binomial(100, 0.1)


def test_deterministic_given_the_seed(tmp_path):
  records = _records(200)
  kw = dict(expected_batch_size=20, epochs=2, steps_per_shard=5)

  def contents(d):
    return {f: open(os.path.join(d, f), "rb").read()
            for f in sorted(os.listdir(d))}

  a = contents(_run(records, tmp_path / "a", seed=7, **kw).output_dir)
  b = contents(_run(list(reversed(records)), tmp_path / "b", seed=7,
                    **kw).output_dir)
  c = contents(_run(records, tmp_path / "c", seed=8, **kw).output_dir)
  assert a == b
  assert {k: v for k, v in a.items() if k != "manifest.json"} != {
      k: v for k, v in c.items() if k != "manifest.json"}


def test_identical_records_without_keys_raise(tmp_path):
  records = _records(20) + _records(20)[:1]
  with pytest.raises(Exception, match="identical input records"):
    _run(records, tmp_path, expected_batch_size=20, epochs=1, seed=1)
  # With keys they are distinct examples.
  keyed = list(enumerate(records))
  with beam.Pipeline(runner="DirectRunner") as p:
    _ = (p | beam.Create(keyed) | dp_beam.WritePoissonShards(
        str(tmp_path / "k"), dp_beam.PoissonConfig(20, seed=1)))
  assert dpd.PoissonShards(str(tmp_path / "k")).num_examples == 21


def test_seed_with_secure_mode_raises():
  with pytest.raises(ValueError, match="secure_mode"):
    dp_beam.PoissonConfig(10, seed=1, secure_mode=True)


def _parse_xy(serialized):
  f = tf.io.parse_example(serialized, {
      "x": tf.io.FixedLenFeature([4], tf.float32),
      "y": tf.io.FixedLenFeature([], tf.int64),
      "id": tf.io.FixedLenFeature([], tf.int64)})
  return {"x": f["x"], "id": f["id"]}, f["y"]


def test_model_trained_from_shards_equals_in_memory(tmp_path):
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  records = _records(120, dim=4, seed=1)
  shards = _run(records, tmp_path, expected_batch_size=12, epochs=2,
                accumulation_steps=2, steps_per_shard=4, seed=5)
  parsed = [tf.train.Example.FromString(r).features.feature
            for r in records]
  x = np.array([list(f["x"].float_list.value) for f in parsed], "float32")
  y = np.array([f["y"].int64_list.value[0] for f in parsed])

  def model():
    keras.utils.set_random_seed(0)
    inp = {"x": keras.Input((4,), name="x"),
           "id": keras.Input((), dtype="int64", name="id")}
    h = keras.layers.Dense(5, activation="tanh")(inp["x"])
    m = dpk.DPModel(inp, keras.layers.Dense(3)(h), l2_norm_clip=0.5,
                    noise_multiplier=0.0)
    m.compile(optimizer=keras.optimizers.SGD(0.3),
              loss=keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True))
    m.optimizer.build(m.trainable_variables)
    m.build_accumulator()
    return m

  from_shards = list(shards.dataset(_parse_xy))
  recorded = [poisson.PhysicalBatch(xb["id"].numpy(), info[dpd.MASK].numpy(),
                                    bool(info[dpd.STEP_END][0]))
              for xb, _, info in from_shards]
  sampler = dpd.PoissonSampler(120, 12, accumulation_steps=2, seed=0)
  memory = list(dpd.poisson_dataset(
      sampler, {"x": x, "id": np.arange(120)}, y,
      batches=lambda: recorded))
  a, b = model(), model()
  step_a, step_b = tf.function(a.train_step), tf.function(b.train_step)
  ends = 0
  for batch_a, batch_b in zip(from_shards, memory):
    step_a(batch_a)
    step_b(batch_b)
    if batch_a[2][dpd.STEP_END][0]:
      ends += 1
      for va, vb in zip(a.trainable_variables, b.trainable_variables):
        np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=0,
                                   atol=1e-6)
  assert ends == 20 == int(a.optimizer.iterations.numpy())
  assert len(memory) == len(from_shards)
  moved = max(np.abs(v.numpy() - w).max() for v, w in zip(
      a.trainable_variables, [v.numpy() for v in model().trainable_variables]))
  assert moved > 1e-3  # the test trains something


def test_dp_fit_on_shards_equals_custom_loop(tmp_path):
  import keras  # noqa: PLC0415
  import tf_pxg.keras as dpk  # noqa: PLC0415
  records = _records(96, dim=4, seed=2)
  # P = 8 < B + 4 sqrt(B): overflow happens, and fit must finish the step.
  shards = _run(records, tmp_path, expected_batch_size=8, epochs=3,
                physical_batch_size=8, steps_per_shard=5, seed=9)
  assert sum(shards.physical_batches) > shards.total_steps  # overflowed

  def model():
    keras.utils.set_random_seed(0)
    inp = {"x": keras.Input((4,), name="x"),
           "id": keras.Input((), dtype="int64", name="id")}
    m = dpk.DPModel(inp, keras.layers.Dense(3)(inp["x"]), l2_norm_clip=0.5,
                    noise_multiplier=0.0)
    m.compile(optimizer=keras.optimizers.SGD(0.3),
              loss=keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True))
    return m

  fitted = model()
  fitted.fit(dpd.PoissonShards(shards.output_dir, _parse_xy), epochs=2,
             verbose=0)
  # Keras counts 2 epochs of k T = 12 physical batches; overflowing steps
  # take 2, so fewer than 24 logical steps run, the last one finished
  # from the shards by `finish`.
  target = int(fitted.optimizer.iterations.numpy())
  assert 12 <= target <= 24
  loop = model()
  loop.optimizer.build(loop.trainable_variables)
  loop.build_accumulator()
  step = tf.function(loop.train_step)
  for batch in shards.dataset(_parse_xy):
    step(batch)
    if int(loop.optimizer.iterations.numpy()) == target:
      break
  assert int(loop.optimizer.iterations.numpy()) == target
  for a, b in zip(fitted.trainable_variables, loop.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match="accumulation_steps"):
    model().fit(dpd.PoissonShards(shards.output_dir, _parse_xy),
                accumulation_steps=2, verbose=0)
  # Resuming at a step reads from that step on.
  later = list(shards.dataset(_parse_xy, start_step=7))
  whole = list(shards.dataset(_parse_xy))
  ends = np.cumsum([float(b[2][dpd.STEP_END][0]) for b in whole])
  tail = [b for b, e in zip(whole, np.concatenate([[0], ends[:-1]]))
          if e >= 7]
  assert len(later) == len(tail) < len(whole)
  for a, b in zip(later, tail):
    np.testing.assert_array_equal(a[0]["id"], b[0]["id"])
    np.testing.assert_array_equal(a[2][dpd.MASK], b[2][dpd.MASK])


def test_multi_worker_reading_splits_replica_rows(tmp_path):
  records = _records(80)
  shards = _run(records, tmp_path, expected_batch_size=8, epochs=1,
                num_replicas=4, steps_per_shard=3, seed=6)
  p = shards.physical_batch_size
  whole = list(shards.dataset(_parse_ids).as_numpy_iterator())
  for w in range(2):
    ctx = tf.distribute.InputContext(num_input_pipelines=2,
                                     input_pipeline_id=w,
                                     num_replicas_in_sync=4)
    mine = list(shards.dataset(_parse_ids, ctx).as_numpy_iterator())
    assert len(mine) == 2 * len(whole)
    for g, glob in enumerate(whole):
      for j in range(2):
        rep = 2 * w + j
        rows = slice(rep * p // 4, (rep + 1) * p // 4)
        np.testing.assert_array_equal(mine[2 * g + j][0], glob[0][rows])
        np.testing.assert_array_equal(mine[2 * g + j][2][dpd.MASK],
                                      glob[2][dpd.MASK][rows])
  with pytest.raises(ValueError, match="laid out for 4 replicas"):
    shards.dataset(_parse_ids, tf.distribute.InputContext(1, 0, 2))


# Cyclic Poisson sampling ----------------------------------------------------

NC, BC, GC, EC = 400, 20, 4, 25  # q = 0.2, T = 20, 500 steps, 125 per group


def _joins_by_example(steps):
  got = {}
  for t, batches in enumerate(steps):
    for ids, mask in batches:
      for i in ids[mask == 1]:
        got.setdefault(int(i), []).append(t)
  return got


GROUP_SEED = 2 ** 62 + 12345


def _reference_group(uid, b, group_seed):
  """The documented keyed hash, recomputed here."""
  import hashlib  # noqa: PLC0415
  digest = hashlib.blake2b(uid, key=group_seed.to_bytes(8, "little"),
                           person=b"tf_pxg.group", digest_size=8).digest()
  return int.from_bytes(digest, "little") % b


def test_cyclic_beam_output(tmp_path):
  _check_cyclic_run(tmp_path, seed=9)


def _check_cyclic_run(tmp_path, seed):
  records = _records(NC)
  shards = _run(records, tmp_path, expected_batch_size=BC, epochs=EC,
                steps_per_shard=100, seed=seed, num_groups=GC,
                group_seed=GROUP_SEED)
  q = BC * GC / NC
  assert shards.num_groups == GC and shards.sampling_rate == q
  assert shards.group_seed == GROUP_SEED
  # Whole cycles per epoch: b ceil(N / (B b)).
  assert shards.steps_per_epoch == GC * math.ceil(NC / (BC * GC)) == 20
  total = EC * 20
  steps = _steps(shards)
  assert len(steps) == shards.total_steps == total
  got = _joins_by_example(steps)
  # P(an example never joins its 125 steps) = 0.8^125 ~ 7e-13.
  assert sorted(got) == list(range(NC))
  residue = {}
  for i, joined in got.items():
    r = {t % GC for t in joined}
    assert len(r) == 1, (i, r)  # one group per example
    d = np.diff(joined)
    assert np.all(d % GC == 0) and np.all(d >= GC)
    residue[i] = r.pop()
  # Groups: uniform, sizes Binomial(N, 1/b) (5 standard deviations).
  sizes = np.bincount(list(residue.values()), minlength=GC)
  sd = math.sqrt(NC * (1 / GC) * (1 - 1 / GC))
  assert np.all(np.abs(sizes - NC / GC) < 5 * sd), sizes
  # Each example over its group's total / b steps: Binomial(125, q).
  per_group = total // GC
  counts = np.array([len(got[i]) for i in range(NC)])
  sd = math.sqrt(per_group * q * (1 - q))
  assert np.all(np.abs(counts - per_group * q) < 5 * sd)
  assert abs(counts.mean() - per_group * q) < 5 * sd / math.sqrt(NC)
  assert abs(counts.var(ddof=1) / sd ** 2 - 1) < 5 * math.sqrt(2 / (NC - 1))
  # Each step's size: Binomial(|G_{t mod b}|, q).
  step_sizes = np.array([sum(int(m.sum()) for _, m in batches)
                         for batches in steps])
  for g in range(GC):
    x, n = step_sizes[g::GC], int(sizes[g])
    var = n * q * (1 - q)
    assert abs(x.mean() - n * q) < 5 * math.sqrt(var / len(x))
    assert abs(x.var(ddof=1) / var - 1) < 5 * math.sqrt(2 / (len(x) - 1))
    assert base.binomial_chi_square_p(x, n, q) > 1e-3
  # The group is the keyed hash of the id under the group seed, and the
  # example joins exactly the drawn steps of that group.
  for i, rec in enumerate(records):
    uid, _ = dp_beam.example_id(rec)
    group = dp_beam.example_group(uid, GC, GROUP_SEED)
    assert group == residue[i] == _reference_group(uid, GC, GROUP_SEED)
    assert got[i] == dp_beam.joined_steps(uid, total, q, seed, GC, group)
  # Another group seed, another partition (the sampling seed plays no
  # part in it).
  other = [dp_beam.example_group(dp_beam.example_id(r)[0], GC, 1)
           for r in records]
  assert other != [residue[i] for i in range(NC)]


def test_cyclic_beam_secure_mode_and_errors(tmp_path):
  records = _records(60)
  shards = _run(records, tmp_path, expected_batch_size=5, epochs=4,
                secure_mode=True, num_groups=3, group_seed=GROUP_SEED)
  assert shards.num_groups == 3 and shards.seed is None
  got = _joins_by_example(_steps(shards))
  assert got
  for i, joined in got.items():
    # Secure mode draws the joins from the OS; the groups are still the
    # group seed's.
    uid, _ = dp_beam.example_id(records[i])
    assert {t % 3 for t in joined} == {_reference_group(uid, 3, GROUP_SEED)}
  # b > 1 needs the group seed; b = 1 does not (and writes null).
  with pytest.raises(ValueError, match="needs group_seed"):
    dp_beam.PoissonConfig(5, num_groups=3, secure_mode=True)
  with pytest.raises(ValueError, match=r"group_seed.*\[0, 2\^64\)"):
    dp_beam.PoissonConfig(5, num_groups=3, group_seed=-1)
  # b > floor(N / B) is refused once N is known; the message names it.
  config = dp_beam.PoissonConfig(5, num_groups=13, seed=1, group_seed=2)
  with pytest.raises(ValueError, match=r"largest num_groups is 12 "):
    config.sizes(60)
  assert config.sizes(65)[0] == 5 * 13 / 65
  with pytest.raises(ValueError, match="num_groups"):
    dp_beam.PoissonConfig(5, num_groups=0)
  # A manifest from before cyclic sampling reads as one group.
  import json  # noqa: PLC0415
  old = tmp_path / "old"
  old.mkdir()
  manifest = dict(shards.manifest)
  del manifest["num_groups"], manifest["group_seed"]
  (old / "manifest.json").write_text(json.dumps(manifest))
  assert dpd.PoissonShards(str(old)).num_groups == 1
  assert dpd.PoissonShards(str(old)).group_seed is None
