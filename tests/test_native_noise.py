"""The native noise op (tf_pxg.native): its definition, its agreement with
the XLA kernel, where it is used, and how it is built and falls back.

The reference is the definition in `tf_pxg.dp.threefry`'s docstring,
evaluated in float64 NumPy on the Threefry words (whose known answers
`tests/test_noise.py` checks). The op must build on every machine of this
kind (it has g++); run with TF_PXG_NATIVE=0 to test without it.
"""

import logging
import math
import os
import pathlib
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import native
from tf_pxg.dp import threefry
from _normality import KS_CRITICAL, N, ks_critical, ks_statistic

KEY = (0x9E3779B9, 0x7F4A7C15, 12345)
# float32 samples reach |z| = 6.76: a few ulps of that, per unit stddev.
ATOL = 4e-6


@pytest.fixture(scope="module")
def lib(native_ops):
  return native_ops


def _key():
  return tf.constant(KEY, tf.uint32)


def _definition(start: int, n: int, stddev: float) -> np.ndarray:
  """Elements start.. of the draw, from the docstring's formulas."""
  e = np.arange(start, start + n, dtype=np.uint64)
  u32 = lambda v: tf.constant(v, tf.uint32)  # noqa: E731
  a, b = threefry.threefry2x32(u32(KEY[0]), u32(KEY[1]),
                               u32((e >> 1).astype(np.uint32)),
                               tf.fill([n], u32(KEY[2])))
  a = a.numpy().astype(np.float64)
  theta = 2 * np.pi * b.numpy().astype(np.float64) / 2**32
  r = np.sqrt(-2 * np.log((a + 0.5) / 2**32))
  return stddev * np.where(e % 2 == 0, r * np.cos(theta), r * np.sin(theta))


@pytest.mark.parametrize("start, n", [(0, 1), (1, 1), (0, 2), (3, 129),
                                      (6, 10_000),
                                      (threefry.MAX_ELEMENTS - 300, 300)])
def test_op_and_xla_kernel_follow_the_definition(lib, start, n):
  want = _definition(start, n, 0.7)
  got = lib.tf_pxg_add_normal_noise(tf.zeros([n]), _key(), 0.7, 1.0,
                                    start=start)
  np.testing.assert_allclose(got, want, rtol=0, atol=0.7 * ATOL)
  xla = threefry._add_normal_noise([tf.zeros([n])], (start,), _key(),
                                   tf.constant(0.7), tf.constant(1.0))[0]
  np.testing.assert_allclose(xla, want, rtol=0, atol=0.7 * ATOL)


def test_the_op_adds_to_the_tensor_in_place_of_a_copy(lib):
  base = tf.reshape(tf.range(24, dtype=tf.float32), [4, 6])
  noisy = lib.tf_pxg_add_normal_noise(base, _key(), 2.0, 1.0, start=5)
  assert noisy.shape == base.shape
  np.testing.assert_allclose(noisy - base,
                             _definition(5, 24, 2.0).reshape(4, 6), rtol=0,
                             atol=2 * ATOL + 1e-5)  # + ulps of base (<= 23)


@pytest.mark.parametrize("jit", [False, True])
def test_scale_multiplies_the_noisy_result_in_the_same_pass(lib, jit):
  # scale (t + s z) for dense tensors and for scattered rows, with the op
  # (jit=False) and with the XLA loop (jit=True).
  del lib
  base = tf.reshape(tf.range(24, dtype=tf.float32), [4, 6])
  rows = tf.IndexedSlices(tf.ones([3, 2]), tf.constant([1, 1, 4]),
                          tf.constant([5, 2]))
  dense, sparse = tf.function(
      lambda: threefry.add_normal_noise([base, rows], _key(), 2.0,
                                        scale=0.25), jit_compile=jit)()
  z = _definition(0, 34, 1.0)
  np.testing.assert_allclose(
      dense, 0.25 * (base.numpy() + 2.0 * z[:24].reshape(4, 6)), rtol=0,
      atol=1e-5)
  np.testing.assert_allclose(
      sparse, 0.25 * (tf.convert_to_tensor(rows).numpy() +
                      2.0 * z[24:].reshape(5, 2)), rtol=0, atol=1e-5)


