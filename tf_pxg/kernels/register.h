// Registration of tf_pxg's CPU kernels that are templated on a real type T.

#ifndef TF_PXG_KERNELS_REGISTER_H_
#define TF_PXG_KERNELS_REGISTER_H_

#include "tensorflow/core/framework/op_kernel.h"

// Registers OP<float> and OP<double> as the CPU kernels of op NAME (attr T).
#define TF_PXG_REGISTER_REAL_CPU_KERNELS(NAME, OP)                         \
  REGISTER_KERNEL_BUILDER(Name(NAME)                                       \
                              .Device(::tensorflow::DEVICE_CPU)            \
                              .TypeConstraint<float>("T"),                 \
                          OP<float>);                                      \
  REGISTER_KERNEL_BUILDER(Name(NAME)                                       \
                              .Device(::tensorflow::DEVICE_CPU)            \
                              .TypeConstraint<double>("T"),                \
                          OP<double>)

#endif  // TF_PXG_KERNELS_REGISTER_H_
