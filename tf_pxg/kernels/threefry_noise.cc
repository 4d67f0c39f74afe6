// Gaussian noise for DP-SGD as a TensorFlow CPU op: the native twin of
// tf_pxg/dp/threefry.py (see its docstring for the definition).
//
// Element e of a draw (e counts from the draw's `start`) is, with
//   (a, b) = Threefry-2x32-20(key = (k0, k1), counter = (e >> 1, k2)),
//   r      = sqrt(-2 log((a + 1/2) 2^-32)),
//   theta  = 2 pi b 2^-32,
// r cos(theta) for even e and r sin(theta) for odd e: both outputs of one
// Box-Muller pair. The XLA kernel computes each element on its own (XLA
// fuses per output element, so sharing a pair would not save work there);
// this kernel computes each pair once. Both evaluate the same formulas:
// the same integer reduction of the angle and the same polynomials, so the
// two agree to float rounding (different log implementations).
//
// The sampling itself is in threefry_normal.h (no TensorFlow dependency,
// so benchmarks/threefry_rounds.cc times it alone). The loops are written
// for the compiler's auto-vectoriser (built with -O3 at the CPU's
// instruction-set level, e.g. -march=x86-64-v4, by tf_pxg/native.py) and
// split over TF's intra-op threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "kernel_util.h"
#include "threefry_normal.h"

namespace tf_pxg {
namespace {

using ::tf_pxg::threefry_normal::kPairs;
using ::tf_pxg::threefry_normal::NormalPairs;

using ::tensorflow::DEVICE_CPU;

// An InvalidArgument status whose message is the arguments, concatenated.
template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}

// Sets `status` on `ctx` unless `ok`; returns `ok`.
bool Require(OpKernelContext* ctx, bool ok, const absl::Status& status) {
  if (!ok) ctx->CtxFailure(status);
  return ok;
}

// One draw's parameters: the Threefry key and counter high word, the
// noise's standard deviation, and a factor applied to the whole result.
struct Draw {
  uint32_t k0, k1, k2;
  float stddev, scale;
};

// out[l] = scale (in[l] + stddev z[start + l]) for l in [0, n), with
// in[l] = 0 if `in` is null.
void AddNoise(OpKernelContext* ctx, const float* in, float* out, int64_t n,
              int64_t start, const Draw& d) {
  if (n == 0) return;
  const int64_t first_pair = start >> 1;
  const int64_t last_pair = (start + n - 1) >> 1;
  const int64_t blocks = (last_pair - first_pair) / kPairs + 1;
  const float noise_scale = d.stddev * d.scale;
  auto work = [&](int64_t begin, int64_t end) {
    alignas(64) float z[2 * kPairs];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = first_pair + blk * kPairs;
      NormalPairs(d.k0, d.k1, d.k2, static_cast<uint32_t>(c0), noise_scale,
                  z);
      const int64_t e0 = 2 * c0 - start;  // local index of z[0]
      const int64_t lo = std::max<int64_t>(e0, 0);
      const int64_t hi = std::min<int64_t>(e0 + 2 * kPairs, n);
      const float* zb = z + (lo - e0);
      const int64_t m = hi - lo;
      if (in != nullptr) {
        for (int64_t l = 0; l < m; ++l) {
          out[lo + l] = in[lo + l] * d.scale + zb[l];
        }
      } else {
        for (int64_t l = 0; l < m; ++l) out[lo + l] = zb[l];
      }
    }
  };
  // Cost per pair for TF's sharder: an estimate with margin (measured
  // per-Gaussian figures are in docs/benchmarks.md, not here).
  ShardOverThreads(ctx, blocks, kPairs * 40, work);
}

// Reads the last three inputs (key, stddev, scale) into `d`.
bool ReadDraw(OpKernelContext* ctx, Draw* d) {
  const int n = ctx->num_inputs();
  const Tensor& key = ctx->input(n - 3);
  const Tensor& stddev = ctx->input(n - 2);
  const Tensor& scale = ctx->input(n - 1);
  if (!Require(ctx, key.dims() == 1 && key.NumElements() == 3,
               InvalidArgument("key must be a shape [3] uint32 tensor, got ",
                               key.shape().DebugString())) ||
      !Require(ctx, stddev.dims() == 0 && scale.dims() == 0,
               InvalidArgument("stddev and scale must be scalars, got ",
                               stddev.shape().DebugString(), " and ",
                               scale.shape().DebugString()))) {
    return false;
  }
  auto kv = key.flat<uint32_t>();
  *d = Draw{kv(0), kv(1), kv(2), stddev.scalar<float>()(),
            scale.scalar<float>()()};
  return true;
}

