// Per-example squared norms and clip-weighted sums of a depthwise 2-D
// convolution's filter gradient, without a patch tensor (tf_pxg.rules.conv;
// built by tf_pxg/native.py).
//
// A depthwise convolution (DepthwiseConv2dNative with filter [kh, kw, C, M],
// or Conv2D with C groups of one input channel and filter [kh, kw, 1, C M])
// maps input channel c to the M output channels c M + m:
//   y[n, oh, ow, c M + m] = sum_{i, j} x[n, oh sh + i dh - top,
//                                        ow sw + j dw - left, c] w[i, j, c, m]
// (NHWC, x read as 0 outside the image). The filter gradient of one row n
// of the batch is
//   G_n[i, j, c, m] = sum_{p = (oh, ow)} x[n, oh sh + i dh - top,
//                                          ow sw + j dw - left, c]
//                                        dz[n, oh, ow, c M + m],
// a product of channel vectors summed over the output positions where tap
// (i, j) reads inside the image (a rectangle). Example b owns k = N / B
// rows: b k .. b k + k - 1, or with `batch_minor` (rows [k, B], as after
// SpaceToBatchND) b, B + b, ...; its gradient G_b is the sum of their G_n.
//
// * TfPxgDepthwiseConv2DFilterSqNorm returns ||G_b||^2 for every example.
//   Units of work are (example, block of up to kMaxVectors channel
//   vectors); each accumulates its block of G_b tap by tap in vector
//   registers, squares and sums it (in double); the unit sums are added per
//   example at the end.
// * TfPxgDepthwiseConv2DFilterWeightedSum returns sum_b c[b] G_b
//   ([kh, kw, C, M]): the clip scaling fused into the sum, with an example
//   whose c[b] is 0 skipped (it adds exactly 0 even if its rows hold inf or
//   NaN). Units are (channel block, kernel row i), each over all examples.
//
// Both read x and dz in place when the block is whole vectors inside C and
// M is 1 (ConvNeXt's case), else copy the block's channels (dz reordered
// per multiplier m) into zero-padded buffers. G is never stored; the
// multiply-adds are those of the per-example gradient (B k P kh kw C M at
// most, fewer where taps fall in the padding). Work is sharded over TF's
// intra-op threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "kernel_util.h"
#include "register.h"
#include "vectors.h"

namespace tf_pxg {
namespace {

// The most vectors of channels one unit accumulates at a time.
constexpr int kMaxVectors = 4;

// The output positions [lo, hi) along one axis at which tap offset
// `offset` (tap index x dilation - leading pad) reads inside [0, size):
// 0 <= o stride + offset < size.
inline void ValidRange(int64_t size, int64_t out, int64_t stride,
                       int64_t offset, int64_t* lo, int64_t* hi) {
  const int64_t a = -offset, b = size - 1 - offset;
  const int64_t first = a <= 0 ? 0 : (a + stride - 1) / stride;
  const int64_t last = b < 0 ? -1 : b / stride;
  *lo = std::min(first, out);
  *hi = std::max(*lo, std::min(last + 1, out));
}

// The convolution's geometry (NHWC): input h x w, output oh x ow, kernel
// kh x kw, strides, dilations and leading (top, left) zero padding.
struct Geometry {
  int64_t h, w, oh, ow, kh, kw, sh, sw, dh, dw, top, left;
};

// One example's channel block: for each of its `rows` rows, where its x
// ([h][w] positions, `x_stride` values apart, the block's channels first)
// and its dz for one multiplier ([oh][ow], `g_stride` apart) start.
template <typename T>
struct Block {
  std::vector<const T*> x, g;
  int64_t x_stride = 0, g_stride = 0;
};

// For taps (i, j) with i in [i0, i1): calls `tap(i, j, acc)` with the NV
// vectors of G[i, j, block] = sum over rows and valid positions of x * dz.
template <typename T, int NV, typename F>
inline void TapSums(const Block<T>& block, const Geometry& q, int64_t i0,
                    int64_t i1, F&& tap) {
  using V = Vec<T>;
  constexpr int L = kLanes<T>;
  const int64_t rows = static_cast<int64_t>(block.x.size());
  const int64_t xs = block.x_stride, gs = block.g_stride;
  for (int64_t i = i0; i < i1; ++i) {
    int64_t y_lo, y_hi;
    ValidRange(q.h, q.oh, q.sh, i * q.dh - q.top, &y_lo, &y_hi);
    for (int64_t j = 0; j < q.kw; ++j) {
      int64_t x_lo, x_hi;
      const int64_t shift = j * q.dw - q.left;
      ValidRange(q.w, q.ow, q.sw, shift, &x_lo, &x_hi);
      V acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = V{};
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t a = y_lo; a < y_hi; ++a) {
          const int64_t y = a * q.sh + i * q.dh - q.top;
          const int64_t x_row = y * q.w + shift;  // + o sw: inside the row
          const T* gr = block.g[r] + a * q.ow * gs;
          for (int64_t o = x_lo; o < x_hi; ++o) {
            const T* xp = block.x[r] + (x_row + o * q.sw) * xs;
            const T* gp = gr + o * gs;
            for (int v = 0; v < NV; ++v)
              acc[v] += Load(xp + v * L) * Load(gp + v * L);
          }
        }
      }
      tap(i, j, acc);
    }
  }
}

