// The native noise op's sampling: Threefry-2x32-20 and Box-Muller pairs.
//
// Header-only and free of TensorFlow, so that the op
// (threefry_noise.cc) and the stand-alone timing of
// benchmarks/threefry_rounds.cc compile the same code. See
// tf_pxg/dp/threefry.py for the definition of the draw.

#ifndef TF_PXG_DP_KERNELS_THREEFRY_NORMAL_H_
#define TF_PXG_DP_KERNELS_THREEFRY_NORMAL_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tf_pxg {
namespace threefry_normal {

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
  // Written as selects of one value each (not `(low ? m + m : m)`): GCC 12
  // if-converts that form only with AVX-512's mask registers, and at
  // x86-64-v2/v3 the whole Box-Muller loop stayed scalar (11 ns per
  // Gaussian instead of 2). The arithmetic, so the result, is the same.
  const bool low = m < 0.707106781186547524f;
  e -= static_cast<int>(low);
  float y = m + (low ? m : 0.0f) - 1.0f;
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

}  // namespace threefry_normal
}  // namespace tf_pxg

#endif  // TF_PXG_DP_KERNELS_THREEFRY_NORMAL_H_
