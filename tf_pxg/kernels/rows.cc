// Row-wise ops on [N, ...] tensors (built by tf_pxg/native.py):
//
// * TfPxgRowSumOfSquares: sq[n] = sum over x[n, ...] of x^2 (tf_pxg.rules'
//   ghost norms of one-row examples and norms of materialised per-example
//   gradients);
// * TfPxgScaleRows: y[n, ...] = t[n, ...] c[n / k], k = N / len(c) rows per
//   example (the clip factors applied to an output gradient before the
//   weighted-sum matmul). One streaming pass, where TF's broadcasting Mul
//   is slower (figures: docs/benchmarks.md). A zero factor writes exact
//   zeros (not t * 0, which is NaN for inf/NaN entries), so a non-finite
//   example with clip factor 0 adds nothing to the weighted sum.
//
// TF's Square + Sum over the inner axes makes two passes (and Eigen's
// inner-axis reduction); this is one pass of vector multiply-adds into four independent accumulators
// (added in double every kBlock elements), rows sharded over TF's intra-op
// threads.

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "kernel_util.h"
#include "register.h"
#include "vectors.h"

namespace tf_pxg {
namespace {

// Vector partial sums over blocks of kBlock elements, each block's added in
// double (so long rows keep float32's accuracy per block, not per row).
constexpr int64_t kBlock = 4096;

template <typename T>
double SumOfSquares(const T* x, int64_t n) {
  constexpr int L = kLanes<T>;
  using V = Vec<T>;
  double total = 0;
  int64_t i = 0;
  while (i + 4 * L <= n) {
    V a0 = V{}, a1 = V{}, a2 = V{}, a3 = V{};
    const int64_t stop = std::min(n, i + kBlock);
    for (; i + 4 * L <= stop; i += 4 * L) {
      const V v0 = Load(x + i), v1 = Load(x + i + L),
              v2 = Load(x + i + 2 * L), v3 = Load(x + i + 3 * L);
      a0 += v0 * v0;
      a1 += v1 * v1;
      a2 += v2 * v2;
      a3 += v3 * v3;
    }
    total += SumLanes<T>((a0 + a1) + (a2 + a3));
  }
  for (; i < n; ++i) total += static_cast<double>(x[i]) * x[i];
  return total;
}

template <typename T>
class RowSumOfSquaresOp : public OpKernel {
 public:
  explicit RowSumOfSquaresOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() >= 1,
                absl::InvalidArgumentError("x needs a leading (row) axis"));
    const int64_t rows = x.dim_size(0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows}), &out));
    if (rows == 0) return;
    const int64_t row = x.NumElements() / rows;
    const T* xs = x.flat<T>().data();
    T* sq = out->flat<T>().data();
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        sq[r] = static_cast<T>(SumOfSquares(xs + r * row, row));
    };
    ShardOverThreads(ctx, rows, /*cost_per_unit=*/row, work);
  }
};

template <typename T>
class ScaleRowsOp : public OpKernel {
 public:
  explicit ScaleRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& t = ctx->input(0);
    const Tensor& c = ctx->input(1);
    OP_REQUIRES(ctx, t.dims() >= 1 && c.dims() == 1,
                absl::InvalidArgumentError(
                    "t needs a leading (row) axis and c must be a vector"));
    const int64_t rows = t.dim_size(0), examples = c.dim_size(0);
    OP_REQUIRES(ctx, examples > 0 ? rows % examples == 0 : rows == 0,
                absl::InvalidArgumentError(absl::StrCat(
                    rows, " rows are not a whole number per example for ",
                    examples, " scale factors")));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                            {0}, 0, t.shape(), &out));
    if (rows == 0) return;
    const int64_t row = t.NumElements() / rows, k = rows / examples;
    const T* ts = t.flat<T>().data();
    const T* cs = c.flat<T>().data();
    T* ys = out->flat<T>().data();
    auto work = [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T f = cs[r / k];
        const T* src = ts + r * row;
        T* dst = ys + r * row;
        if (f == T(0)) {
          std::fill(dst, dst + row, T(0));
        } else {
          for (int64_t i = 0; i < row; ++i) dst[i] = src[i] * f;
        }
      }
    };
    ShardOverThreads(ctx, rows, /*cost_per_unit=*/row, work);
  }
};

REGISTER_OP("TfPxgScaleRows")
    .Input("t: T")
    .Input("c: T")
    .Attr("T: {float, double}")
    .Output("y: T")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

TF_PXG_REGISTER_REAL_CPU_KERNELS("TfPxgScaleRows", ScaleRowsOp);

REGISTER_OP("TfPxgRowSumOfSquares")
    .Input("x: T")
    .Attr("T: {float, double}")
    .Output("sq: T")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
      c->set_output(0, c->Vector(c->Dim(x, 0)));
      return absl::OkStatus();
    });

TF_PXG_REGISTER_REAL_CPU_KERNELS("TfPxgRowSumOfSquares", RowSumOfSquaresOp);

}  // namespace
}  // namespace tf_pxg