// TapSums for the block's vector count `nv` (1 .. kMaxVectors).
template <typename T, typename F>
inline void TapSumsOf(int nv, const Block<T>& block, const Geometry& q,
                      int64_t i0, int64_t i1, F&& tap) {
  switch (nv) {
    case 4: TapSums<T, 4>(block, q, i0, i1, tap); break;
    case 3: TapSums<T, 3>(block, q, i0, i1, tap); break;
    case 2: TapSums<T, 2>(block, q, i0, i1, tap); break;
    default: TapSums<T, 1>(block, q, i0, i1, tap);
  }
}

// Reads the attrs and inputs both ops share and points a unit's blocks at
// the data: x [N, h, w, C], dz [N, oh, ow, C M], `examples` B dividing N.
template <typename T>
class DepthwiseBase : public OpKernel {
 public:
  explicit DepthwiseBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("batch_minor", &batch_minor_));
    ReadWindowAttrs(ctx, &attrs_);
  }


 protected:
  // Validates x and dz against `examples`; false (status set) if invalid.
  bool Setup(OpKernelContext* ctx, const Tensor& x, const Tensor& dz,
             int64_t examples) {
    if (!(x.dims() == 4 && dz.dims() == 4)) {
      ctx->CtxFailure(absl::InvalidArgumentError("x and dz must be NHWC"));
      return false;
    }
    n_ = x.dim_size(0);
    c_ = x.dim_size(3);
    const int64_t co = dz.dim_size(3);
    q_ = Geometry{x.dim_size(1), x.dim_size(2), dz.dim_size(1),
                  dz.dim_size(2), attrs_[0][0], attrs_[0][1], attrs_[1][0],
                  attrs_[1][1], attrs_[2][0], attrs_[2][1], attrs_[3][0],
                  attrs_[3][1]};
    absl::Status bad;
    if (dz.dim_size(0) != n_) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("x has ", n_, " rows and dz ", dz.dim_size(0)));
    } else if (c_ == 0 ? co != 0 : co % c_ != 0) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "dz's ", co, " channels are not a multiple of x's ", c_));
    } else if (examples < 0 || (examples > 0 ? n_ % examples != 0 : n_ != 0)) {
      bad = absl::InvalidArgumentError(
          absl::StrCat(n_, " rows are not a whole number per example for ",
                       examples, " examples"));
    }
    if (!bad.ok()) {
      ctx->CtxFailure(bad);
      return false;
    }
    examples_ = examples;
    k_ = examples > 0 ? n_ / examples : 0;
    m_ = c_ > 0 ? co / c_ : 0;
    vectors_ = (c_ + kLanes<T> - 1) / kLanes<T>;
    blocks_ = (vectors_ + kMaxVectors - 1) / kMaxVectors;
    xs_ = x.flat<T>().data();
    gs_ = dz.flat<T>().data();
    return true;
  }

  // Vectors in channel block `block`.
  int Vectors(int64_t block) const {
    return static_cast<int>(
        std::min<int64_t>(kMaxVectors, vectors_ - block * kMaxVectors));
  }

  // Points `out` at example b's channel block `block`, multiplier m: at
  // x and dz themselves when the block is whole vectors inside C and M is
  // 1, else at copies in `x_buf` / `g_buf` (zero-padded to whole vectors;
  // the x copy is reused for every m: pass `copy_x` false after m = 0).
  void Point(int64_t b, int64_t block, int64_t m, bool copy_x,
             std::vector<T>* x_buf, std::vector<T>* g_buf,
             Block<T>* out) const {
    constexpr int L = kLanes<T>;
    const int nv = Vectors(block);
    const int64_t c0 = block * kMaxVectors * L, width = nv * L;
    const int64_t hw = q_.h * q_.w, ohw = q_.oh * q_.ow, co = c_ * m_;
    out->x.resize(k_);
    out->g.resize(k_);
    const bool whole = c0 + width <= c_;
    if (whole) {
      out->x_stride = c_;
      for (int64_t r = 0; r < k_; ++r)
        out->x[r] = xs_ + Row(b, r) * hw * c_ + c0;
    } else {
      out->x_stride = width;
      if (copy_x) {
        x_buf->assign(k_ * hw * width, T(0));
        const int64_t valid = c_ - c0;
        for (int64_t r = 0; r < k_; ++r) {
          const T* src = xs_ + Row(b, r) * hw * c_ + c0;
          T* dst = x_buf->data() + r * hw * width;
          for (int64_t p = 0; p < hw; ++p)
            std::memcpy(dst + p * width, src + p * c_, valid * sizeof(T));
        }
      }
      for (int64_t r = 0; r < k_; ++r)
        out->x[r] = x_buf->data() + r * hw * width;
    }
    if (whole && m_ == 1) {
      out->g_stride = co;
      for (int64_t r = 0; r < k_; ++r)
        out->g[r] = gs_ + Row(b, r) * ohw * co + c0;
      return;
    }
    out->g_stride = width;
    g_buf->assign(k_ * ohw * width, T(0));
    const int64_t valid = std::min(width, c_ - c0);
    for (int64_t r = 0; r < k_; ++r) {
      const T* src = gs_ + Row(b, r) * ohw * co + c0 * m_ + m;
      T* dst = g_buf->data() + r * ohw * width;
      for (int64_t p = 0; p < ohw; ++p)
        for (int64_t q = 0; q < valid; ++q)
          dst[p * width + q] = src[p * co + q * m_];
      out->g[r] = dst;
    }
  }

  // Example b's r-th of k rows: rows b k .. b k + k - 1, or with the
  // examples minor (as after SpaceToBatchND) rows b, B + b, 2 B + b, ...
  int64_t Row(int64_t b, int64_t r) const {
    return batch_minor_ ? r * examples_ + b : b * k_ + r;
  }

  static int64_t Examples(const Tensor& t) {
    return t.dtype() == ::tensorflow::DT_INT32 ? t.scalar<int32_t>()()
                                               : t.scalar<int64_t>()();
  }

  bool batch_minor_ = false;
  std::vector<std::vector<int32_t>> attrs_;
  Geometry q_{};
  int64_t n_ = 0, c_ = 0, k_ = 0, m_ = 0, examples_ = 0, vectors_ = 0,
          blocks_ = 0;
  const T* xs_ = nullptr;
  const T* gs_ = nullptr;
};

