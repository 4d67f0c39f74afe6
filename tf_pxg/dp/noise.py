"""Gaussian noise for DP-SGD: small pure functions.

DP-SGD adds `N(0, (noise_multiplier * l2_norm_clip)**2)` noise to each
coordinate of the clipped gradient sum once per global step (Abadi et al.,
2016). These functions draw that noise, split it correctly across
`tf.distribute` replicas, and derive independent per-replica seeds. They work
in eager mode, inside `tf.function` and with `jit_compile=True`.

Randomness comes either from a `tf.random.Generator` (the training default:
`make_generator()` seeds it from OS entropy; create it inside the strategy
scope so every replica gets its own stream) or from a stateless seed, a shape
`[2]` integer tensor (reproducible, for tests). Either source only supplies
a fresh 96-bit key per call: the samples of float32/float16/bfloat16
tensors come from the fused Threefry kernels of `tf_pxg.dp.threefry` (the
native op about 9x, the XLA loop about 3x cheaper on CPU than TF's normal
kernels); float64 tensors and tensors of dynamic shape use TF's kernels.

Secure mode (`tf_pxg.dp.secure.make_noise_source(secure_mode=True)`,
`secure_mode=True` on the DP models and `DPOptimizer`): a
`tf_pxg.dp.secure.SecureNoiseSource` in place of the generator draws every
key from the OS CSPRNG and sums four Gaussians per coordinate against
floating-point attacks (see `tf_pxg.dp.secure`). `add_gaussian_noise`
hands the draw to any source that has its own `add_gaussian_noise`
method (duck typing: this module does not import `secure`, which imports
it).

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
"""

import hashlib
import math
from typing import List, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_pxg.dp import threefry

__all__ = [
    "add_gaussian_noise",
    "box_muller_normal",
    "densify",
    "make_generator",
    "replica_noise_stddev",
    "replica_seed",
]

_Stddev = Union[float, tf.Tensor]


