"""Convolutions: Conv2D, Conv3D, DepthwiseConv2dNative, Conv2DBackpropInput.

A convolution's filter gradient is a contraction of input patches with the
output gradient over the output positions P (im2col; Rochette et al. 2019,
"Efficient per-example gradient computations in convolutional neural
networks"). With patches `[N, P, K]` from `tf.image.extract_patches`
(`tf.extract_volume_patches` in 3-D) the rules reuse the contraction
engine: per-example gradients are one einsum, and squared norms pick between
materialising `[B, K, C]` and the ghost form over `P x P` Gram matrices by
cost. Squared norms run over chunks of examples whose patches fit in
`NORM_CHUNK_BYTES` (one chunk alive at a time; not under XLA). Weighted sums
are TF's filter gradient with dz scaled per example (native ops below).

On CPU outside XLA, a 2-D convolution's squared norms (one group, NHWC
or NCHW, float32/float64) come from the native op `TfPxgConv2DFilterSqNorm`
(`tf_pxg/kernels/conv_norms.cc`, `ConvRule.native_sq_norm`): it accumulates each
example's filter gradient in registers from the input and dz, without the
patch tensor, the chunk loop or the Gram matrices (less op time than the
patch path; docs/benchmarks.md). Depthwise convolutions — a
`DepthwiseConv2dNative`, or a `Conv2D` with one input channel per group
(Keras' `Conv2D(groups=C)`, as in ConvNeXt) — take
`TfPxgDepthwiseConv2DFilterSqNorm` for the norms and
`TfPxgDepthwiseConv2DFilterWeightedSum` for the clip-weighted sum
(`tf_pxg/kernels/depthwise_norms.cc`): channel vectors of x and dz
multiplied and summed over each tap's valid positions, the scaling by
`c[b]` fused into the sum (an example with `c[b] = 0` is skipped). Other
grouped convolutions take the patch path. The clip-weighted sum of a
one-group 2-D convolution is `TfPxgConv2DFilterWeightedSum` (the norm op's
loop, dz scaled by `c[b]` as it is copied, zero-factor examples skipped)
when it is strided or 1x1 and its filter has at most `FUSED_SUM_MAX_FILTER`
entries; other convolutions take TF's filter gradient of the scaled dz,
which is faster there.

Patches come from one-hot (depthwise) convolutions where possible, see
`_patches`. A transposed convolution (`Conv2DBackpropInput`) is the same with the roles
swapped: patches of its output gradient against its data input.

Unsupported variants (a parameter that is not the filter, filters of
unknown shape) take the vectorized default.
"""

from __future__ import annotations

import tensorflow as tf

from tf_pxg import native
from tf_pxg import xla
from tf_pxg.rules import base
from tf_pxg.rules.base import register
from tf_pxg.rules import contraction


def _channels_first(ctx) -> bool:
  return ctx.attr("data_format", "NHWC").startswith("NC")


def _to_channels_last(ctx, t):
  if _channels_first(ctx):
    perm = [0] + list(range(2, t.shape.rank)) + [1]
    return tf.transpose(t, perm)
  return t


def _grouped_float64(ctx) -> bool:
  """A float64 convolution with groups (input channels != the filter's),
  whose filter gradient TF's CPU kernels do not compute."""
  x, filt = ctx.inputs[0], ctx.inputs[1]
  channels = _to_channels_last(ctx, x).shape[-1]
  return (x.dtype == tf.float64 and channels is not None and
          int(channels) != int(filt.shape[-2]))


def _spatial(ctx, name, rank):
  """The spatial entries of a per-axis attr (strides/dilations), channels-last."""
  v = list(ctx.attr(name, [1] * rank))
  if _channels_first(ctx):
    return v[2:]
  return v[1:rank - 1]