bool CheckRange(OpKernelContext* ctx, int64_t start, int64_t n) {
  return Require(ctx, start + n <= 4294967295LL,
                 InvalidArgument("one noise draw holds at most 2**32 - 1 "
                                 "elements; this one needs ", start + n,
                                 ". Split the variables over several calls."));
}

class AddNormalNoiseOp : public OpKernel {
 public:
  explicit AddNormalNoiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("start", &start_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& in = ctx->input(0);
    Draw d;
    if (!ReadDraw(ctx, &d) || !CheckRange(ctx, start_, in.NumElements())) {
      return;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                            {0}, 0, in.shape(), &out));
    AddNoise(ctx, in.flat<float>().data(), out->flat<float>().data(),
             in.NumElements(), start_, d);
  }

 private:
  int64_t start_;
};

template <typename Index>
class NormalNoiseScatterAddOp : public OpKernel {
 public:
  explicit NormalNoiseScatterAddOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("start", &start_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dense_shape", &shape_));
    OP_REQUIRES(ctx, shape_.dims() >= 1,
                InvalidArgument("dense_shape must have rank >= 1"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    Draw d;
    if (!ReadDraw(ctx, &d) ||
        !CheckRange(ctx, start_, shape_.num_elements())) {
      return;
    }
    const int64_t rows = shape_.dim_size(0);
    const int64_t row_size = rows == 0 ? 0 : shape_.num_elements() / rows;
    const int64_t n = indices.NumElements();
    OP_REQUIRES(ctx, indices.dims() == 1,
                InvalidArgument("indices must be a vector, got ",
                                indices.shape().DebugString()));
    OP_REQUIRES(ctx,
                values.NumElements() == n * row_size &&
                    (values.dims() == 0 || values.dim_size(0) == n),
                InvalidArgument("values ", values.shape().DebugString(),
                                " do not match ", n,
                                " rows of the dense shape ",
                                shape_.DebugString()));
    auto idx = indices.flat<Index>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = static_cast<int64_t>(idx(i));
      OP_REQUIRES(ctx, row >= 0 && row < rows,
                  InvalidArgument("row index ", row, " is outside [0, ",
                                  rows, ")"));
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape_, &out));
    float* o = out->flat<float>().data();
    AddNoise(ctx, nullptr, o, shape_.num_elements(), start_, d);
    // Each thread adds the rows that fall in its share of the table (a
    // scan of the indices each), so no two threads write one row.
    const float* v = values.flat<float>().data();
    const int64_t parts = std::max<int64_t>(
        1, std::min<int64_t>(
               ctx->device()->tensorflow_cpu_worker_threads()->num_threads,
               rows));
    auto add_rows = [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        const int64_t lo = rows * part / parts;
        const int64_t hi = rows * (part + 1) / parts;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t row = static_cast<int64_t>(idx(i));
          if (row < lo || row >= hi) continue;
          float* dst = o + row * row_size;
          const float* src = v + i * row_size;
          for (int64_t j = 0; j < row_size; ++j) dst[j] += src[j] * d.scale;
        }
      }
    };
    ShardOverThreads(ctx, parts,
                     std::max<int64_t>(n * row_size / parts, 1) * 10,
                     add_rows);
  }

 private:
  int64_t start_;
  TensorShape shape_;
};

}  // namespace

REGISTER_OP("TfPxgAddNormalNoise")
    .Input("tensor: float")
    .Input("key: uint32")
    .Input("stddev: float")
    .Input("scale: float")
    .Attr("start: int >= 0")
    .Output("noisy: float")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("scale * (tensor + stddev * z), z the elements start.. of the "
         "Threefry draw.");

REGISTER_OP("TfPxgNormalNoiseScatterAdd")
    .Input("values: float")
    .Input("indices: Tindices")
    .Input("key: uint32")
    .Input("stddev: float")
    .Input("scale: float")
    .Attr("dense_shape: shape")
    .Attr("start: int >= 0")
    .Attr("Tindices: {int32, int64}")
    .Output("noisy: float")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::PartialTensorShape shape;
      TF_RETURN_IF_ERROR(c->GetAttr("dense_shape", &shape));
      ::tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc("scale * (stddev * z + the rows scatter-added), z the elements "
         "start.. of the draw.");

REGISTER_KERNEL_BUILDER(Name("TfPxgAddNormalNoise").Device(DEVICE_CPU),
                        AddNormalNoiseOp);
REGISTER_KERNEL_BUILDER(Name("TfPxgNormalNoiseScatterAdd")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<int32_t>("Tindices"),
                        NormalNoiseScatterAddOp<int32_t>);
REGISTER_KERNEL_BUILDER(Name("TfPxgNormalNoiseScatterAdd")
                            .Device(DEVICE_CPU)
                            .TypeConstraint<int64_t>("Tindices"),
                        NormalNoiseScatterAddOp<int64_t>);

}  // namespace tf_pxg