def add_gaussian_noise(
    grads: Sequence[Optional[tf.Tensor]],
    stddev: _Stddev,
    generator: Optional[tf.random.Generator] = None,
    seed: Optional[tf.Tensor] = None,
    scale: Optional[_Stddev] = None,
) -> List[Optional[tf.Tensor]]:
  """Adds independent `N(0, stddev**2)` noise to every entry of every tensor.

  Give exactly one source of randomness. With `generator`, each call draws
  fresh noise and advances the generator's state. With a stateless `seed`,
  the noise is a pure function of the seed, so equal seeds give equal noise.
  Either way the tensors' noises are independent of each other: the fused
  kernel gives each tensor its own counter range under one key, and the
  fallback tensors get a fresh draw each (split seeds,
  `_split_seed`, in the stateless case).

  Args:
    grads: A list of gradient tensors; `None` entries (variables without a
      gradient) are returned as `None`. `tf.IndexedSlices` are densified,
      since the noise is dense.
    stddev: The noise standard deviation, `noise_multiplier * l2_norm_clip`
      (divided by `sqrt(num_replicas)` under a strategy, see
      `replica_noise_stddev`); a Python number or scalar tensor, >= 0.
    generator: A `tf.random.Generator`, or a
      `tf_pxg.dp.secure.SecureNoiseSource` (secure mode: OS keys, a sum of
      four Gaussians; not inside XLA).
    seed: A stateless seed: a shape `[2]` int32/int64 tensor (a scalar
      integer `s` is taken as `[0, s]`).
    scale: An optional factor for the noisy result, `scale * (g + noise)`,
      applied by the fused kernel in the same pass (e.g. `1 / batch_size`
      for DP-SGD's noisy mean: one pass over the weights fewer than
      dividing afterwards).

  Returns:
    A new list: `g + noise` (times `scale`) for each tensor `g` (same shape
    and dtype), `None` where `grads` has `None`.

  Raises:
    ValueError: If neither or both of `generator` and `seed` are given, or
      `seed` is not an integer of shape `[2]` or `[]`.

  Warning:
    Add the noise once per global step, to the *sum* of clipped per-example
    gradients, before dividing by the batch size.
  """
  if (generator is None) == (seed is None):
    raise ValueError(
        "add_gaussian_noise needs exactly one source of randomness: pass "
        "generator= (a tf.random.Generator, e.g. from make_generator()) or "
        "seed= (a shape [2] integer tensor); got "
        f"generator={generator!r}, seed={seed!r}.")
  if hasattr(generator, "add_gaussian_noise"):  # e.g. SecureNoiseSource
    return generator.add_gaussian_noise(grads, stddev, scale)
  grads = list(grads)
  noisy = list(grads)
  present = [i for i, g in enumerate(grads) if g is not None]
  tensors = {i: grads[i] if isinstance(grads[i], tf.IndexedSlices) else
             tf.convert_to_tensor(grads[i]) for i in present}
  # float32/16/bf16 tensors of static shape take the fused kernel;
  # float64 (float64 samples) and dynamic shapes TF's kernels.
  fused = [i for i in present if threefry.supports(tensors[i])]
  rest = [i for i in present if i not in fused]
  for i in rest:
    tensors[i] = densify(tensors[i])
  if fused:
    key = (generator.uniform_full_int([3], tf.uint32) if generator is not None
           else tf.random.stateless_uniform(
               [3], seed=_stateless_seed(seed), minval=None, maxval=None,
               dtype=tf.uint32))
    for i, out in zip(fused, threefry.add_normal_noise(
        [tensors[i] for i in fused], key, stddev,
        1.0 if scale is None else scale)):
      noisy[i] = out
  if rest and generator is None:
    seeds = _split_seed(_stateless_seed(seed), len(rest), "add_gaussian_noise")
  for k, i in enumerate(rest):
    g = tensors[i]
    if generator is not None:
      noisy[i] = g + box_muller_normal(generator, tf.shape(g), g.dtype, stddev)
    else:
      noisy[i] = g + tf.random.stateless_normal(
          tf.shape(g), seed=seeds[k], stddev=tf.cast(stddev, g.dtype),
          dtype=g.dtype)
    if scale is not None:
      noisy[i] = noisy[i] * tf.cast(scale, g.dtype)
  return noisy


def densify(g) -> tf.Tensor:
  """`g` as a dense tensor; a `tf.IndexedSlices` is scattered with XLA.

  An embedding's clipped gradient sum arrives as `IndexedSlices` (rows and
  their indices; repeated indices add up). DP noise makes it dense anyway.
  TF's own conversion (`UnsortedSegmentSum`) runs on one core and is
  slower than a `scatter_nd` compiled with XLA, which this uses when the
  dense shape is static.
  """
  if not isinstance(g, tf.IndexedSlices):
    return tf.convert_to_tensor(g)
  shape = threefry.static_shape(g)
  if not shape.is_fully_defined():
    return tf.convert_to_tensor(g)
  return _scatter_rows(g.values, g.indices, shape)


@tf.function(jit_compile=True, autograph=False)
def _scatter_rows(values, indices, shape):
  return tf.scatter_nd(tf.expand_dims(indices, -1), values, shape)


