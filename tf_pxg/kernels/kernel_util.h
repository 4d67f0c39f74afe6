// What every tf_pxg CPU kernel uses: TF's kernel types in namespace tf_pxg,
// and work split over TF's intra-op threads.

#ifndef TF_PXG_KERNELS_KERNEL_UTIL_H_
#define TF_PXG_KERNELS_KERNEL_UTIL_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tf_pxg {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

// Runs work(begin, end) over [0, units) on the kernel's CPU worker threads,
// `cost_per_unit` (about one unit's element operations) deciding the split.
inline void ShardOverThreads(
    OpKernelContext* ctx, int64_t units, int64_t cost_per_unit,
    const std::function<void(int64_t, int64_t)>& work) {
  auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(workers->num_threads, workers->workers, units,
                      cost_per_unit, work);
}

// Reads a 2-D window's attrs into `attrs`, in the order ksize, strides,
// dilations, pads, two values each (height, width): ksize, strides and
// dilations positive, pads not negative. Sets the construction's status and
// returns false if an attr is missing or out of range (the kernel must then
// not run: its loops and buffer sizes assume these bounds).
inline bool ReadWindowAttrs(OpKernelConstruction* ctx,
                            std::vector<std::vector<int32_t>>* attrs) {
  for (const char* name : {"ksize", "strides", "dilations", "pads"}) {
    std::vector<int32_t> v;
    const absl::Status read = ctx->GetAttr(name, &v);
    if (!read.ok()) {
      ctx->CtxFailure(read);
      return false;
    }
    const bool pads = attrs->size() == 3;
    if (v.size() != 2 || (pads ? v[0] < 0 || v[1] < 0 : v[0] < 1 || v[1] < 1)) {
      ctx->CtxFailure(absl::InvalidArgumentError(absl::StrCat(
          name, " needs 2 values (height, width), ",
          pads ? "not negative" : "positive", "; got ", v.size(),
          " value(s)", v.size() == 2 ? absl::StrCat(": ", v[0], ", ", v[1])
                                     : "")));
      return false;
    }
    attrs->push_back(v);
  }
  return true;
}

}  // namespace tf_pxg

#endif  // TF_PXG_KERNELS_KERNEL_UTIL_H_
