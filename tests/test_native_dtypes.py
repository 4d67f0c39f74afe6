"""Every native op with every floating dtype, odd shapes and every mode.

Each op (`tf_pxg.native`) is registered only for the dtypes it implements
(float32 and float64; the noise ops float32), so any other dtype must be
refused by TensorFlow before the kernel runs, never read as another
type's buffer. Each op is called with float16, bfloat16, float32 and
float64 inputs, with shapes that have a size-0 or size-1 dimension and with
strided slices of larger tensors, eagerly, in a `tf.function` and under
XLA: an implemented dtype must give the definition's value (in float64
NumPy; the norm ops' definitions are `tests/test_native_norms.py`'s), and
any other dtype must raise a clean error. XLA has no kernel for the ops
(`native.serves` keeps them out of XLA code): under `jit_compile=True` a
call is refused at compilation or, where TensorFlow runs it outside the
cluster, must still give the definition. Run under the sanitizer
build of `.ci/run`, the calls that do run are also checked for reads and
writes outside their buffers.
"""

from typing import Callable, List, Tuple

import numpy as np
import pytest
import tensorflow as tf

from tf_pxg import native
from test_native_norms import _depthwise_per_example, _per_example_definition

DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16,
          "float32": tf.float32, "float64": tf.float64}
MODES = ("eager", "function", "xla")
# What TensorFlow raises for an input of a dtype an op is not registered
# for, or for an op with no XLA kernel.
REFUSALS = (TypeError, ValueError, tf.errors.InvalidArgumentError,
            tf.errors.NotFoundError, tf.errors.UnimplementedError)
KEY = (0x9E3779B9, 0x7F4A7C15, 7)


@pytest.fixture(scope="module")
def lib(native_ops):
  return native_ops


def _strided(shape: Tuple[int, ...], rng) -> np.ndarray:
  """A strided slice of a larger array (every other entry of axis 1, from
  the second): a view whose rows are not contiguous in its base."""
  big = rng.standard_normal((shape[0], 2 * shape[1] + 1, *shape[2:]))
  return big[:, 1::2]


def _row_sq(x: np.ndarray) -> np.ndarray:
  """Each row's sum of squares (any row count and size, 0 included)."""
  return np.sum(x ** 2, axis=tuple(range(1, x.ndim)))


# Each case: (name, implemented dtypes, make(rng) -> list of
# (call(lib, dtype) -> args builder, want float64 array)).
Case = Tuple[Callable, Callable]


def _rows_cases(rng) -> List[Case]:
  cases = []
  for x in (np.zeros((0, 3)), rng.standard_normal((1, 1)),
            np.zeros((3, 0)), rng.standard_normal((4, 5, 7)),
            _strided((4, 4), rng)):
    want = _row_sq(x)
    cases.append((lambda lib, d, x=x: lib.tf_pxg_row_sum_of_squares(
        tf.constant(x, d)), want))
  return cases


def _scale_cases(rng) -> List[Case]:
  cases = []
  for t, examples in ((np.zeros((0, 3)), 0), (rng.standard_normal((1, 1)), 1),
                      (np.zeros((4, 0)), 2),
                      (rng.standard_normal((6, 5, 2)), 3),
                      (_strided((4, 3), rng), 4)):
    c = rng.uniform(0.1, 2.0, examples)
    k = t.shape[0] // max(examples, 1)
    want = t * np.repeat(c, k).reshape((-1,) + (1,) * (t.ndim - 1))
    cases.append((lambda lib, d, t=t, c=c: lib.tf_pxg_scale_rows(
        tf.constant(t, d), tf.constant(c, d)), want))
  return cases


def _noise_cases(rng) -> List[Case]:
  # stddev 0: the definition is scale * tensor exactly (the draw times 0).
  cases = []
  for t in (np.zeros((0,)), rng.standard_normal((1,)), np.zeros((3, 0)),
            rng.standard_normal((5, 7)), _strided((6, 4), rng)):
    cases.append((lambda lib, d, t=t: lib.tf_pxg_add_normal_noise(
        tf.constant(t, d), tf.constant(KEY, tf.uint32), 0.0, 0.5, start=3),
                  0.5 * t))
  return cases


def _scatter_cases(rng) -> List[Case]:
  cases = []
  for shape, idx in (((0, 3), []), ((1, 1), [0]), ((4, 0), [1, 1]),
                     ((5, 3), [4, 0, 4])):
    values = rng.standard_normal((len(idx),) + shape[1:])
    want = np.zeros(shape)
    for i, row in enumerate(idx):
      want[row] += 2.0 * values[i]
    cases.append((lambda lib, d, v=values, i=idx, s=shape:
                  lib.tf_pxg_normal_noise_scatter_add(
                      tf.constant(v, d), tf.constant(i, tf.int64),
                      tf.constant(KEY, tf.uint32), 0.0, 2.0, dense_shape=s,
                      start=0), want))
  return cases


