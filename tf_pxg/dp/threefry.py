"""Gaussian noise from a counter-based generator, fused into one pass.

DP-SGD adds one Gaussian per weight per step. With TF's kernels that costs
Philox words, then a Box-Muller transform that makes one pass over memory
per op, which on CPU can be as much as half of a non-private MLP step
(measured costs per Gaussian: docs/benchmarks.md, "The floors"). Here each Gaussian is a pure function of its index,
so the generator, the transform, the scaling and the addition to the
gradient fuse into a single loop over the output: no intermediate array
is written, and the loop is vectorised and split over the cores. Two
kernels run that loop: the native op of `tf_pxg.native` (a TF CPU op
built on first use) wherever it can, and an XLA loop (`jit_compile=True`,
also when called from a graph that is not compiled; slower, see
docs/benchmarks.md) in XLA-compiled code, on accelerators, for
float16/bfloat16 and without a compiler.

**The generator.** Threefry-2x32 with 20 rounds (Salmon, Moraes, Dror and
Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011), the
generator JAX uses by default. It passes BigCrush with a wide margin. Its
key is 64 bits, its counter 64 bits, and it needs only 32-bit adds, xors
and rotations. The known-answer vectors of the Random123 reference are
checked in `tests/test_noise.py`.

**The transform.** Element `e` of a draw is

    (a, b) = threefry2x32(key = (k0, k1), counter = (e >> 1, k2))
    r      = sqrt(-2 log u1),  u1 = (a + 1/2) / 2**32  in (0, 1)
    theta  = 2 pi b / 2**32                            in [0, 2 pi)
    z      = r cos(theta) if e is even, r sin(theta) if e is odd

the two outputs of one Box-Muller pair (Box and Muller, 1958), which are
independent N(0, 1) variables. XLA computes each output element on its own
(a fusion does not share work between elements), so this kernel computes
the pair's Threefry block and logarithm once per element; the native op
(`tf_pxg.native`, used where it can run) computes them once per pair.
Both evaluate the same formulas, so they agree to float rounding.

`u1` uses all 32 bits, so the largest `|z|` is `sqrt(2 * 33 ln 2) = 6.76`.
TF's float32 kernels stop at 5.65, since they use 23 bits. The angle is
reduced exactly, in integers: `q = round(b / 2**30) mod 4` quarter turns
and a remainder `x = (b - q 2**30) pi / 2**31` in `[-pi/4, pi/4)`, whose
sine and cosine are minimax polynomials (Cephes `sinf`/`cosf`), accurate
to 1.1e-7. `sin(theta) = cos(theta - pi/2)`: odd elements use
`b - 2**30`, one quarter turn less. The samples are float32, and
float16/bfloat16 tensors get float32 samples cast down. float64 tensors are
not handled here (`tf_pxg.dp.noise` uses TF's float64 kernels for them).

**Keys.** A draw takes a key of three uint32 words `(k0, k1, k2)`: the
Threefry key and the counter's high word. `tf_pxg.dp.noise` draws a fresh
key from the step's `tf.random.Generator` (or derives it from a stateless
seed), so two draws collide only if 96 random bits agree. Tensors in one
call take disjoint counter ranges, so their noises are independent. A
draw may hold at most `2**32 - 1` elements.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg import native

__all__ = ["DTYPES", "MAX_ELEMENTS", "add_normal_noise", "normal",
           "static_shape", "supports", "threefry2x32"]

MAX_ELEMENTS = 2**32 - 1
DTYPES = (tf.float32, tf.float16, tf.bfloat16)

_U32 = tf.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KS_PARITY = 0x1BD11BDA
_TWO_POW_M32 = 2.0**-32


def _rotl(x: tf.Tensor, r: int) -> tf.Tensor:
  return tf.bitwise.bitwise_or(tf.bitwise.left_shift(x, tf.constant(r, _U32)),
                               tf.bitwise.right_shift(x, tf.constant(32 - r,
                                                                     _U32)))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32-20: encrypts the counter `(x0, x1)` under key `(k0, k1)`.

  Args:
    k0, k1: uint32 scalars (or tensors broadcastable with the counter).
    x0, x1: uint32 tensors of one shape, the counter words.

  Returns:
    `(y0, y1)`, uint32 tensors of the counter's shape: 64 random bits per
    counter value.
  """
  xor = tf.bitwise.bitwise_xor
  ks = (k0, k1, xor(xor(k0, k1), tf.constant(_KS_PARITY, _U32)))
  x0 = x0 + ks[0]
  x1 = x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = xor(_rotl(x1, r), x0)
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + tf.constant(i + 1, _U32)
  return x0, x1