template <typename T>
class DepthwiseConv2DFilterSqNormOp : public DepthwiseBase<T> {
 public:
  using DepthwiseBase<T>::DepthwiseBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& examples_t = ctx->input(2);
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(
                         examples_t.shape()),
                absl::InvalidArgumentError("examples must be a scalar"));
    const int64_t examples = this->Examples(examples_t);
    if (!this->Setup(ctx, ctx->input(0), ctx->input(1), examples)) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({examples}), &out));
    T* sq = out->flat<T>().data();
    std::fill(sq, sq + examples, T(0));
    if (examples == 0 || this->n_ == 0 || this->c_ == 0) return;
    const int64_t blocks = this->blocks_;
    std::vector<double> partial(examples * blocks, 0.0);
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<T> x_buf, g_buf;
      Block<T> block;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / blocks, blk = unit % blocks;
        const int nv = this->Vectors(blk);
        double sum = 0;
        for (int64_t m = 0; m < this->m_; ++m) {
          this->Point(b, blk, m, m == 0, &x_buf, &g_buf, &block);
          TapSumsOf<T>(nv, block, this->q_, 0, this->q_.kh,
                       [&](int64_t, int64_t, const Vec<T>* acc) {
                         Vec<T> s = Vec<T>{};
                         for (int v = 0; v < nv; ++v) s += acc[v] * acc[v];
                         sum += SumLanes<T>(s);
                       });
        }
        partial[unit] = sum;
      }
    };
    const Geometry& q = this->q_;
    const int64_t per_unit = this->k_ * this->m_ * q.oh * q.ow * q.kh * q.kw *
                             kMaxVectors * kLanes<T>;
    ShardOverThreads(ctx, examples * blocks, std::max<int64_t>(per_unit, 1),
                     work);
    for (int64_t b = 0; b < examples; ++b) {
      double total = 0;
      for (int64_t blk = 0; blk < blocks; ++blk)
        total += partial[b * blocks + blk];
      sq[b] = static_cast<T>(total);
    }
  }
};

