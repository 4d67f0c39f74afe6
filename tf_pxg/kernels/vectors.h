// Vector registers for tf_pxg's kernels (GCC/Clang vector extensions): the
// accumulators of a loop stay in registers whatever width the compiler
// prefers for auto-vectorised code, and machines without AVX-512 get the
// same code in 256-bit halves.

#ifndef TF_PXG_KERNELS_VECTORS_H_
#define TF_PXG_KERNELS_VECTORS_H_

#include <cstring>

namespace tf_pxg {

#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#else
constexpr int kVectorBytes = 32;
#endif

// Values of T in one vector register.
template <typename T>
constexpr int kLanes = kVectorBytes / sizeof(T);

template <typename T>
using Vec __attribute__((vector_size(kVectorBytes))) = T;

// An unaligned load of kLanes<T> values.
template <typename T>
inline Vec<T> Load(const T* p) {
  Vec<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The sum of a vector's lanes, in double.
template <typename T>
inline double SumLanes(Vec<T> v) {
  double total = 0;
  for (int l = 0; l < kLanes<T>; ++l) total += v[l];
  return total;
}

}  // namespace tf_pxg

#endif  // TF_PXG_KERNELS_VECTORS_H_