def _cos_2pi(b: tf.Tensor) -> tf.Tensor:
  """`cos(2 pi b / 2**32)` for uint32 `b`, float32, within 1.1e-7.

  `q = (b + 2**29) >> 30` is `b / 2**30` rounded, mod 4 (the add wraps),
  and `f = b - q 2**30` (as int32) is in `[-2**29, 2**29)`, so
  `theta = (pi / 2) (q + f / 2**30)` and `x = f pi / 2**31` is in
  `[-pi/4, pi/4)`: `cos(theta)` is `cos x, -sin x, -cos x, sin x` for
  `q = 0, 1, 2, 3`. The reduction is exact; only `f`'s conversion to
  float32 rounds.
  """
  q = tf.bitwise.right_shift(b + tf.constant(1 << 29, _U32),
                             tf.constant(30, _U32))
  f = tf.bitcast(b - tf.bitwise.left_shift(q, tf.constant(30, _U32)),
                 tf.int32)
  x = tf.cast(f, tf.float32) * (math.pi / 2**31)
  z = x * x
  sin = x + x * z * (-1.6666654611e-1 + z * (8.3321608736e-3 +
                                            z * -1.9515295891e-4))
  cos = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (
      -1.388731625493765e-3 + z * 2.443315711809948e-5))
  q = tf.cast(q, tf.int32)
  value = tf.where(q % 2 == 0, cos, sin)
  return tf.where((q == 1) | (q == 2), -value, value)


def _normal_flat(key: tf.Tensor, start: int, n: int) -> tf.Tensor:
  """`n` float32 N(0, 1) samples, elements `start .. start + n - 1`."""
  _check_range(start, n)
  index = tf.range(n, dtype=tf.int64) if start + n > 2**31 - 1 else tf.range(
      n, dtype=tf.int32)
  e = tf.cast(index, _U32) + tf.constant(np.uint32(start), _U32)
  one = tf.constant(1, _U32)
  a, b = threefry2x32(key[0], key[1], tf.bitwise.right_shift(e, one),
                      tf.fill([n], key[2]))
  # Odd elements: sin(theta) = cos(theta - pi/2), a quarter turn is 2**30.
  b = b - tf.bitwise.left_shift(tf.bitwise.bitwise_and(e, one),
                                tf.constant(30, _U32))
  u1 = (tf.cast(a, tf.float32) + 0.5) * _TWO_POW_M32
  return tf.sqrt(-2.0 * tf.math.log(u1)) * _cos_2pi(b)


def _check_range(start: int, n: int) -> None:
  if start + n > MAX_ELEMENTS:
    raise ValueError(
        f"One noise draw holds at most {MAX_ELEMENTS} elements (the Threefry "
        f"counter's low word); this one needs {start + n}. Split the "
        "variables over several add_normal_noise calls.")


def supports(t) -> bool:
  """Whether `add_normal_noise` takes `t`: a tensor (or `IndexedSlices`)
  of a static (dense) shape and a dtype in `DTYPES`."""
  return static_shape(t).is_fully_defined() and t.dtype in DTYPES


def _check(tensors: Sequence[tf.Tensor]) -> None:
  for t in tensors:
    if supports(t):
      continue
    if not static_shape(t).is_fully_defined():
      raise ValueError(
          f"threefry noise needs static shapes; got {t.shape}. Use "
          "tf_pxg.dp.box_muller_normal for tensors of dynamic shape.")
    raise ValueError(
        f"threefry noise is float32 (cast down to float16/bfloat16); got "
        f"{t.dtype.name}.")


@tf.function(jit_compile=True, autograph=False)
def _add_normal_noise(tensors, starts, key, stddev, scale):
  """XLA: a tensor `t` gets `scale (t + s z)`, a `(values, indices, shape)`
  triple `scale scatter_add(s z, indices, values)`, so a sparse gradient is
  never densified on its own (one buffer, one pass). `z` of the `j`-th
  takes the draw's elements `starts[j] ..`."""
  out = []
  for t, start in zip(tensors, starts):
    shape = t[2] if isinstance(t, tuple) else t.shape
    dtype = t[0].dtype if isinstance(t, tuple) else t.dtype
    z = tf.cast((stddev * scale) * tf.reshape(
        _normal_flat(key, start, shape.num_elements()), shape), dtype)
    if isinstance(t, tuple):
      out.append(tf.tensor_scatter_nd_add(z, tf.expand_dims(t[1], -1),
                                          t[0] * tf.cast(scale, dtype)))
    else:
      out.append(t * tf.cast(scale, dtype) + z)
  return out