def test_a_model_draw_is_the_same_with_the_op_and_with_xla(lib):
  # Odd sizes put later tensors at odd starts (mid-pair), and the 3,000 x
  # 257 kernel spans many blocks and threads.
  shapes = [[3, 5], [7], [3000, 257], [1], [64, 33]]
  grads = [tf.fill(s, float(i)) for i, s in enumerate(shapes)]
  eager = threefry.add_normal_noise(grads, _key(), 1.5)
  xla = tf.function(lambda: threefry.add_normal_noise(grads, _key(), 1.5),
                    jit_compile=True)()
  for e, x, g in zip(eager, xla, grads):
    np.testing.assert_allclose(e, x, rtol=0, atol=1.5 * ATOL + 1e-6)
    assert e.shape == g.shape
  flat = tf.concat([tf.reshape(e - g, [-1]) for e, g in zip(eager, grads)],
                   0)
  assert ks_statistic(flat, 1.5) < ks_critical(int(tf.size(flat)))


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_rows_are_scatter_added_onto_the_noise(lib, index_dtype):
  values = tf.reshape(tf.range(12, dtype=tf.float32), [4, 3])
  rows = tf.IndexedSlices(values, tf.constant([2, 0, 2, 4], index_dtype),
                          tf.constant([6, 3], index_dtype))
  (sparse,) = threefry.add_normal_noise([rows], _key(), 0.5)
  xla = tf.function(lambda: threefry.add_normal_noise([rows], _key(), 0.5),
                    jit_compile=True)()[0]
  np.testing.assert_allclose(sparse, xla, rtol=0, atol=1e-5)
  noise = _definition(0, 18, 0.5).reshape(6, 3)
  np.testing.assert_allclose(sparse - tf.convert_to_tensor(rows), noise,
                             rtol=0, atol=1e-5)


def test_many_rows_land_once_whichever_thread_adds_them(lib):
  # Rows spread over the whole table (every thread's share), repeated.
  del lib
  rng = np.random.default_rng(3)
  indices = tf.constant(rng.integers(0, 5000, 3000), tf.int64)
  values = tf.constant(rng.normal(size=[3000, 16]), tf.float32)
  rows = tf.IndexedSlices(values, indices, tf.constant([5000, 16], tf.int64))
  (sparse,) = threefry.add_normal_noise([rows], _key(), 0.0)
  np.testing.assert_allclose(sparse, tf.convert_to_tensor(rows), rtol=0,
                             atol=1e-5)


def test_a_row_index_out_of_range_is_an_error(lib):
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"row index 6 is outside \[0, 6\)"):
    lib.tf_pxg_normal_noise_scatter_add(
        tf.ones([1, 3]), tf.constant([6]), _key(), 1.0, 1.0,
        dense_shape=[6, 3], start=0)


def test_pairs_share_a_radius_and_are_independent_normals(lib):
  z = threefry.normal([N], _key()).numpy().astype(np.float64)
  assert ks_statistic(z, 1.0) < KS_CRITICAL
  cos, sin = z[0::2], z[1::2]
  assert abs(np.corrcoef(cos, sin)[0, 1]) < 5 / math.sqrt(N / 2)
  # cos^2 + sin^2 of a pair is its squared radius, -2 log u1 ~ Exp(1/2).
  radius2 = cos**2 + sin**2
  assert abs(radius2.mean() - 2.0) < 5 * 2.0 / math.sqrt(N / 2)
  assert float(np.max(np.abs(z))) <= math.sqrt(66 * math.log(2))


def _op_types(fn):
  graph = tf.function(fn).get_concrete_function().graph
  return {op.type for op in graph.get_operations()}


def test_used_outside_xla_and_not_inside_it(lib):
  del lib
  dense = lambda: threefry.add_normal_noise([tf.zeros([5])], _key(), 1.0)  # noqa: E731
  assert "TfPxgAddNormalNoise" in _op_types(dense)
  compiled = tf.function(dense, jit_compile=True)
  assert "TfPxgAddNormalNoise" not in _op_types(compiled)
  half = lambda: threefry.add_normal_noise(  # noqa: E731
      [tf.zeros([5], tf.float16)], _key(), 1.0)
  assert "TfPxgAddNormalNoise" not in _op_types(half)