def box_muller_normal(generator: tf.random.Generator, shape,
                      dtype=tf.float32, stddev: _Stddev = 1.0) -> tf.Tensor:
  """Standard normal samples by the Box–Muller transform of uniforms.

  For independent `u1, u2 ~ U[0, 1)`, `r = sqrt(-2 log(1 - u1))` and
  `t = 2 pi u2` give two independent standard normals `r cos t` and
  `r sin t` (Box & Muller, 1958), so n samples need n uniforms. This is
  the transform TF's own CPU normal kernel applies (`BoxMullerFloat`), but
  using both outputs of each pair it draws half as many Philox uniforms
  (faster on CPU; docs/benchmarks.md). `add_gaussian_noise` uses it for tensors
  the fused Threefry kernel does not take (float64, dynamic shapes). The
  angle is drawn as a uniform on
  `[0, 2 pi)` and `stddev` is folded into the radius
  (`sqrt(-2 stddev**2 log(1 - u1))`), which saves two passes over the
  samples.

  Args:
    generator: The `tf.random.Generator` to draw from (advanced).
    shape: The output shape (Python ints, a `TensorShape` or a 1-D tensor).
    dtype: A floating dtype.
    stddev: The standard deviation, >= 0 (Python number or scalar tensor).

  Returns:
    A `shape` tensor of independent `N(0, stddev**2)` samples.
  """
  static = _static_shape(shape)
  if static is not None:  # Python sizes: no shape arithmetic in the graph.
    n = int(np.prod(static, dtype=np.int64))
    half = (n + 1) // 2
    pairs = [half]
  else:
    n = tf.reduce_prod(shape)
    half = (n + 1) // 2
    pairs = tf.reshape(half, [1])
  u = generator.uniform(pairs, dtype=dtype)
  angle = generator.uniform(pairs, maxval=2.0 * math.pi, dtype=dtype)
  scale = tf.cast(-2.0 * tf.square(tf.cast(stddev, tf.float64)), dtype)
  radius = tf.sqrt(tf.math.log1p(-u) * scale)
  z = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
  if static is not None and n == 2 * half:
    return tf.reshape(z, static)
  return tf.reshape(z[:n], static if static is not None else shape)


def _static_shape(shape) -> Optional[List[int]]:
  """`shape` as a list of Python ints if it is known statically, else None."""
  if isinstance(shape, tf.TensorShape):
    return shape.as_list() if shape.is_fully_defined() else None
  if isinstance(shape, (list, tuple)) and all(
      isinstance(d, (int, np.integer)) for d in shape):
    return [int(d) for d in shape]
  return None


def _stateless_seed(seed) -> tf.Tensor:
  """`seed` as a shape `[2]` int32 tensor; a scalar `s` becomes `[0, s]`.

  (Seeds are split as int32 `[2]` tensors, `_split_seed`: a Python int is
  never taken for a *stateful* seed, as TFP's split would take it.)
  """
  seed = tf.convert_to_tensor(seed)
  if not seed.dtype.is_integer:
    raise ValueError(
        f"seed must be an integer tensor of shape [2] (or a scalar integer); "
        f"got dtype {seed.dtype.name}.")
  if seed.shape.rank == 0:
    seed = tf.stack([tf.zeros_like(seed), seed])
  if not seed.shape.is_compatible_with([2]):
    raise ValueError(
        "seed must be an integer tensor of shape [2] (or a scalar integer); "
        f"got shape {seed.shape}.")
  if seed.dtype != tf.int32:
    # The seed splitting takes int32 seeds: hash the full seed into one.
    seed = tf.random.stateless_uniform(
        [2], seed=tf.cast(seed, tf.int64), minval=None, maxval=None,
        dtype=tf.int32)
  return seed


def _split_seed(seed: tf.Tensor, n: int, salt: str) -> List[tf.Tensor]:
  """`n` independent stateless seeds derived from the int32 `[2]` `seed`
  and `salt`: the same seeds as TensorFlow Probability's
  `tfp.random.split_seed(seed, n=n, salt=salt)` for a stateless seed (the
  salt's SHA-512 mod 2^31 - 1 xor-ed into the seed's first word, then a
  stateless uniform `[n, 2]` int32 draw), without depending on TFP, whose
  tf-keras dependency pins the TensorFlow version a user has installed."""
  salt_word = int(hashlib.sha512(salt.encode("utf-8")).hexdigest(), 16) % (
      2**31 - 1)
  seed = tf.bitwise.bitwise_xor(tf.convert_to_tensor(seed, tf.int32),
                                tf.constant([salt_word, 0], tf.int32))
  return tf.unstack(tf.random.stateless_uniform(
      [n, 2], seed=seed, minval=None, maxval=None, dtype=tf.int32))