def _conv_geometries(rng):
  """(x, dz, attrs, examples) for a 2x2 VALID convolution: an empty batch,
  one 2x2 image, three examples of one row each, and a strided slice."""
  out = []
  for n, h, w, c, cout, examples, sliced in (
      (0, 3, 3, 2, 2, 0, False), (1, 2, 2, 1, 1, 1, False),
      (3, 4, 5, 3, 4, 3, False), (2, 4, 3, 2, 3, 2, True)):
    x = (_strided((n, h, w, c), rng) if sliced else
         rng.standard_normal((n, h, w, c)))
    dz = rng.standard_normal((n, h - 1, w - 1, cout))
    out.append((x, dz, dict(ksize=(2, 2), strides=(1, 1), dilations=(1, 1),
                            pads=(0, 0)), examples))
  return out


def _window_cases(rng, op: str, weighted: bool, depthwise: bool
                  ) -> List[Case]:
  """Cases of `tf_pxg_<op>_filter_{sq_norm,weighted_sum}` ("conv2d" or
  "depthwise_conv2d", channel multiplier 1) on `_conv_geometries`."""
  cases = []
  for x, dz, attrs, examples in _conv_geometries(rng):
    window = (attrs["ksize"], attrs["strides"], attrs["dilations"],
              (0, 0, 0, 0), examples)
    if depthwise:
      dz = dz[..., :1].repeat(x.shape[3], axis=3)
      g = (_depthwise_per_example(x, dz, *window, False) if examples else
           np.zeros((0, 2, 2, x.shape[3], 1)))
    else:
      g = (_per_example_definition(x, dz, *window) if examples else
           np.zeros((0, 2, 2, x.shape[3], dz.shape[3])))
    if weighted:
      c = rng.uniform(0.1, 2.0, examples)
      third, want = c, np.einsum("b,b...->...", c, g)
    else:
      third, want = examples, _row_sq(g)
    name = f"tf_pxg_{op}_filter_{'weighted_sum' if weighted else 'sq_norm'}"
    cases.append((lambda lib, d, x=x, dz=dz, t=third, a=attrs, n=name:
                  getattr(lib, n)(tf.constant(x, d), tf.constant(dz, d),
                                  tf.constant(t, d) if weighted else t, **a),
                  want))
  return cases


# Keyed by the op's Python wrapper in the loaded library.
OPS = {
    "tf_pxg_row_sum_of_squares": (("float32", "float64"), _rows_cases),
    "tf_pxg_scale_rows": (("float32", "float64"), _scale_cases),
    "tf_pxg_add_normal_noise": (("float32",), _noise_cases),
    "tf_pxg_normal_noise_scatter_add": (("float32",), _scatter_cases),
}
OPS.update({
    f"tf_pxg_{op}_filter_{form}": (
        ("float32", "float64"),
        lambda rng, op=op, form=form: _window_cases(
            rng, op, form == "weighted_sum", op == "depthwise_conv2d"))
    for op in ("conv2d", "depthwise_conv2d")
    for form in ("sq_norm", "weighted_sum")})


def _in_mode(call, mode):
  if mode == "eager":
    return call()
  return tf.function(call, jit_compile=mode == "xla")()


def test_every_native_op_has_a_case():
  # Each of the library's ops (its Python wrappers) has a row in OPS, and
  # every row names one of them.
  lib = native.library()
  if lib is None:
    pytest.skip("the native ops are off or unavailable here")
  wrappers = {n for n in dir(lib) if n.startswith("tf_pxg_") and
              not n.endswith("_eager_fallback")}
  assert wrappers == set(OPS), sorted(wrappers ^ set(OPS))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_gives_its_definition_or_refuses(lib, op, dtype, mode):
  implemented, make = OPS[op]
  d = DTYPES[dtype]
  for call, want in make(np.random.default_rng(sorted(OPS).index(op))):
    if dtype not in implemented:
      with pytest.raises(REFUSALS):
        _in_mode(lambda: call(lib, d), mode)
      continue
    try:
      got = _in_mode(lambda: call(lib, d), mode)
    except REFUSALS:
      if mode != "xla":
        raise
      continue  # no XLA kernel: refused at compilation
    assert got.dtype == d and tuple(got.shape) == want.shape
    scale = 1.0 + float(np.max(np.abs(want), initial=0.0))
    np.testing.assert_allclose(got.numpy(), want, rtol=0,
                               atol=(1e-5 if dtype == "float32" else 1e-12)
                               * scale)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_serves_only_the_implemented_dtypes(dtype):
  # The Python side routes every other dtype to TF's ops (never to a
  # native op that would refuse it).
  if native.library() is None:
    pytest.skip("the native ops are off or unavailable here")
  t = tf.zeros([2], DTYPES[dtype])
  assert native.serves(t) == (dtype == "float32")
  assert native.serves(t, (tf.float32, tf.float64)) == (
      dtype in ("float32", "float64"))


def test_window_attrs_out_of_range_are_refused(lib):
  x = tf.zeros([1, 3, 3, 1])
  dz = tf.zeros([1, 2, 2, 1])
  for bad in (dict(ksize=(0, 2)), dict(strides=(1, -1)),
              dict(dilations=(0, 1)), dict(pads=(-1, 0)),
              dict(ksize=(2, 2, 2))):
    attrs = dict(ksize=(2, 2), strides=(1, 1), dilations=(1, 1),
                 pads=(0, 0))
    attrs.update(bad)
    for op in (lib.tf_pxg_conv2d_filter_sq_norm,
               lib.tf_pxg_depthwise_conv2d_filter_sq_norm):
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="ksize|strides|dilations|pads"):
        op(x, dz, 1, **attrs)