def _patches(ctx, x, kernel_spatial):
  """Patches of channels-last `x` for this conv: `(tensor, subscripts)`.

  The tensor is `[N, P, K, C]` (subscripts "npkc") or `[N, P, C, K]`
  ("npck"), K the kernel offsets and C the input channels. In 2-D without
  dilation the patches come from a depthwise convolution with one-hot
  filters (an order of magnitude faster on CPU than ExtractImagePatches);
  with dilation or unequal strides from `tf.image.extract_patches`; in 3-D from a convolution
  with a one-hot filter (XLA has no ExtractVolumePatches kernel).
  """
  rank = x.shape.rank
  strides = _spatial(ctx, "strides", rank)
  dilations = _spatial(ctx, "dilations", rank)
  padding = ctx.attr("padding")
  if padding == "EXPLICIT":
    pads = list(ctx.attr("explicit_paddings"))
    pairs = [pads[i:i + 2] for i in range(0, len(pads), 2)]
    if _channels_first(ctx):
      pairs = [pairs[0]] + pairs[2:] + [pairs[1]]
    x = tf.pad(x, pairs)
    padding = "VALID"
  c = int(x.shape[-1])
  k = 1
  for d in kernel_spatial:
    k *= int(d)
  one_hot = tf.reshape(tf.eye(k, dtype=x.dtype), [*kernel_spatial, 1, k])
  if (rank == 4 and all(d == 1 for d in dilations) and
      strides[0] == strides[1]):  # The CPU depthwise kernel's limits.
    p = tf.nn.depthwise_conv2d(x, tf.tile(one_hot, [1, 1, c, 1]),
                               [1, *strides, 1], padding)
    sub = "npck"
    shape = [c, k]
  elif rank == 4:
    p = tf.image.extract_patches(
        x, sizes=[1, *kernel_spatial, 1], strides=[1, *strides, 1],
        rates=[1, *dilations, 1], padding=padding)
    sub, shape = "npkc", [k, c]
  else:
    eye = tf.reshape(tf.eye(k * c, dtype=x.dtype), [*kernel_spatial, c, k * c])
    p = tf.nn.conv3d(x, eye, strides=[1, *strides, 1], padding=padding,
                     dilations=[1, *dilations, 1])
    sub, shape = "npkc", [k, c]
  n = tf.shape(p)[0]
  return tf.reshape(p, tf.stack([n, -1, *shape])), sub


# Budget for one chunk's patch tensor when a rule computes squared norms: the
# batch is cut into chunks of examples whose patches take at most this many
# bytes (at least one example per chunk), computed one after the other, so
# only one chunk's patches are alive at a time (`base.map_example_chunks`).
NORM_CHUNK_BYTES = 1 << 20