def test_noise_passes_the_tensors_gradient_through(lib):
  del lib
  t = tf.Variable(tf.ones([3, 2]))
  values = tf.Variable(tf.ones([2, 2]))
  with tf.GradientTape() as tape:
    dense, rows = threefry.add_normal_noise(
        [t * 3.0, tf.IndexedSlices(values * 2.0, tf.constant([0, 0]),
                                   tf.constant([3, 2]))], _key(), 1.0,
        scale=0.5)
    loss = tf.reduce_sum(dense) + tf.reduce_sum(rows * [[1.0, 2.0]])
  g_t, g_values = tape.gradient(loss, [t, values])
  np.testing.assert_array_equal(g_t, np.full([3, 2], 1.5))
  np.testing.assert_array_equal(tf.convert_to_tensor(g_values),
                                [[1.0, 2.0], [1.0, 2.0]])


def _failing_compiler(tmp_path):
  script = tmp_path / "broken-cxx"
  script.write_text("#!/bin/sh\necho 'fatal error: no such header' >&2\n"
                    "exit 3\n")
  script.chmod(0o755)
  return str(script)


def test_build_caches_and_reports_compiler_errors(lib, tmp_path, monkeypatch):
  del lib
  path = native.build()  # the library the fixture loaded: not rebuilt
  stamp = os.stat(path).st_mtime_ns
  assert native.build() == path
  assert os.stat(path).st_mtime_ns == stamp
  # Beside it only its build lock and compiler log (no recorded failure).
  stem = os.path.splitext(path)[0]
  assert {p.suffix for p in pathlib.Path(path).parent.glob(
      os.path.basename(stem) + ".*")} == {".so", ".lock", ".log"}
  monkeypatch.setenv("CXX", _failing_compiler(tmp_path))
  with pytest.raises(native.BuildFailed, match=r"broken-cxx exited with "
                     r"status 3: fatal error: no such header"):
    native.build(cache_dir=tmp_path / "broken")
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  with pytest.raises(OSError, match="is not an executable"):
    native.build(cache_dir=tmp_path / "missing")


def test_a_failed_build_falls_back_to_xla_with_a_warning(
    tmp_path, monkeypatch, caplog):
  monkeypatch.delenv("TF_PXG_NATIVE", raising=False)  # also under =0
  monkeypatch.setenv("CXX", _failing_compiler(tmp_path))
  monkeypatch.setenv("TF_PXG_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(native, "_loaded", {})
  with caplog.at_level(logging.WARNING):
    assert native.library() is None
  assert "the TF/XLA fallbacks run" in caplog.text
  assert "no such header" in caplog.text
  assert "tf-pxg build-native --force" in caplog.text
  assert not native.serves(tf.zeros([3]))
  assert "TfPxgAddNormalNoise" not in _op_types(
      lambda: threefry.add_normal_noise([tf.zeros([5])], _key(), 1.0))
  (noisy,) = threefry.add_normal_noise([tf.zeros([50])], _key(), 1.0)
  np.testing.assert_allclose(noisy, _definition(0, 50, 1.0), rtol=0,
                             atol=ATOL)


def test_switched_off_by_the_environment(monkeypatch):
  monkeypatch.setenv("TF_PXG_NATIVE", "0")
  assert not native.enabled()
  assert native.library() is None
  assert not native.serves(tf.zeros([3]))


def test_a_read_only_cache_falls_back_to_the_temporary_directory(
    lib, tmp_path, monkeypatch):
  """A cache directory that cannot be created is passed over for
  `$TMPDIR/tf_pxg-<uid>`, and the library there is found and checked
  (`check_safe`) like any cached one. The library this process built is put
  there first, so the test costs no second compilation (one real build is a
  minute or two; the build into a directory is the same code whatever the
  directory, and `tests/test_native_build.py` tests it)."""
  del lib
  if os.getuid() == 0:
    # root writes through permission bits: use a path under a file.
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    cache = blocked / "cache"
  else:
    blocked = tmp_path / "read-only"
    blocked.mkdir(mode=0o500)
    cache = blocked / "cache"
  built = pathlib.Path(native.build())
  (tmp_path / "tmp").mkdir()
  monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
  monkeypatch.setattr(native.tempfile, "tempdir", None)  # re-read TMPDIR
  fallback = tmp_path / "tmp" / f"tf_pxg-{os.getuid()}"
  fallback.mkdir(mode=0o700)
  shutil.copy2(built, fallback / built.name)
  os.chmod(fallback / built.name, 0o700)
  path = native.build(cache_dir=cache)
  assert path == str(fallback / built.name)
  assert not list(fallback.glob("*.log")), "compiled again"
  assert not cache.exists()
  # A shared library (TF would not register its ops twice in a process).
  with open(path, "rb") as f:
    assert f.read(4) == b"\x7fELF"
