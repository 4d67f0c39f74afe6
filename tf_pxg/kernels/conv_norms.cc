// Per-example squared norms of a 2-D convolution's filter gradient, without
// a patch tensor (tf_pxg.rules.conv; built by tf_pxg/native.py).
//
// For y = conv2d(x, w) (NHWC, strides sh x sw, dilations dh x dw, explicit
// zero padding `top`/`left` before the input, one group) with output
// gradient dz, the filter gradient of one row n of the batch is
//   G_n[i, j, c, o] = sum_{p = (oh, ow)} x[n, oh sh + i dh - top,
//                                          ow sw + j dw - left, c]
//                                        dz[n, oh, ow, o]
// (x read as 0 outside the image). Example b owns k = N / B rows: b k ..
// b k + k - 1, or with `batch_minor` (rows [k, B], as after SpaceToBatchND)
// b, B + b, ..., and its gradient is the sum of their G_n. The op returns
// ||sum_n G_n||^2 for every example.
//
// Per example, one thread copies the patches of its k rows into a buffer
// [k P, kh kw C] and dz into [k P, Cout rounded up to whole vectors] (a few
// KB to a few hundred KB: in cache), then for each block of R patch columns
// and each vector of output channels accumulates the R vectors of G's
// entries in registers over the k P positions, squares and sums them. G is
// never stored; the multiply-adds are those of the per-example gradient
// (B P kh kw C Cout), without the [B, P, kh kw C] patch tensor or the
// P x P Gram matrices of the ghost norm. Examples are sharded over TF's
// intra-op threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

// A block has as many rows as leaves vector registers free for the tile of
// dz and the broadcast value.
#if defined(__AVX512F__)
constexpr int kMaxRows = 16;
#else
constexpr int kMaxRows = 8;
#endif

// Adds sum_{r < R, l} (sum_p patches[p, r] g[p, l])^2 to *sum: `patches`
// holds `positions` rows of `stride` values (the block's column r of
// position p at patches[p * stride + r]); `g` holds each position's vector
// of output channels, `g_stride` values apart.
template <typename T, int R>
inline void BlockSquares(const T* patches, int64_t stride, const T* g,
                         int64_t g_stride, int64_t positions, double* sum) {
  using V = Vec<T>;
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V{};
  for (int64_t p = 0; p < positions; ++p) {
    const T* xp = patches + p * stride;
    const V gp = Load(g + p * g_stride);
    for (int r = 0; r < R; ++r) acc[r] += xp[r] * gp;
  }
  V s = V{};
  for (int r = 0; r < R; ++r) s += acc[r] * acc[r];
  *sum += SumLanes<T>(s);
}

// BlockSquares over all `rows` columns of the patches: blocks of kMaxRows
// columns, then one each of 8, 4, 2, 1 for the remainder.
template <typename T>
void RowsSquares(const T* patches, int64_t rows, const T* g, int64_t g_stride,
                 int64_t positions, double* sum) {
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    BlockSquares<T, kMaxRows>(patches + r, rows, g, g_stride, positions, sum);
  for (int size = kMaxRows / 2; size >= 1; size /= 2) {
    if (rows - r < size) continue;
    const T* p = patches + r;
    switch (size) {
      case 8: BlockSquares<T, 8>(p, rows, g, g_stride, positions, sum); break;
      case 4: BlockSquares<T, 4>(p, rows, g, g_stride, positions, sum); break;
      case 2: BlockSquares<T, 2>(p, rows, g, g_stride, positions, sum); break;
      default: BlockSquares<T, 1>(p, rows, g, g_stride, positions, sum);
    }
    r += size;
  }
}

