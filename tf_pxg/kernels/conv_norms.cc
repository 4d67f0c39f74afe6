// Per-example squared norms and clip-weighted sums of a 2-D convolution's
// filter gradient, without a patch tensor (tf_pxg.rules.conv; built by
// tf_pxg/native.py).
//
// For y = conv2d(x, w) (NHWC, strides sh x sw, dilations dh x dw, explicit
// zero padding `top`/`left` before the input, one group) with output
// gradient dz, the filter gradient of one row n of the batch is
//   G_n[i, j, c, o] = sum_{p = (oh, ow)} x[n, oh sh + i dh - top,
//                                          ow sw + j dw - left, c]
//                                        dz[n, oh, ow, o]
// (x read as 0 outside the image). Example b owns k = N / B rows: b k ..
// b k + k - 1, or with `batch_minor` (rows [k, B], as after SpaceToBatchND)
// b, B + b, ..., and its gradient G_b is the sum of their G_n.
//
// * TfPxgConv2DFilterSqNorm returns ||G_b||^2 for every example.
// * TfPxgConv2DFilterWeightedSum returns sum_b c[b] G_b ([kh, kw, C, Cout]):
//   the clip scaling fused into the sum (dz scaled by c[b] as it is copied),
//   an example whose c[b] is 0 skipped (it adds exactly 0 even if its rows
//   hold inf or NaN).
//
// Per example, one thread copies the patches of its k rows into a buffer
// [k P, kh kw C] and dz into [k P, Cout rounded up to whole vectors] (a few
// KB to a few hundred KB: in cache), then for each block of R patch columns
// and each vector of output channels accumulates the R vectors of G's
// entries in registers over the k P positions, then squares and sums them
// (norms). The weighted sum copies a few examples at a time (dz times
// c[b], about kSumPositions positions together) and accumulates the same
// register blocks over all their positions, starting from and stored back
// to the thread's running sum [kh kw C, Cout] (one per thread, added up at
// the end; each thread takes a fixed range of the groups of examples). G_b
// is never stored; the multiply-adds are those of the per-example gradient
// (B P kh kw C Cout), without the [B, P, kh kw C] patch tensor or the
// P x P Gram matrices of the ghost norm. Work is sharded over TF's intra-op
// threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// Adds sum_p patches[p, r] g[p, l] to out[r * out_stride + l] for r < R
// and the vector's lanes l (patches and g as for BlockSquares): the running
// sums are loaded into registers, accumulated over the positions (the
// loop of BlockSquares) and stored back.
template <typename T, int R>
inline void BlockSums(const T* patches, int64_t stride, const T* g,
                      int64_t g_stride, int64_t positions, T* out,
                      int64_t out_stride) {
  using V = Vec<T>;
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Load(out + r * out_stride);
  for (int64_t p = 0; p < positions; ++p) {
    const T* xp = patches + p * stride;
    const V gp = Load(g + p * g_stride);
    for (int r = 0; r < R; ++r) acc[r] += xp[r] * gp;
  }
  for (int r = 0; r < R; ++r)
    std::memcpy(out + r * out_stride, &acc[r], sizeof(V));
}

// Calls block(std::integral_constant<int, R>(), r) for blocks [r, r + R)
// covering [0, rows): blocks of Max (16, 8 or 4) columns, then one each of
// 8, 4, 2, 1 below Max for the remainder.
template <int Max, typename F>
inline void ForRowBlocks(int64_t rows, F&& block) {
  int64_t r = 0;
  for (; r + Max <= rows; r += Max)
    block(std::integral_constant<int, Max>(), r);
  for (int size = Max / 2; size >= 1; size /= 2) {
    if (rows - r < size) continue;
    switch (size) {
      case 8: block(std::integral_constant<int, 8>(), r); break;
      case 4: block(std::integral_constant<int, 4>(), r); break;
      case 2: block(std::integral_constant<int, 2>(), r); break;
      default: block(std::integral_constant<int, 1>(), r);
    }
    r += size;
  }
}

// BlockSquares over all `rows` columns of the patches.
template <typename T>
void RowsSquares(const T* patches, int64_t rows, const T* g, int64_t g_stride,
                 int64_t positions, double* sum) {
  ForRowBlocks<kMaxRows>(rows, [&](auto size, int64_t r) {
    BlockSquares<T, decltype(size)::value>(patches + r, rows, g, g_stride,
                                           positions, sum);
  });
}

// BlockSums over all `rows` columns and all `g_stride` (whole vectors)
// output channels: out is [rows, g_stride]. Column blocks are the outer
// loop: a block's patch values are gathered into `panel` ([positions, R],
// contiguous) and reused from L1 for every vector of channels.
template <typename T>
void RowsSums(const T* patches, int64_t rows, const T* g, int64_t g_stride,
              int64_t positions, T* out, std::vector<T>* panel) {
  panel->resize(positions * kMaxRows);
  ForRowBlocks<kMaxRows>(rows, [&](auto size, int64_t r) {
    constexpr int R = decltype(size)::value;
    T* dst = panel->data();
    for (int64_t p = 0; p < positions; ++p)
      std::memcpy(dst + p * R, patches + p * rows + r, R * sizeof(T));
    for (int64_t t = 0; t < g_stride; t += kLanes<T>)
      BlockSums<T, R>(dst, R, g + t, g_stride, positions,
                      out + r * g_stride + t, g_stride);
  });
}

