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
// The loops are written for the compiler's auto-vectoriser (built with
// -O3 -march=native by tf_pxg/dp/native.py) and split over TF's intra-op
// threads.

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
#include "tensorflow/core/util/work_sharder.h"

namespace tf_pxg {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

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

constexpr int kPairs = 64;           // Box-Muller pairs per block
constexpr uint32_t kParity = 0x1BD11BDAu;

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// Threefry-2x32-20 of the counters (c0 + j, k2), j < kPairs.
inline void Threefry(uint32_t k0, uint32_t k1, uint32_t k2, uint32_t c0,
                     uint32_t* a, uint32_t* b) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ kParity};
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  for (int j = 0; j < kPairs; ++j) {
    uint32_t x0 = c0 + static_cast<uint32_t>(j) + ks[0];
    uint32_t x1 = k2 + ks[1];
#define TF_PXG_ROUNDS(i)                              \
  for (int r = 0; r < 4; ++r) {                       \
    x0 += x1;                                         \
    x1 = Rotl(x1, kRot[(i) % 2][r]) ^ x0;             \
  }                                                   \
  x0 += ks[((i) + 1) % 3];                            \
  x1 += ks[((i) + 2) % 3] + static_cast<uint32_t>((i) + 1);
    TF_PXG_ROUNDS(0) TF_PXG_ROUNDS(1) TF_PXG_ROUNDS(2) TF_PXG_ROUNDS(3)
    TF_PXG_ROUNDS(4)
#undef TF_PXG_ROUNDS
    a[j] = x0;
    b[j] = x1;
  }
}

// Natural log of x > 0 (a normal float), Cephes logf: within 2 ulp.
inline float Log(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  int e = static_cast<int>((bits >> 23) & 0xff) - 126;
  uint32_t mbits = (bits & 0x007fffffu) | 0x3f000000u;  // m in [0.5, 1)
  float m;
  std::memcpy(&m, &mbits, 4);
  const bool low = m < 0.707106781186547524f;
  e -= low ? 1 : 0;
  float y = (low ? m + m : m) - 1.0f;
  const float z = y * y;
  float p = 7.0376836292e-2f;
  p = p * y - 1.1514610310e-1f;
  p = p * y + 1.1676998740e-1f;
  p = p * y - 1.2420140846e-1f;
  p = p * y + 1.4249322787e-1f;
  p = p * y - 1.6668057665e-1f;
  p = p * y + 2.0000714765e-1f;
  p = p * y - 2.4999993993e-1f;
  p = p * y + 3.3333331174e-1f;
  const float fe = static_cast<float>(e);
  float r = y * z * p;
  r += -2.12194440e-4f * fe;
  r += -0.5f * z;
  return y + r + 0.693359375f * fe;
}

// The standard normals 2j, 2j + 1 (j < kPairs) of the block of pairs that
// starts at counter c0, times `scale`, into z[0 .. 2 kPairs).
inline void NormalPairs(uint32_t k0, uint32_t k1, uint32_t k2, uint32_t c0,
                        float scale, float* z) {
  alignas(64) uint32_t a[kPairs];
  alignas(64) uint32_t b[kPairs];
  Threefry(k0, k1, k2, c0, a, b);
  for (int j = 0; j < kPairs; ++j) {
    const float u1 = (static_cast<float>(a[j]) + 0.5f) * 0x1p-32f;
    const float r = scale * std::sqrt(-2.0f * Log(u1));
    // theta = (pi / 2) (q + f 2^-30), q = round(b / 2^30) mod 4, exactly.
    const uint32_t q = (b[j] + (1u << 29)) >> 30;
    const int32_t f = static_cast<int32_t>(b[j] - (q << 30));
    const float x = static_cast<float>(f) * 1.4629180792671596e-09f;
    const float x2 = x * x;
    const float sin_x =
        x + x * x2 * (-1.6666654611e-1f +
                      x2 * (8.3321608736e-3f + x2 * -1.9515295891e-4f));
    const float cos_x =
        1.0f - 0.5f * x2 +
        x2 * x2 * (4.166664568298827e-2f +
                   x2 * (-1.388731625493765e-3f + x2 * 2.443315711809948e-5f));
    // cos(theta) = cos x, -sin x, -cos x, sin x for q = 0, 1, 2, 3;
    // sin(theta) = cos(theta - pi/2) takes q - 1.
    const float c = (q & 1) ? sin_x : cos_x;
    const float s = (q & 1) ? cos_x : sin_x;
    const bool c_neg = q == 1 || q == 2;
    const bool s_neg = q == 2 || q == 3;
    z[2 * j] = r * (c_neg ? -c : c);
    z[2 * j + 1] = r * (s_neg ? -s : s);
  }
}