class _PatchContraction(base.Rule):
  """A conv as `einsum(patches, other)`; subclasses say how.

  `example_operands` names the two tensors the filter gradient contracts:
  `patched`, whose patches are taken, and `other`, the operand the patches
  meet at each output position (both in the op's layout, examples on axis
  0). `operands` turns them, or the same rows of a chunk of examples, into
  `(spec, data, dz, to_param)`: the contraction's per-example result
  `[B, *spec.param_sub sizes]` is in whatever axis order is cheapest to
  compute (norms do not care); `to_param` reorders it to
  `[B, *param.shape]` when the gradient itself is asked for.

  The filter gradient reads the inputs, not the output: the default
  `weighted_sum` zeroes a dropped example's input rows only.
  """

  drop_outputs = False

  def example_operands(self, ctx):
    """(patched, other), examples on axis 0 of both."""
    raise NotImplementedError

  def operands(self, ctx, patched, other):
    """(spec, data, dz, to_param) for the contraction engine."""
    raise NotImplementedError

  def supported(self, ctx) -> bool:
    """Whether the parameter is the filter, of static shape (else the
    vectorized default runs)."""
    return ctx.param_index == 1 and ctx.inputs[1].shape.is_fully_defined()

  def per_example(self, ctx):
    if not self.supported(ctx):
      return super().per_example(ctx)
    taps = self.taps(ctx)
    if taps is not None:
      g = taps.per_example()
      return tf.reshape(g, tf.concat([tf.shape(g)[:1], ctx.param_shape], 0))
    spec, data, dz, to_param = self.operands(ctx,
                                             *self.example_operands(ctx))
    g = contraction.per_example(spec, data, dz, ctx.batch_size,
                                ctx.batch_minor)
    g = to_param(g)
    return tf.reshape(g, tf.concat([tf.shape(g)[:1], ctx.param_shape], 0))

  def sq_norm(self, ctx):
    """Ghost or materialised (`contraction.sq_norm_and_per_example`), over
    chunks of examples (`_norm_chunk`); a materialised per-example gradient
    is kept for `weighted_sum` if `base.cheap_to_keep` (else the chunks do
    not return it)."""
    if not self.supported(ctx):
      return super().sq_norm(ctx)
    sq = self.native_sq_norm(ctx)
    if sq is not None:
      return sq
    taps = self.taps(ctx)
    if taps is not None:
      base.trace_note(sq_norm="taps")
      g = taps.per_example()
      base.keep_per_example(ctx, g, (g, _identity))
      return base.batch_sq_norm(g)
    patched, other = self.example_operands(ctx)
    dtype = contraction.norm_dtype(patched.dtype)
    chunk = _norm_chunk(ctx, patched, other)
    # Whether the per-example gradient is kept and its axis order, known
    # once `norms` has been traced (in the chunk loop) or run (eagerly).
    layout = {}
    batch = ctx.batch_size if isinstance(ctx.batch_size, int) else None

    def norms(parts, n):
      spec, data, dz, layout["to_param"] = self.operands(ctx, *parts)
      sq, g = contraction.sq_norm_and_per_example(
          spec, data, dz, n, ctx.batch_minor, keeps=ctx.kept is not None)
      layout["keep"] = g is not None and base.cheap_to_keep(
          ctx, [batch, *g.shape[1:]])
      if not layout["keep"]:  # A fixed output structure for the chunk loop.
        g = tf.zeros(tf.stack([tf.shape(sq)[0], 0]), dtype)
      return sq, g

    if chunk is None:
      sq, g = norms([patched, other], ctx.batch_size)
    else:
      sq, g = base.map_example_chunks(norms, [patched, other], ctx.batch_size,
                                      chunk, (tf.float32, dtype))
    if layout["keep"]:
      base.keep_per_example(ctx, g, (g, layout["to_param"]))
    return sq

  def native_sq_norm(self, ctx):
    """The squared norms from a native op, or None (the patch path runs)."""
    del ctx
    return None

  def native_weighted_sum(self, ctx, c):
    """The weighted sum from a native op, or None (TF's filter gradient
    with dz scaled per example runs)."""
    del ctx, c
    return None

  def taps(self, ctx):
    """A `_DepthwiseTaps` when the filter gradient is computed tap by tap
    (depthwise convolutions under XLA), else None (the patch path)."""
    del ctx
    return None

  def weighted_sum(self, ctx, c):
    """From the per-example gradients the norm materialised, if kept;
    else TF's filter gradient with dz scaled per example; for dilations > 1
    and for grouped float64 convolutions the patch contraction instead, as
    some CPU builds have no dilated `Conv*BackpropFilter/Input` kernel
    (float64, or without oneDNN) and TF's CPU kernels no grouped float64
    one (the native ops serve the latter where they load)."""
    if not self.supported(ctx):  # the defaults' sq_norm and weighted sum
      return super().weighted_sum(ctx, c)
    kept = base.take_per_example(ctx)
    if kept is not None:
      g, to_param = kept
      w = base.weighted_sum_of(g, c, ctx.param_dtype)
      return tf.reshape(to_param(w[None]), ctx.param_shape)
    w = self.native_weighted_sum(ctx, c)
    if w is not None:
      return w
    taps = self.taps(ctx)
    if taps is not None:
      base.trace_note(weighted_sum="taps")
      return tf.cast(tf.reshape(taps.weighted_sum(c), ctx.param_shape),
                     ctx.param_dtype)
    rates = _spatial(ctx, "dilations", ctx.dz.shape.rank)
    if all(r == 1 for r in rates) and not _grouped_float64(ctx):
      return super().weighted_sum(ctx, c)
    spec, data, dz, to_param = self.operands(ctx,
                                             *self.example_operands(ctx))
    dz = tf.cast(ctx.scale_examples(dz, c), data.dtype)
    data = ctx.drop_examples(data, c)  # inf * 0 = NaN: select the rows to 0
    g = tf.einsum(f"{spec.data_sub},{spec.out_sub}->{spec.param_sub}", data,
                  dz)
    return tf.reshape(to_param(g[None]), ctx.param_shape)


