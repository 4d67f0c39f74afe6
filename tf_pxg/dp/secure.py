"""Secure noise for DP-SGD (`secure_mode=True`): OS keys, sums of Gaussians.

The default noise (`tf_pxg.dp.noise`) is statistically right but has two
weaknesses that matter against a strong adversary:

1. **Keys expanded from one seed.** Its per-step Threefry keys come from a
   `tf.random.Generator` (Philox) seeded once from OS entropy. Whoever
   learns the generator's state (a leaked checkpoint, memory) can replay
   every step's noise and subtract it.
2. **Floating-point gaps.** A textbook floating-point sampler's outputs
   are a sparse, structured subset of the floats. Mironov (CCS 2012)
   showed for the Laplace mechanism that the released value `f(D) + z`
   then reveals `f(D)`; Jin, McMurtry, Rubinstein and Ohrimenko (S&P 2022,
   arXiv 2112.05307) report up to 92 % attack success against the Gaussian
   of DP-SGD implementations: given `y = g + z`, test for each candidate
   `g` whether `y - g` is an output the sampler can produce.

`secure_mode=True` (on `DPModel`/`DPSequential`/`make_private`/
`make_dp_model_class` models and `DPOptimizer`) changes both:

**Keys from the OS CSPRNG at every step.** Each noise draw reads fresh
bytes from `os.urandom` (Linux `getrandom(2)`: the kernel's ChaCha20
CSPRNG), `SecureNoiseSource.keys`, through a `tf.py_function` that runs
on every execution of the traced step: no seed, no state, nothing to
replay; every replica reads its own bytes, so replicas' noises are
independent. A reproducible `seed` together with `secure_mode` raises.
(The Threefry-2x32-20 kernel then expands each 96-bit key into the step's
samples, as in the default mode; Threefry is a counter-based generator
that passes BigCrush, not a proven cryptographic PRF. The keys, which an
attacker would have to recover, are never reused across steps.)

**Counter-measure to floating-point attacks: a sum of 2n Gaussians.**
Holohan and Braghin, "Secure Random Sampling in Differential Privacy"
(ESORICS 2021, arXiv 2107.10138), the approach Opacus' `secure_mode`
takes: draw 2n independent standard normals and release

    z = (z_1 + ... + z_2n) / sqrt(2n)  ~  N(0, 1)    exactly,

with n = 2 as in Opacus (four samples, `/ 2`). The sum has the same
distribution, so the accountant's analysis is unchanged and nothing has to
be re-accounted; what changes is the set of values the sampler can output
and the number of ways to reach each. The test above needs, for a
candidate `g`, to decide whether `y - g` is reachable; for a sum, a value
is reachable through about `K^(2n - 1)` combinations of the summands (K
the number of distinct values one sample takes, here about 2^32 per
Box-Muller output), so the reachable set fills the float grid around the
mean, and deciding membership means searching the `(2n - 1)`-fold
combinations: Holohan and Braghin put the attack's work at exponential in
2n (with n = 2 and 32-bit samples, beyond 2^96 evaluations per coordinate
by this count). This is their argument, not one re-derived here.

*Why not a discrete Gaussian* (Canonne, Kamath and Steinke 2020): it is
exact on an integer grid, but it needs rejection sampling (a data-
independent but random number of iterations: a loop XLA compiles poorly
and a timing signal) and a rounding of the gradient to the grid that must
enter the sensitivity. The sum of Gaussians keeps the fused float32
kernels (native CPU op and XLA loop), the exact N(0, (σC)²) law and the
accountant as they are, at four draws per coordinate instead of one.

**Where it runs.** Eagerly and inside `tf.function` (the key read is a
`py_function`, which runs at every call). Not inside XLA-compiled code:
XLA cannot call back into Python or read OS entropy, and an XLA program
that took its keys as inputs would need them fed per step from outside the
compiled step, which `model.fit` does not do. `add_secure_gaussian_noise`
raises there, and secure DP models compile their step without XLA
(`jit_compile="auto"` resolves to False; an explicit `jit_compile=True`
raises). The noise kernels themselves are the XLA loop or the native op as
in the default mode.

**What it does not protect against**: timing and other side channels (the
step's duration does not depend on the noise, but see
`docs/threat_model.md` for the sampler's batch sizes), an adversary with
access to the process's memory during the step, or a weak OS entropy
source.
"""

from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_pxg import xla
from tf_pxg.dp import noise as dp_noise
from tf_pxg.dp import threefry

__all__ = ["NUM_SUMMANDS", "SecureNoiseSource", "add_secure_gaussian_noise",
           "make_noise_source", "os_random_uint32"]

#: 2n with n = 2: the number of Gaussians summed per coordinate.
NUM_SUMMANDS = 4


def xla_error(what: str) -> ValueError:
  return ValueError(
      f"{what} reads its keys from the OS CSPRNG (os.urandom through a "
      "tf.py_function) at every step, which XLA cannot compile: XLA code "
      "cannot call back into Python or read OS entropy. Run the step "
      "without XLA (compile the model with jit_compile=False, or call this "
      "from a tf.function without jit_compile); plain tf.function works. "
      "For an XLA step, use secure_mode=False (keys expanded from an "
      "OS-seeded generator).")