def replica_noise_stddev(stddev: _Stddev, num_replicas: int) -> _Stddev:
  """The noise std each of `num_replicas` replicas adds: `stddev / sqrt(R)`.

  Under a `tf.distribute` strategy each replica holds the clipped gradient
  sum of its share of the batch, and the per-replica results are all-reduced
  with a SUM into the global step's gradient. If every replica added the full
  `N(0, s**2)`, the global step would get the sum of R independent such draws,
  `N(0, R * s**2)`: std `sqrt(R) * s`, and R times that (`R**1.5 * s`) if the
  noise were also scaled by R afterwards. Instead each replica adds
  `N(0, s**2 / R)` with an independent seed; the sum of R independent
  `N(0, s**2 / R)` variables is `N(0, R * s**2 / R) = N(0, s**2)`, so the
  global step gets exactly the noise the accounting assumes, once.

  This needs the replicas' noises to be independent (a `tf.random.Generator`
  created in the strategy scope, or `replica_seed`) and the cross-replica
  reduction to be a SUM. With a MEAN reduction the global noise std would be
  `s / R`; add `R * replica_noise_stddev(s, R)` per replica then, or sum.

  Args:
    stddev: The global step's noise std `s` (`noise_multiplier *
      l2_norm_clip`); a Python number or scalar tensor.
    num_replicas: R, e.g. `strategy.num_replicas_in_sync`; a positive integer.

  Returns:
    `stddev / sqrt(num_replicas)`, a Python float for a Python number, else a
    tensor.

  Raises:
    ValueError: If `num_replicas` is not a positive integer.
  """
  if (isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or
      num_replicas < 1):
    raise ValueError(
        "num_replicas must be a positive integer (>= 1), e.g. "
        f"strategy.num_replicas_in_sync; got {num_replicas!r}.")
  return stddev / math.sqrt(num_replicas)


def replica_seed(seed: tf.Tensor, replica_id: Union[int, tf.Tensor],
                 num_replicas: int) -> tf.Tensor:
  """An independent stateless seed for one replica, derived from `seed`.

  Splits `seed` into `num_replicas` seeds with `_split_seed` (a
  stateless counter-based split: the children are independent streams) and
  returns row `replica_id`. All replicas can call this with the same `seed`
  and their own `replica_id` (e.g.
  `tf.distribute.get_replica_context().replica_id_in_sync_group`); derive a
  new `seed` for every step (e.g. split a base seed by the step counter).

  Args:
    seed: The step's stateless seed, a shape `[2]` integer tensor (a scalar
      integer `s` is taken as `[0, s]`).
    replica_id: This replica's index in `[0, num_replicas)`; int or scalar
      integer tensor.
    num_replicas: The number of replicas R, a positive Python int.

  Returns:
    A shape `[2]` int32 tensor, a stateless seed.

  Raises:
    ValueError: If `num_replicas` is not a positive integer, or `seed` is not
      an integer of shape `[2]` or `[]`.
  """
  if (isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or
      num_replicas < 1):
    raise ValueError(
        "num_replicas must be a positive integer (>= 1); "
        f"got {num_replicas!r}.")
  seeds = tf.stack(_split_seed(_stateless_seed(seed), num_replicas,
                              "replica_seed"))
  return tf.gather(seeds, replica_id)


def make_generator(seed: Optional[int] = None) -> tf.random.Generator:
  """A `tf.random.Generator` for DP noise.

  Without `seed` its state comes from OS entropy
  (`tf.random.Generator.from_non_deterministic_state`), as privacy requires:
  noise that an adversary can reproduce protects nothing. Give `seed` only in
  tests. Call it inside `strategy.scope()` so the generator is a distributed
  variable that works under XLA and on TPU.

  Args:
    seed: An optional integer seed (tests only).

  Returns:
    A new `tf.random.Generator`.
  """
  if seed is None:
    return tf.random.Generator.from_non_deterministic_state()
  return tf.random.Generator.from_seed(seed)