// Positions the weighted sum accumulates in registers per load and store
// of its running sums (examples are copied together until they have this
// many; with more, a block's patches outgrow L1), and the most bytes of
// patches so copied at once.
constexpr int64_t kSumPositions = 256;
constexpr int64_t kSumPatchBytes = 8 << 20;

// Reads the attrs and inputs both ops share and copies one example's
// patches and dz into a thread's buffers: x [N, h, w, C], dz [N, oh, ow,
// Cout], `examples` B dividing N.
template <typename T>
class Conv2DBase : public OpKernel {
 public:
  explicit Conv2DBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("batch_minor", &batch_minor_));
    ReadWindowAttrs(ctx, &attrs_);
  }


 protected:
  static constexpr int L = kLanes<T>;

  // Validates x and dz against `examples` and sets the sizes; false
  // (status set) if invalid.
  bool Setup(OpKernelContext* ctx, const Tensor& x, const Tensor& dz,
             int64_t examples) {
    if (!(x.dims() == 4 && dz.dims() == 4)) {
      ctx->CtxFailure(absl::InvalidArgumentError("x and dz must be NHWC"));
      return false;
    }
    n_ = x.dim_size(0);
    h_ = x.dim_size(1);
    w_ = x.dim_size(2);
    c_ = x.dim_size(3);
    oh_ = dz.dim_size(1);
    ow_ = dz.dim_size(2);
    co_ = dz.dim_size(3);
    absl::Status bad;
    if (dz.dim_size(0) != n_) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("x has ", n_, " rows and dz ", dz.dim_size(0)));
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
    xs_ = x.flat<T>().data();
    gs_ = dz.flat<T>().data();
    x_end_ = xs_ + x.NumElements();
    row_positions_ = oh_ * ow_;
    positions_ = k_ * row_positions_;
    rows_ = attrs_[0][0] * attrs_[0][1] * c_;
    g_stride_ = (co_ + L - 1) / L * L;
    return true;
  }

  // Buffers for one example's patches [k P, kh kw C] (plus slack for
  // whole-vector copies) and dz [k P, g_stride] (zero-padded).
  void Allocate(std::vector<T>* patches, std::vector<T>* g) const {
    patches->resize(positions_ * rows_ + L);
    g->resize(positions_ * g_stride_);
  }

  // Copies example b's patches into `patches` and its dz times `scale`
  // into `g` (buffers from Allocate).
  void CopyExample(int64_t b, T scale, T* patches, T* g) const {
    const int64_t kh = attrs_[0][0], kw = attrs_[0][1], sh = attrs_[1][0],
                  sw = attrs_[1][1], dh = attrs_[2][0], dw = attrs_[2][1],
                  top = attrs_[3][0], left = attrs_[3][1];
    const int64_t h = h_, w = w_, c = c_, run = kw * c,
                  run_vectors = (run + L - 1) / L;
    T* dst = patches;
    for (int64_t r = 0; r < k_; ++r) {
      const T* xb = xs_ + Row(b, r) * h * w * c;
      for (int64_t i = 0; i < oh_; ++i) {
        for (int64_t j = 0; j < ow_; ++j) {
          const int64_t x0 = j * sw - left;
          for (int64_t ki = 0; ki < kh; ++ki, dst += run) {
            const int64_t y = i * sh + ki * dh - top;
            const T* src = xb + (y * w + x0) * c;
            if (y < 0 || y >= h) {
              std::fill(dst, dst + run, T(0));
            } else if (dw == 1 && x0 >= 0 && x0 + kw <= w &&
                       src + run_vectors * L <= x_end_) {
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
    for (int64_t p = 0; p < positions_; ++p) {
      const int64_t r = p / row_positions_;
      const T* src =
          gs_ + (Row(b, r) * row_positions_ + p % row_positions_) * co_;
      T* dst_g = g + p * g_stride_;
      if (scale == T(1)) {
        std::memcpy(dst_g, src, co_ * sizeof(T));
      } else {
        for (int64_t o = 0; o < co_; ++o) dst_g[o] = src[o] * scale;
      }
      std::fill(dst_g + co_, dst_g + g_stride_, T(0));
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
  int64_t n_ = 0, h_ = 0, w_ = 0, c_ = 0, oh_ = 0, ow_ = 0, co_ = 0,
          examples_ = 0, k_ = 0, row_positions_ = 0, positions_ = 0,
          rows_ = 0, g_stride_ = 0;
  const T* xs_ = nullptr;
  const T* gs_ = nullptr;
  const T* x_end_ = nullptr;
};

template <typename T>
class Conv2DFilterSqNormOp : public Conv2DBase<T> {
 public:
  using Conv2DBase<T>::Conv2DBase;

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
    if (this->n_ == 0) return;
    T* sq = out->flat<T>().data();
    constexpr int L = kLanes<T>;
    const int64_t rows = this->rows_, g_stride = this->g_stride_,
                  positions = this->positions_;
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<T> patches, g;
      this->Allocate(&patches, &g);
      for (int64_t b = begin; b < end; ++b) {
        this->CopyExample(b, T(1), patches.data(), g.data());
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
};

// sum_b c[b] G_b: the clip-weighted sum of the per-example filter
// gradients, [kh, kw, C, Cout]; an example with c[b] == 0 is skipped (adds
// exactly 0 even if its rows hold inf/NaN). The examples are cut into one
// contiguous range per intra-op thread; each range's examples are copied
// one at a time (dz times c[b]) and added into the range's partial sum
// [kh kw C, Cout] in registers, block by block (the plain filter
// gradient's products, accumulated in T); the partial sums are added at
// the end.
template <typename T>
class Conv2DFilterWeightedSumOp : public Conv2DBase<T> {
 public:
  using Conv2DBase<T>::Conv2DBase;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& c = ctx->input(2);
    OP_REQUIRES(ctx, c.dims() == 1,
                absl::InvalidArgumentError("c must be a vector"));
    const int64_t examples = c.dim_size(0);
    if (!this->Setup(ctx, ctx->input(0), ctx->input(1), examples)) return;
    const int64_t kh = this->attrs_[0][0], kw = this->attrs_[0][1];
    const int64_t co = this->co_, rows = this->rows_,
                  g_stride = this->g_stride_, positions = this->positions_;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            0, TensorShape({kh, kw, this->c_, co}), &out));
    T* result = out->flat<T>().data();
    std::fill(result, result + out->NumElements(), T(0));
    if (examples == 0 || this->n_ == 0 || rows == 0 || co == 0) return;
    const T* cs = c.flat<T>().data();
    constexpr int L = kLanes<T>;
    // One running sum per thread, each over a fixed range of groups of
    // examples (copied together: enough positions per pass over the sums);
    // fixed, so that the result does not depend on the threads' timing.
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t per_example = std::max<int64_t>(positions, 1);
    const int64_t group = std::max<int64_t>(
        1, std::min({(kSumPositions + per_example - 1) / per_example,
                     kSumPatchBytes / std::max<int64_t>(
                                          1, per_example * rows * sizeof(T)),
                     examples}));
    const int64_t groups = (examples + group - 1) / group;
    const int64_t ranges = std::max<int64_t>(
        1, std::min<int64_t>(workers->num_threads, groups));
    const int64_t size = rows * g_stride;
    std::vector<T> partial(ranges * size, T(0));
    auto work = [&](int64_t begin, int64_t end) {
      std::vector<T> patches(group * positions * rows + L),
          g(group * positions * g_stride), panel;
      for (int64_t range = begin; range < end; ++range) {
        T* sums = partial.data() + range * size;
        for (int64_t at = range * groups / ranges;
             at < (range + 1) * groups / ranges; ++at) {
          int64_t copied = 0;
          for (int64_t b = at * group;
               b < std::min(examples, (at + 1) * group); ++b) {
            const T f = cs[b];
            if (f == T(0)) continue;  // never read: exactly 0
            // In order: a copy's whole-vector tail lands in the next
            // example's patches (overwritten) or in the slack.
            this->CopyExample(b, f, patches.data() + copied * positions * rows,
                              g.data() + copied * positions * g_stride);
            ++copied;
          }
          if (copied > 0)
            RowsSums<T>(patches.data(), rows, g.data(), g_stride,
                        copied * positions, sums, &panel);
        }
      }
    };
    ShardOverThreads(ctx, ranges,
                     /*cost_per_unit=*/(groups + ranges - 1) / ranges * group *
                         positions * rows * g_stride,
                     work);
    for (int64_t range = 0; range < ranges; ++range) {
      const T* sums = partial.data() + range * size;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < co; ++o)
          result[r * co + o] += sums[r * g_stride + o];
    }
  }
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

REGISTER_OP("TfPxgConv2DFilterWeightedSum")
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
      using ::tensorflow::shape_inference::ShapeHandle;
      std::vector<int32_t> ksize;
      TF_RETURN_IF_ERROR(c->GetAttr("ksize", &ksize));
      if (ksize.size() != 2)
        return absl::InvalidArgumentError("ksize needs 2 values");
      ShapeHandle x, dz;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 4, &dz));
      c->set_output(0, c->MakeShape({c->MakeDim(ksize[0]),
                                     c->MakeDim(ksize[1]), c->Dim(x, 3),
                                     c->Dim(dz, 3)}));
      return absl::OkStatus();
    });

TF_PXG_REGISTER_REAL_CPU_KERNELS("TfPxgConv2DFilterWeightedSum",
                                 Conv2DFilterWeightedSumOp);

}  // namespace
}  // namespace tf_pxg