def os_random_uint32(shape: Sequence[int]) -> tf.Tensor:
  """A uint32 tensor of `shape` of fresh `os.urandom` bytes.

  Eagerly: read now. Traced (`tf.function`): a stateful `tf.py_function`
  that reads new bytes at every execution. Inside XLA: raises.
  """
  shape = [int(d) for d in shape]
  n = int(np.prod(shape, dtype=np.int64))

  def read():
    return np.frombuffer(os.urandom(4 * n), dtype=np.uint32).reshape(shape)

  if tf.executing_eagerly():
    return tf.constant(read(), tf.uint32)
  if xla.in_xla_context():
    raise xla_error("secure_mode noise")
  out = tf.py_function(read, [], tf.uint32, name="os_urandom")
  out.set_shape(shape)
  return out


class SecureNoiseSource:
  """The noise source of `secure_mode`: no state, fresh OS keys per draw.

  Pass it where a `tf.random.Generator` goes (`generator=` of
  `tf_pxg.dp.add_gaussian_noise`, `step_noise`, `noisy_mean`); the noise
  functions then call `add_secure_gaussian_noise`. It holds no variable,
  so it is the same object under every replica and in every step; the
  independence of replicas and steps comes from the OS.
  """

  num_summands = NUM_SUMMANDS

  def keys(self, count: int) -> tf.Tensor:
    """`[count, 3]` uint32 Threefry keys, fresh from the OS."""
    return os_random_uint32([count, 3])

  def add_gaussian_noise(self, grads, stddev, scale=None):
    """`add_secure_gaussian_noise(grads, stddev, scale, self)`: what
    `tf_pxg.dp.add_gaussian_noise(..., generator=self)` calls."""
    return add_secure_gaussian_noise(grads, stddev, scale, self)

  def __repr__(self):
    return f"SecureNoiseSource(num_summands={self.num_summands})"


def add_secure_gaussian_noise(grads: Sequence[Optional[tf.Tensor]], stddev,
                              scale=None,
                              source: Optional[SecureNoiseSource] = None
                              ) -> List[Optional[tf.Tensor]]:
  """`scale * (g + stddev * (z_1 + ... + z_2n) / sqrt(2n))` per tensor.

  The same contract as `tf_pxg.dp.add_gaussian_noise` (None entries pass
  through, `IndexedSlices` are densified, dtypes kept), with 2n =
  `NUM_SUMMANDS` independent standard normals per coordinate, each sum of
  draws under its own key of OS bytes (module docstring). float32,
  float16 and bfloat16 tensors of static shape take the fused Threefry
  kernels (float32 samples; the noise is summed in float32, then added);
  others (float64, dynamic shapes) TF's stateless normal kernel seeded by
  OS bytes.

  Raises:
    ValueError: inside XLA-compiled code (see the module docstring).
  """
  source = source or SecureNoiseSource()
  k = source.num_summands
  grads = list(grads)
  out = list(grads)
  present = [i for i, g in enumerate(grads) if g is not None]
  if not present:
    return out
  dense = {i: dp_noise.densify(grads[i]) for i in present}
  fused = [i for i in present if threefry.supports(dense[i])]
  rest = [i for i in present if i not in fused]
  part = tf.cast(stddev, tf.float32) / math.sqrt(k)
  keys = source.keys(k + (1 if rest else 0))
  if fused:
    # noise = sum_j part * z_j, each z_j a draw under key j (tensors in
    # one draw take disjoint counter ranges), accumulated in float32.
    noise = [tf.zeros(dense[i].shape, tf.float32) for i in fused]
    for j in range(k):
      noise = threefry.add_normal_noise(noise, keys[j], part)
    for i, z in zip(fused, noise):
      g = dense[i]
      y = tf.cast(tf.cast(g, tf.float32) + z, g.dtype)
      out[i] = y if scale is None else y * tf.cast(scale, g.dtype)
  if rest:
    seed_words = tf.bitcast(keys[-1][:2], tf.int32)
    for n, i in enumerate(rest):
      g = dense[i]
      total = tf.zeros_like(g)
      for j in range(k):
        seed = tf.stack([seed_words[0], seed_words[1] + (n * k + j)])
        total += tf.random.stateless_normal(tf.shape(g), seed=seed,
                                            dtype=g.dtype)
      y = g + tf.cast(stddev, g.dtype) / math.sqrt(k) * total
      out[i] = y if scale is None else y * tf.cast(scale, g.dtype)
  return out


def make_noise_source(seed: Optional[int] = None, secure_mode: bool = False):
  """The noise source of a DP model or loop: `tf_pxg.dp.make_generator(
  seed)`, or a `SecureNoiseSource` with `secure_mode=True`.

  Raises:
    ValueError: `secure_mode=True` with a `seed` (a reproducible seed is
      what secure mode exists to rule out).
  """
  if secure_mode:
    if seed is not None:
      raise ValueError(
          f"secure_mode=True draws every noise key from the OS CSPRNG and "
          f"cannot be reproducible; got seed={seed!r}. Drop the seed (or "
          "use secure_mode=False for reproducible tests).")
    return SecureNoiseSource()
  return dp_noise.make_generator(seed)