template <typename T>
class Conv2DFilterSqNormOp : public OpKernel {
 public:
  explicit Conv2DFilterSqNormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("batch_minor", &batch_minor_));
    for (const char* name : {"ksize", "strides", "dilations", "pads"}) {
      std::vector<int32_t> v;
      OP_REQUIRES_OK(ctx, ctx->GetAttr(name, &v));
      OP_REQUIRES(ctx, v.size() == 2,
                  absl::InvalidArgumentError(
                      absl::StrCat(name, " needs 2 values (height, width)")));
      attrs_.push_back(v);
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& dz = ctx->input(1);
    const Tensor& examples_t = ctx->input(2);
    OP_REQUIRES(ctx, x.dims() == 4 && dz.dims() == 4,
                absl::InvalidArgumentError("x and dz must be NHWC"));
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(
                         examples_t.shape()),
                absl::InvalidArgumentError("examples must be a scalar"));
    const int64_t n = x.dim_size(0), h = x.dim_size(1), w = x.dim_size(2),
                  c = x.dim_size(3), oh = dz.dim_size(1), ow = dz.dim_size(2),
                  co = dz.dim_size(3);
    const int64_t examples = examples_t.dtype() == ::tensorflow::DT_INT32
                                 ? examples_t.scalar<int32_t>()()
                                 : examples_t.scalar<int64_t>()();
    OP_REQUIRES(ctx, dz.dim_size(0) == n,
                absl::InvalidArgumentError(absl::StrCat(
                    "x has ", n, " rows and dz ", dz.dim_size(0))));
    OP_REQUIRES(ctx, examples > 0 ? n % examples == 0 : n == 0,
                absl::InvalidArgumentError(absl::StrCat(
                    n, " rows are not a whole number per example for ",
                    examples, " examples")));
    const int64_t kh = attrs_[0][0], kw = attrs_[0][1], sh = attrs_[1][0],
                  sw = attrs_[1][1], dh = attrs_[2][0], dw = attrs_[2][1],
                  top = attrs_[3][0], left = attrs_[3][1];
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({examples}), &out));
    if (n == 0) return;
    const int64_t k = n / examples;
    const T* xs = x.flat<T>().data();
    const T* gs = dz.flat<T>().data();
    const T* x_end = xs + x.NumElements();
    T* sq = out->flat<T>().data();
    constexpr int L = kLanes<T>;
    const int64_t row_positions = oh * ow, positions = k * row_positions,
                  rows = kh * kw * c, run = kw * c,
                  run_vectors = (run + L - 1) / L,
                  g_stride = (co + L - 1) / L * L;
    auto work = [&](int64_t begin, int64_t end) {
      // One example's patches [k P, kh kw C] (plus slack for whole-vector
      // copies) and dz [k P, g_stride] (zero-padded): in this thread's cache.
      std::vector<T> patches(positions * rows + L), g(positions * g_stride);
      for (int64_t b = begin; b < end; ++b) {
        T* dst = patches.data();
        for (int64_t r = 0; r < k; ++r) {
          const T* xb = xs + Row(b, r, k, examples) * h * w * c;
          for (int64_t i = 0; i < oh; ++i) {
            for (int64_t j = 0; j < ow; ++j) {
              const int64_t x0 = j * sw - left;
              for (int64_t ki = 0; ki < kh; ++ki, dst += run) {
                const int64_t y = i * sh + ki * dh - top;
                const T* src = xb + (y * w + x0) * c;
                if (y < 0 || y >= h) {
                  std::fill(dst, dst + run, T(0));
                } else if (dw == 1 && x0 >= 0 && x0 + kw <= w &&
                           src + run_vectors * L <= x_end) {
                  // Whole vectors: the copy's tail past `run` is overwritten
                  // by the next run or lands in the slack.
                  for (int64_t q = 0; q < run_vectors * L; q += L)
                    std::memcpy(dst + q, src + q, L * sizeof(T));
                } else {
                  for (int64_t kj = 0; kj < kw; ++kj) {
                    const int64_t xi = x0 + kj * dw;
                    const bool inside = xi >= 0 && xi < w;
                    for (int64_t q = 0; q < c; ++q)
                      dst[kj * c + q] = inside ? src[kj * dw * c + q] : T(0);
                  }
                }
              }
            }
          }
        }
        for (int64_t p = 0; p < positions; ++p) {
          const int64_t r = p / row_positions;
          const T* src = gs + (Row(b, r, k, examples) * row_positions +
                               p % row_positions) * co;
          T* dst_g = g.data() + p * g_stride;
          std::memcpy(dst_g, src, co * sizeof(T));
          std::fill(dst_g + co, dst_g + g_stride, T(0));
        }
        double sum = 0;
        for (int64_t t = 0; t < g_stride; t += L)
          RowsSquares<T>(patches.data(), rows, g.data() + t, g_stride,
                         positions, &sum);
        sq[b] = static_cast<T>(sum);
      }
    };
    ShardOverThreads(ctx, examples,
                     /*cost_per_unit=*/positions * rows * g_stride, work);
  }

 private:
  // Example b's r-th of k rows: rows b k .. b k + k - 1, or with the
  // examples minor (as after SpaceToBatchND) rows b, B + b, 2 B + b, ...
  int64_t Row(int64_t b, int64_t r, int64_t k, int64_t examples) const {
    return batch_minor_ ? r * examples + b : b * k + r;
  }

  bool batch_minor_ = false;
  std::vector<std::vector<int32_t>> attrs_;
};

REGISTER_OP("TfPxgConv2DFilterSqNorm")
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

TF_PXG_REGISTER_REAL_CPU_KERNELS("TfPxgConv2DFilterSqNorm", Conv2DFilterSqNormOp);

}  // namespace
}  // namespace tf_pxg