def _norm_chunk(ctx, patched, other):
  """Examples per chunk for `sq_norm`, or None to take the batch at once.

  Chunks hold at most `NORM_CHUNK_BYTES` of patches (at least one
  example). None when the batch fits in one chunk, when the examples are
  interleaved (batch-minor rows), when one example's patch size is not
  static, and under XLA (which plans its own buffers, and where the chunk
  loop made the cnn benchmark's step slower). With a dynamic batch,
  rows merged into examples (`[B*k, ...]`) are not seen and a chunk may
  hold k times the budget.
  """
  if ctx.batch_minor or ctx.batch_size is None or xla.in_xla_context():
    return None
  per_example = _patch_elements(ctx, patched, other)
  if per_example is None:
    return None
  chunk = max(1, NORM_CHUNK_BYTES // (per_example * patched.dtype.size))
  if isinstance(ctx.batch_size, int) and ctx.batch_size <= chunk:
    return None
  return chunk


def _patch_elements(ctx, patched, other):
  """Elements of one example's patches, or None if not static: kernel
  offsets x `patched`'s channels x `other`'s positions (its rows per
  example, if static, times its spatial size)."""
  if other.shape.rank is None or patched.shape.rank is None:
    return None
  axis = 1 if _channels_first(ctx) else other.shape.rank - 1
  spatial = [d for i, d in enumerate(other.shape) if i not in (0, axis)]
  sizes = [ctx.inputs[1].shape[:-2].num_elements(),
           patched.shape[1 if _channels_first(ctx) else -1], *spatial]
  if None in sizes:
    return None
  rows = other.shape[0]
  if isinstance(ctx.batch_size, int) and isinstance(rows, int):
    sizes.append(max(1, rows // max(1, ctx.batch_size)))
  n = 1
  for s in sizes:
    n *= int(s)
  return n


def _leading_pads(ctx, spatial, kernel, strides, dilations):
  """Zeros before the input's rows and columns (top, left) for the conv's
  padding, or None if SAME's depend on a size that is not static.

  SAME pads `max((out - 1) s + (k - 1) d + 1 - in, 0)` in all, the smaller
  half first, with out = ceil(in / s) (TensorFlow's convention).
  """
  padding = ctx.attr("padding")
  if padding == "VALID":
    return [0, 0]
  if padding == "EXPLICIT":
    pads = list(ctx.attr("explicit_paddings"))
    rows, cols = (2, 3) if _channels_first(ctx) else (1, 2)
    return [int(pads[2 * rows]), int(pads[2 * cols])]
  if None in spatial:
    return None
  before = []
  for n, k, s, d in zip(spatial, kernel, strides, dilations):
    out = -(-int(n) // s)
    before.append(max((out - 1) * s + (k - 1) * d + 1 - int(n), 0) // 2)
  return before


def _identity(g):
  return g


def _swap_offsets_and_channels(k, c):
  """[B, C*K, O] (channel-major patch columns) -> [B, K, C, O]."""
  def to_param(g):
    g = tf.reshape(g, tf.stack([tf.shape(g)[0], c, k, -1]))
    return tf.transpose(g, [0, 2, 1, 3])
  return to_param


def _grouped(ctx, x, filt, dz):
  """Contraction operands for a (grouped) conv with filter [..., Ci, Co].

  Without groups the patch columns stay flat (`[N, P, K*C]`), so both the
  per-example einsum and the ghost Gram matrices are plain batched matmuls.
  """
  kernel = [int(d) for d in filt.shape[:-2]]
  cin_f, cout = int(filt.shape[-2]), int(filt.shape[-1])
  groups = int(x.shape[-1]) // cin_f
  patches, sub = _patches(ctx, x, kernel)
  n, p = tf.shape(patches)[0], tf.shape(patches)[1]
  k = patches.shape[2] if sub == "npkc" else patches.shape[3]
  if groups == 1:
    data = tf.reshape(patches, tf.stack([n, p, k * cin_f]))
    dz = tf.reshape(dz, tf.stack([n, -1, cout]))
    to_param = (_identity if sub == "npkc" else
                _swap_offsets_and_channels(k, cin_f))
    return contraction.Spec("npm", "mo", "npo", "n", 0), data, dz, to_param
  split = [groups, cin_f]
  shape = [n, p, k, *split] if sub == "npkc" else [n, p, *split, k]
  data = tf.reshape(patches, tf.stack(shape))
  dz = tf.reshape(dz, tf.stack([n, -1, groups, cout // groups]))
  spec = contraction.Spec(sub.replace("c", "gi"), "kigo", "npgo", "n", 0)
  return spec, data, dz, _identity


@register("Conv2D")
@register("Conv3D")
class ConvRule(_PatchContraction):
  """`Conv2D`/`Conv3D` (any strides, padding, dilations, groups)."""

  mergeable = True

  def example_operands(self, ctx):
    return ctx.inputs[0], ctx.dz

  def operands(self, ctx, patched, other):
    x = _to_channels_last(ctx, patched)
    dz = _to_channels_last(ctx, other)
    return _grouped(ctx, x, ctx.inputs[1], dz)

  def native_sq_norm(self, ctx):
    """`TfPxgConv2DFilterSqNorm` of the input and dz (channels-last): `[B]`
    squared norms in the data's dtype, or None where it does not serve: a
    `Conv3D`, groups, a dtype other than float32/float64, SAME padding of
    a size that is not static, XLA, accelerators or no native library
    (`native.serves`)."""
    kind, x = _native_conv_kind(ctx)
    if kind == "depthwise":
      return _native_depthwise_sq_norm(ctx, x, ctx.dz)
    if kind == "one group":
      return _native_sq_norm(ctx, "tf_pxg_conv2d_filter_sq_norm", x, ctx.dz)
    return None

  def taps(self, ctx):
    """Tap by tap under XLA for one input channel per group."""
    x, filt = ctx.inputs[0], ctx.inputs[1]
    if filt.shape.rank != 4 or x.shape.rank != 4:
      return None
    channels = _to_channels_last(ctx, x).shape[-1]
    if channels is None or int(filt.shape[2]) != 1 or int(channels) == 1:
      return None
    return _depthwise_taps(ctx)

  def native_weighted_sum(self, ctx, c):
    """`TfPxgConv2DFilterWeightedSum` for a strided or 1x1 2-D convolution
    of one group with a filter of at most `FUSED_SUM_MAX_FILTER` entries, or
    `TfPxgDepthwiseConv2DFilterWeightedSum` for one input channel per group
    (a depthwise convolution written as `Conv2D(groups=C)`, as Keras'
    ConvNeXt does), where `native.serves`; else None."""
    kind, x = _native_conv_kind(ctx)
    if kind == "depthwise":
      return _native_depthwise_weighted_sum(ctx, x, c)
    if kind != "one group":
      return None
    filt = ctx.inputs[1]
    strides = _spatial(ctx, "strides", 4)
    if (filt.shape.num_elements() > FUSED_SUM_MAX_FILTER or
        (max(strides) == 1 and filt.shape[:2].num_elements() > 1)):
      return None  # TF's filter gradient of the scaled dz is faster
    return _native_weighted_sum(ctx, "tf_pxg_conv2d_filter_weighted_sum", x,
                                c)


def _native_conv_kind(ctx):
  """Which native conv op family serves a `Conv2D`'s norm and weighted
  sum: `("depthwise", x)` for one input channel per group, `("one group",
  x)` for a plain convolution, `(None, None)` otherwise (a `Conv3D`, other
  groups, unknown channels, a dtype other than float32/float64, XLA,
  accelerators or no native library: `native.serves`); `x` is the input
  channels-last."""
  x, filt = ctx.inputs[0], ctx.inputs[1]
  if (filt.shape.rank != 4 or x.shape.rank != 4 or
      not native.serves(x, (tf.float32, tf.float64))):
    return None, None
  x = _to_channels_last(ctx, x)
  channels = x.shape[-1]
  if channels is None:
    return None, None
  if int(filt.shape[2]) == 1 and int(channels) > 1:  # one channel a group
    return "depthwise", x
  if int(channels) != int(filt.shape[2]):  # groups
    return None, None
  return "one group", x

# Where the clip-weighted sum of a one-group 2-D convolution comes from
# `TfPxgConv2DFilterWeightedSum` rather than TF's filter gradient of the
# scaled dz: strided or 1x1 convolutions with at most this many filter
# entries (kh kw C Cout). At B = 32 on 2 shared cores (AVX-512, timings
# interleaved) the fused op took 0.7-0.9x the time of the scaling plus
# `Conv2DBackpropFilter` for 3x3 128 -> 256 at 16x16 stride 2 (295k
# entries) and 1x1 128 -> 256 at 8x8, but 1.07-1.15x for 3x3 stride 1
# (64 -> 64 at 32x32, 128 -> 128 at 16x16, 256 -> 256 at 8x8), where
# oneDNN's blocked GEMM is faster than the register-blocked loop (it is
# slower on strided convolutions).
FUSED_SUM_MAX_FILTER = 1 << 19


def _valid_range(size, out, stride, offset):
  """The output positions [lo, hi) at which a tap at input offset `offset`
  (tap index times dilation minus the leading pad) reads inside the
  input: 0 <= o * stride + offset < size."""
  lo = 0 if offset >= 0 else (-offset + stride - 1) // stride
  last = size - 1 - offset  # o * stride <= last
  hi = last // stride + 1 if last >= 0 else 0
  lo = min(lo, out)
  return lo, max(lo, min(hi, out))


class _DepthwiseTaps:
  """A depthwise convolution's filter gradient tap by tap, for XLA.

  For a convolution mapping input channel c to outputs c M .. c M + M - 1
  (`DepthwiseConv2dNative`, or `Conv2D` with one input channel per group),
  tap (i, j) of example b's filter gradient is the product of the input's
  channel vectors at the tap's offset and dz's, summed over the output
  positions where the tap reads inside the image (a rectangle; outside it
  the padding contributes 0) and over the example's rows. Each tap is a
  strided slice of x, a slice of dz, a product and a reduction, which XLA
  fuses: no patch tensor (the one-hot convolution that makes patches, and
  XLA's grouped convolutions, are slow on CPU), and taps that read only
  padding (most of a 7x7 kernel on a 2x2 or 1x1 image) are zeros.
  """

  def __init__(self, ctx, x, dz, kernel, strides, dilations, pads):
    self.ctx = ctx
    dtype = contraction.norm_dtype(x.dtype)
    self.x, self.dz = tf.cast(x, dtype), tf.cast(dz, dtype)
    self.kernel, self.strides = kernel, strides
    self.dilations, self.pads = dilations, pads
    self.c = int(x.shape[-1])
    self.m = int(dz.shape[-1]) // self.c

  def _slices(self, x, dz):
    """Per tap, row-major: None if it reads only padding, else the slices
    of `x` ([N, a, b, C]) and `dz` ([N, a, b, C, M]) over its valid
    output rectangle."""
    (kh, kw), (sh, sw) = self.kernel, self.strides
    (dh, dw), (top, left) = self.dilations, self.pads
    h, w = int(x.shape[1]), int(x.shape[2])
    oh, ow = int(dz.shape[1]), int(dz.shape[2])
    dz = tf.reshape(dz, tf.concat([tf.shape(dz)[:1], [oh, ow, self.c,
                                                       self.m]], 0))
    for i in range(kh):
      y_lo, y_hi = _valid_range(h, oh, sh, i * dh - top)
      for j in range(kw):
        x_lo, x_hi = _valid_range(w, ow, sw, j * dw - left)
        if y_lo >= y_hi or x_lo >= x_hi:
          yield None
          continue
        y0, x0 = y_lo * sh + i * dh - top, x_lo * sw + j * dw - left
        yield (x[:, y0:y0 + (y_hi - y_lo - 1) * sh + 1:sh,
                 x0:x0 + (x_hi - x_lo - 1) * sw + 1:sw, :],
               dz[:, y_lo:y_hi, x_lo:x_hi])

  def per_example(self):
    """`[B, kh, kw, C, M]` per-example filter gradients."""
    ctx = self.ctx
    b = ctx.batch_size
    taps = []
    for pair in self._slices(self.x, self.dz):
      if pair is None:
        taps.append(tf.zeros(tf.stack([b, self.c, self.m]), self.x.dtype))
        continue
      xs, ds = pair
      prod = ctx.split_batch(xs[..., None] * ds)  # [B, k, a, b, C, M]
      taps.append(tf.reduce_sum(prod, axis=[1, 2, 3]))
    g = tf.stack(taps, axis=1)
    return tf.reshape(g, tf.concat(
        [tf.shape(g)[:1], [*self.kernel, self.c, self.m]], 0))

  def weighted_sum(self, c):
    """`[kh, kw, C, M]`: `sum_b c[b] g_b`, dz scaled per example and a
    zero-factor example's rows of x selected to 0 (`scale_examples`,
    `drop_examples`: exact zeros for inf/NaN rows)."""
    ctx = self.ctx
    dz = ctx.scale_examples(self.dz, c)
    x = ctx.drop_examples(self.x, c)
    taps = []
    for pair in self._slices(x, dz):
      if pair is None:
        taps.append(tf.zeros([self.c, self.m], x.dtype))
        continue
      xs, ds = pair
      taps.append(tf.reduce_sum(xs[..., None] * ds, axis=[0, 1, 2]))
    return tf.reshape(tf.stack(taps), [*self.kernel, self.c, self.m])


def _depthwise_taps(ctx):
  """A `_DepthwiseTaps` for this depthwise convolution under XLA, or None
  outside XLA (native ops or the patch path) or when a spatial size, the
  channels or SAME padding's offsets are not static."""
  if not xla.in_xla_context():
    return None
  x = _to_channels_last(ctx, ctx.inputs[0])
  dz = _to_channels_last(ctx, ctx.dz)
  filt = ctx.inputs[1]
  if (x.shape.rank != 4 or dz.shape.rank != 4 or filt.shape.rank != 4 or
      None in x.shape[1:] or None in dz.shape[1:] or
      not x.dtype.is_floating):
    return None
  kernel = [int(d) for d in filt.shape[:2]]
  strides = _spatial(ctx, "strides", 4)
  dilations = _spatial(ctx, "dilations", 4)
  pads = _leading_pads(ctx, x.shape[1:3], kernel, strides, dilations)
  if pads is None:
    return None
  return _DepthwiseTaps(ctx, x, dz, kernel, strides, dilations, pads)


def _native_sq_norm(ctx, op, x, dz):
  """Native op `op` (`tf_pxg_conv2d_filter_sq_norm` or
  `tf_pxg_depthwise_conv2d_filter_sq_norm`) of channels-last `x` and the
  op's `dz`: `[B]` squared norms in `x`'s dtype, or None if SAME padding
  depends on a size that is not static."""
  kernel = [int(d) for d in ctx.inputs[1].shape[:2]]
  strides = _spatial(ctx, "strides", 4)
  dilations = _spatial(ctx, "dilations", 4)
  pads = _leading_pads(ctx, x.shape[1:3], kernel, strides, dilations)
  if pads is None:
    return None
  base.trace_note(sq_norm="native")
  return getattr(native.library(), op)(
      x, tf.cast(_to_channels_last(ctx, dz), x.dtype), ctx.batch_size,
      ksize=kernel, strides=strides, dilations=dilations, pads=pads,
      batch_minor=ctx.batch_minor)


def _native_weighted_sum(ctx, op, x, c):
  """Native op `op` (`tf_pxg_conv2d_filter_weighted_sum` or
  `tf_pxg_depthwise_conv2d_filter_weighted_sum`) of channels-last `x`, the
  op's dz and the clip factors `c`: `sum_b c[b] g_b` in the parameter's
  shape and dtype, the scaling fused into the sum and an example with
  `c[b] == 0` skipped (exactly 0 even if its rows are not finite); None if
  SAME padding depends on a size that is not static."""
  kernel = [int(d) for d in ctx.inputs[1].shape[:2]]
  strides = _spatial(ctx, "strides", 4)
  dilations = _spatial(ctx, "dilations", 4)
  pads = _leading_pads(ctx, x.shape[1:3], kernel, strides, dilations)
  if pads is None:
    return None
  base.trace_note(weighted_sum="native")
  w = getattr(native.library(), op)(
      x, tf.cast(_to_channels_last(ctx, ctx.dz), x.dtype),
      tf.cast(c, x.dtype), ksize=kernel, strides=strides,
      dilations=dilations, pads=pads, batch_minor=ctx.batch_minor)
  return tf.cast(tf.reshape(w, ctx.param_shape), ctx.param_dtype)


def _native_depthwise_weighted_sum(ctx, x, c):
  """`TfPxgDepthwiseConv2DFilterWeightedSum` (`_native_weighted_sum`)."""
  return _native_weighted_sum(
      ctx, "tf_pxg_depthwise_conv2d_filter_weighted_sum", x, c)


def _native_depthwise_sq_norm(ctx, x, dz):
  """`TfPxgDepthwiseConv2DFilterSqNorm` (`kernels/depthwise_norms.cc`) for a
  convolution that maps each input channel c of channels-last `x` to its own
  output channels c M .. c M + M - 1: a `DepthwiseConv2dNative`, or a
  `Conv2D` with one input channel per group."""
  return _native_sq_norm(ctx, "tf_pxg_depthwise_conv2d_filter_sq_norm", x,
                         dz)


@register("DepthwiseConv2dNative")
class DepthwiseConvRule(_PatchContraction):
  """`DepthwiseConv2dNative`: filter [kh, kw, C, M], output channel c*M+m."""

  mergeable = True

  def example_operands(self, ctx):
    return ctx.inputs[0], ctx.dz

  def operands(self, ctx, patched, other):
    x = _to_channels_last(ctx, patched)
    kh, kw, c, m = (int(d) for d in ctx.inputs[1].shape)
    patches, sub = _patches(ctx, x, [kh, kw])
    n = tf.shape(patches)[0]
    dz = tf.reshape(_to_channels_last(ctx, other), tf.stack([n, -1, c, m]))
    return (contraction.Spec(sub, "kcm", "npcm", "n", 0), patches, dz,
            _identity)

  def native_sq_norm(self, ctx):
    """`TfPxgDepthwiseConv2DFilterSqNorm` of the input and dz, where
    `native.serves` (float32/float64 on CPU outside XLA) and SAME padding's
    sizes are static; else None."""
    x, filt = ctx.inputs[0], ctx.inputs[1]
    if (filt.shape.rank != 4 or x.shape.rank != 4 or
        not native.serves(x, (tf.float32, tf.float64))):
      return None
    return _native_depthwise_sq_norm(ctx, _to_channels_last(ctx, x), ctx.dz)

  def taps(self, ctx):
    """Tap by tap under XLA (`_DepthwiseTaps`)."""
    return _depthwise_taps(ctx)

  def native_weighted_sum(self, ctx, c):
    """`TfPxgDepthwiseConv2DFilterWeightedSum`, where `native.serves`."""
    x, filt = ctx.inputs[0], ctx.inputs[1]
    if (filt.shape.rank != 4 or x.shape.rank != 4 or
        not native.serves(x, (tf.float32, tf.float64))):
      return None
    return _native_depthwise_weighted_sum(ctx, _to_channels_last(ctx, x), c)


@register("Conv2DBackpropInput")
class ConvTransposeRule(_PatchContraction):
  """Transposed conv `y = Conv2DBackpropInput(sizes, filter, d)`.

  Its filter gradient is `Conv2DBackpropFilter(dy, filter, d)`: patches of
  the output gradient dy contracted with the data input d.
  """

  def example_operands(self, ctx):
    return ctx.dz, ctx.inputs[2]

  def operands(self, ctx, patched, other):
    dy = _to_channels_last(ctx, patched)
    d = _to_channels_last(ctx, other)
    kh, kw, cy, cd = (int(v) for v in ctx.inputs[1].shape)
    patches, sub = _patches(ctx, dy, [kh, kw])
    n = tf.shape(patches)[0]
    d = tf.reshape(d, tf.stack([n, -1, cd]))
    return contraction.Spec(sub, "kcd", "npd", "n", 0), patches, d, _identity

  def check(self, ctx):
    if ctx.param_index == 2:
      raise NotImplementedError(f"{ctx.describe()}: parameter as out_backprop")
