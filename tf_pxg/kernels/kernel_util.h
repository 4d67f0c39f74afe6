// What every tf_pxg CPU kernel uses: TF's kernel types in namespace tf_pxg,
// and work split over TF's intra-op threads.

#ifndef TF_PXG_KERNELS_KERNEL_UTIL_H_
#define TF_PXG_KERNELS_KERNEL_UTIL_H_

#include <cstdint>
#include <functional>

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

}  // namespace tf_pxg

#endif  // TF_PXG_KERNELS_KERNEL_UTIL_H_