def _add_native(lib, t, start: int, key, stddev, scale) -> tf.Tensor:
  """The native op's `scale (t + stddev z)` (`IndexedSlices`: rows
  scatter-added)."""
  if isinstance(t, tf.IndexedSlices):
    return lib.tf_pxg_normal_noise_scatter_add(
        t.values, t.indices, key, stddev, scale,
        dense_shape=static_shape(t), start=start)
  return lib.tf_pxg_add_normal_noise(t, key, stddev, scale, start=start)


def add_normal_noise(tensors: Sequence[tf.Tensor], key: tf.Tensor,
                     stddev, scale=1.0) -> List[tf.Tensor]:
  """`scale * (t + stddev * z_t)` for each tensor, `z_t` iid N(0, 1), fused.

  float32 tensors take the native op (`tf_pxg.native`) where it serves:
  outside XLA-compiled code, on CPU, when it builds. Everything else takes
  one XLA call. Both give the same samples up to float rounding.

  Args:
    tensors: float32, float16 or bfloat16 tensors of static shape, or
      `tf.IndexedSlices` of such a dense shape (e.g. an embedding's
      gradient): their rows are added to the noise inside the fused loop
      (repeated indices add up), never densified on their own.
    key: a shape `[3]` uint32 tensor: the Threefry key and the counter's
      high word. Use a fresh random key for every draw.
    stddev: a scalar, the noise's standard deviation (float32).
    scale: a scalar factor applied to the noisy result in the same pass
      (e.g. `1 / batch_size` for a noisy mean); 1 leaves it unscaled.

  Returns:
    A list of dense tensors of the inputs' (dense) shapes and dtypes. The
    draw's elements go to the dense tensors first, then to the
    `IndexedSlices`, each in list order (tensor `j` of that order takes
    elements `sum(sizes[:j]) ..`), so the tensors' noises are independent.

  Raises:
    ValueError: If a shape is not static, a dtype is not float32, float16
      or bfloat16, or the draw would exceed `MAX_ELEMENTS`.
  """
  tensors = list(tensors)
  if not tensors:
    return []
  _check(tensors)
  sparse = [i for i, t in enumerate(tensors)
            if isinstance(t, tf.IndexedSlices)]
  order = [i for i in range(len(tensors)) if i not in sparse] + sparse
  starts = {}
  end = 0
  for i in order:
    starts[i] = end
    end += static_shape(tensors[i]).num_elements()
  _check_range(0, end)
  key = tf.cast(key, _U32)
  stddev = tf.cast(stddev, tf.float32)
  scale = tf.cast(scale, tf.float32)
  result = [None] * len(tensors)
  fused = []
  for i in order:
    t = tensors[i]
    if not isinstance(t, tf.IndexedSlices):
      t = tensors[i] = tf.convert_to_tensor(t)
    if native.serves(t):
      result[i] = _add_native(native.library(), t, starts[i], key, stddev,
                              scale)
    else:
      fused.append(i)
  if fused:
    out = _add_normal_noise(
        [(tensors[i].values, tensors[i].indices, static_shape(tensors[i]))
         if isinstance(tensors[i], tf.IndexedSlices) else tensors[i]
         for i in fused], tuple(starts[i] for i in fused), key, stddev,
        scale)
    for i, t in zip(fused, out):
      result[i] = t
  return result


def static_shape(t) -> Optional[tf.TensorShape]:
  """The static shape of a tensor, or the dense shape of `IndexedSlices`."""
  if not isinstance(t, tf.IndexedSlices):
    return t.shape
  shape = (None if t.dense_shape is None else
           tf.get_static_value(t.dense_shape))
  return (tf.TensorShape(None) if shape is None else
          tf.TensorShape([int(d) for d in shape]))


def normal(shape, key: tf.Tensor, dtype=tf.float32) -> tf.Tensor:
  """A tensor of iid N(0, 1) samples of static `shape` (see module doc)."""
  return add_normal_noise([tf.zeros(shape, dtype)], key, 1.0)[0]