// sum_b c[b] G_b: the clip-weighted sum of the per-example filter
// gradients, [kh, kw, C, M]; an example with c[b] == 0 is skipped (adds
// exactly 0 even if its rows hold inf/NaN). Units are (channel block,
// kernel row i) pairs, each over all examples; for every tap the block's
// entries are accumulated per example in registers, scaled by c[b] and
// added into a running sum (the order of the plain filter gradient's
// products, then one multiply per example and entry).
template <typename T>
class DepthwiseConv2DFilterWeightedSumOp : public DepthwiseBase<T> {
 public:
  using DepthwiseBase<T>::DepthwiseBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& c = ctx->input(2);
    OP_REQUIRES(ctx, c.dims() == 1,
                absl::InvalidArgumentError("c must be a vector"));
    const int64_t examples = c.dim_size(0);
    if (!this->Setup(ctx, ctx->input(0), ctx->input(1), examples)) return;
    const Geometry& q = this->q_;
    const int64_t channels = this->c_, m_count = this->m_;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({q.kh, q.kw, channels, m_count}),
                            &out));
    T* g = out->flat<T>().data();
    std::fill(g, g + out->NumElements(), T(0));
    if (examples == 0 || this->n_ == 0 || channels == 0) return;
    const T* cs = c.flat<T>().data();
    const int64_t blocks = this->blocks_;
    constexpr int L = kLanes<T>;
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<T> x_buf, g_buf;
      Block<T> block;
      // The unit's running sums: [kw][m][nv vectors] for one kernel row.
      std::vector<T> total;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t blk = unit / q.kh, i = unit % q.kh;
        const int nv = this->Vectors(blk);
        total.assign(q.kw * m_count * nv * L, T(0));
        for (int64_t b = 0; b < examples; ++b) {
          const T f = cs[b];
          if (f == T(0)) continue;
          for (int64_t m = 0; m < m_count; ++m) {
            this->Point(b, blk, m, m == 0, &x_buf, &g_buf, &block);
            TapSumsOf<T>(nv, block, q, i, i + 1,
                         [&](int64_t, int64_t j, const Vec<T>* acc) {
                           T* t = total.data() + (j * m_count + m) * nv * L;
                           for (int v = 0; v < nv; ++v) {
                             Vec<T> s = Load(t + v * L) + acc[v] * f;
                             std::memcpy(t + v * L, &s, sizeof(s));
                           }
                         });
          }
        }
        const int64_t c0 = blk * kMaxVectors * L;
        const int64_t width = std::min<int64_t>(nv * L, channels - c0);
        for (int64_t j = 0; j < q.kw; ++j)
          for (int64_t m = 0; m < m_count; ++m) {
            const T* t = total.data() + (j * m_count + m) * nv * L;
            T* dst = g + ((i * q.kw + j) * channels + c0) * m_count + m;
            for (int64_t w = 0; w < width; ++w) dst[w * m_count] = t[w];
          }
      }
    };
    const int64_t per_unit = this->n_ * m_count * q.oh * q.ow * q.kw *
                             kMaxVectors * L;
    ShardOverThreads(ctx, blocks * q.kh, std::max<int64_t>(per_unit, 1),
                     work);
  }
};

REGISTER_OP("TfPxgDepthwiseConv2DFilterSqNorm")
    .Input("x: T")
    .Input("dz: T")
    .Input("examples: Tindex")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("dilations: list(int)")
    .Attr("pads: list(int)")
    .Attr("batch_minor: bool = false")
    .Attr("T: {float, double}")
    .Attr("Tindex: {int32, int64}")
    .Output("sq: T")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::DimensionHandle examples;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &examples));
      c->set_output(0, c->Vector(examples));
      return absl::OkStatus();
    });

TF_PXG_REGISTER_REAL_CPU_KERNELS("TfPxgDepthwiseConv2DFilterSqNorm",
                                 DepthwiseConv2DFilterSqNormOp);

REGISTER_OP("TfPxgDepthwiseConv2DFilterWeightedSum")
    .Input("x: T")
    .Input("dz: T")
    .Input("c: T")
    .Attr("ksize: list(int)")
    .Attr("strides: list(int)")
    .Attr("dilations: list(int)")
    .Attr("pads: list(int)")
    .Attr("batch_minor: bool = false")
    .Attr("T: {float, double}")
    .Output("g: T")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      using ::tensorflow::shape_inference::DimensionHandle;
      using ::tensorflow::shape_inference::ShapeHandle;
      std::vector<int32_t> ksize;
      TF_RETURN_IF_ERROR(c->GetAttr("ksize", &ksize));
      if (ksize.size() != 2)
        return absl::InvalidArgumentError("ksize needs 2 values");
      ShapeHandle x, dz;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &dz));
      DimensionHandle channels = c->Dim(x, 3), m;
      if (c->ValueKnown(channels) && c->ValueKnown(c->Dim(dz, 3)) &&
          c->Value(channels) > 0) {
        m = c->MakeDim(c->Value(c->Dim(dz, 3)) / c->Value(channels));
      } else {
        m = c->UnknownDim();
      }
      c->set_output(0, c->MakeShape({c->MakeDim(ksize[0]),
                                     c->MakeDim(ksize[1]), channels, m}));
      return absl::OkStatus();
    });

TF_PXG_REGISTER_REAL_CPU_KERNELS("TfPxgDepthwiseConv2DFilterWeightedSum",
                                 DepthwiseConv2DFilterWeightedSumOp);

}  // namespace
}  // namespace tf_pxg