// out[l] = (in ? in[l] : 0) + scale z[start + l] for l in [0, n).
void AddNoise(OpKernelContext* ctx, const float* in, float* out, int64_t n,
              int64_t start, uint32_t k0, uint32_t k1, uint32_t k2,
              float scale) {
  if (n == 0) return;
  const int64_t first_pair = start >> 1;
  const int64_t last_pair = (start + n - 1) >> 1;
  const int64_t blocks = (last_pair - first_pair) / kPairs + 1;
  auto work = [&](int64_t begin, int64_t end) {
    alignas(64) float z[2 * kPairs];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = first_pair + blk * kPairs;
      NormalPairs(k0, k1, k2, static_cast<uint32_t>(c0), scale, z);
      const int64_t e0 = 2 * c0 - start;  // local index of z[0]
      const int64_t lo = std::max<int64_t>(e0, 0);
      const int64_t hi = std::min<int64_t>(e0 + 2 * kPairs, n);
      const float* zb = z + (lo - e0);
      const int64_t m = hi - lo;
      if (in != nullptr) {
        for (int64_t l = 0; l < m; ++l) out[lo + l] = in[lo + l] + zb[l];
      } else {
        for (int64_t l = 0; l < m; ++l) out[lo + l] = zb[l];
      }
    }
  };
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  // About 15 ns of one core per pair on an AVX2 CPU, with margin.
  ::tensorflow::Shard(workers->num_threads, workers->workers, blocks,
                      kPairs * 40, work);
}

bool ReadKey(OpKernelContext* ctx, uint32_t* k, float* scale) {
  const Tensor& key = ctx->input(ctx->num_inputs() - 2);
  const Tensor& stddev = ctx->input(ctx->num_inputs() - 1);
  if (!Require(ctx, key.dims() == 1 && key.NumElements() == 3,
               InvalidArgument("key must be a shape [3] uint32 tensor, got ",
                               key.shape().DebugString())) ||
      !Require(ctx, stddev.dims() == 0,
               InvalidArgument("stddev must be a scalar, got ",
                               stddev.shape().DebugString()))) {
    return false;
  }
  auto kv = key.flat<uint32_t>();
  k[0] = kv(0);
  k[1] = kv(1);
  k[2] = kv(2);
  *scale = stddev.scalar<float>()();
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
    uint32_t k[3];
    float scale;
    if (!ReadKey(ctx, k, &scale) || !CheckRange(ctx, start_,
                                                 in.NumElements())) {
      return;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                            {0}, 0, in.shape(), &out));
    AddNoise(ctx, in.flat<float>().data(), out->flat<float>().data(),
             in.NumElements(), start_, k[0], k[1], k[2], scale);
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
    uint32_t k[3];
    float scale;
    if (!ReadKey(ctx, k, &scale) ||
        !CheckRange(ctx, start_, shape_.num_elements())) {
      return;
    }
    const int64_t rows = shape_.dim_size(0);
    const int64_t row_size = rows == 0 ? 0 : shape_.num_elements() / rows;
    OP_REQUIRES(ctx, indices.dims() == 1,
                InvalidArgument("indices must be a vector, got ",
                                indices.shape().DebugString()));
    OP_REQUIRES(ctx,
                values.NumElements() == indices.NumElements() * row_size &&
                    (values.dims() == 0 ||
                     values.dim_size(0) == indices.NumElements()),
                InvalidArgument("values ", values.shape().DebugString(),
                                " do not match ", indices.NumElements(),
                                " rows of the dense shape ",
                                shape_.DebugString()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape_, &out));
    float* o = out->flat<float>().data();
    AddNoise(ctx, nullptr, o, shape_.num_elements(), start_, k[0], k[1],
             k[2], scale);
    const float* v = values.flat<float>().data();
    auto idx = indices.flat<Index>();
    for (int64_t i = 0; i < indices.NumElements(); ++i) {
      const int64_t row = static_cast<int64_t>(idx(i));
      OP_REQUIRES(ctx, row >= 0 && row < rows,
                  InvalidArgument("row index ", row, " is outside [0, ",
                                  rows, ")"));
      float* dst = o + row * row_size;
      const float* src = v + i * row_size;
      for (int64_t j = 0; j < row_size; ++j) dst[j] += src[j];
    }
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
    .Attr("start: int >= 0")
    .Output("noisy: float")
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("tensor + stddev * z, z the elements start.. of the Threefry draw.");

REGISTER_OP("TfPxgNormalNoiseScatterAdd")
    .Input("values: float")
    .Input("indices: Tindices")
    .Input("key: uint32")
    .Input("stddev: float")
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
    .Doc("stddev * z (elements start.. of the draw) with rows scatter-added.");

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
