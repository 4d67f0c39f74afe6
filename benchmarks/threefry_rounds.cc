// What the native noise op's sampling costs on one core, outside TF:
// prints JSON with the CPU nanoseconds per Gaussian of
//   threefry_rounds_ns_per_gaussian: the Threefry-2x32-20 rounds alone
//     (one call per Box-Muller pair, so per Gaussian it is half a call);
//   normal_pairs_ns_per_gaussian: rounds plus the Box-Muller transform;
//   add_noise_ns_per_gaussian: that plus adding into a 4M-float array.
// Built and run by `python -m benchmarks.limits` (g++ -O3 at the CPU's
// instruction-set level, tf_pxg.native.optimization_flags(), as
// tf_pxg.native builds the op).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "../tf_pxg/kernels/threefry_normal.h"

namespace {

using ::tf_pxg::threefry_normal::kPairs;
using Clock = std::chrono::steady_clock;

constexpr int64_t kGaussians = int64_t{1} << 22;
constexpr int kRepeats = 7;

// The median over kRepeats of `run`'s time, in ns per Gaussian.
template <typename Run>
double Median(Run run) {
  std::vector<double> ns;
  for (int r = 0; r < kRepeats; ++r) {
    const auto start = Clock::now();
    run();
    ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() -
                                                          start).count() /
                 kGaussians);
  }
  std::sort(ns.begin(), ns.end());
  return ns[kRepeats / 2];
}

}  // namespace

int main() {
  alignas(64) uint32_t a[kPairs];
  alignas(64) uint32_t b[kPairs];
  alignas(64) float z[2 * kPairs];
  std::vector<float> grad(kGaussians, 0.5f);
  volatile uint32_t sink_bits = 0;
  volatile float sink = 0;
  const double rounds = Median([&] {
    uint32_t acc = 0;
    for (int64_t c = 0; c < kGaussians / 2; c += kPairs) {
      tf_pxg::threefry_normal::Threefry(1, 2, 3, static_cast<uint32_t>(c),
                                        a, b);
      acc ^= a[c % kPairs] ^ b[(c + 7) % kPairs];
    }
    sink_bits = acc;
  });
  const double pairs = Median([&] {
    float acc = 0;
    for (int64_t c = 0; c < kGaussians / 2; c += kPairs) {
      tf_pxg::threefry_normal::NormalPairs(1, 2, 3, static_cast<uint32_t>(c),
                                           1.0f, z);
      acc += z[c % (2 * kPairs)];
    }
    sink = acc;
  });
  const double add = Median([&] {
    for (int64_t c = 0; c < kGaussians / 2; c += kPairs) {
      tf_pxg::threefry_normal::NormalPairs(1, 2, 3, static_cast<uint32_t>(c),
                                           1.0f, z);
      float* g = grad.data() + 2 * c;
      for (int j = 0; j < 2 * kPairs; ++j) g[j] += z[j];
    }
    sink = grad[12345];
  });
  std::printf(
      "{\"threefry_rounds_ns_per_gaussian\": %.3f, "
      "\"normal_pairs_ns_per_gaussian\": %.3f, "
      "\"add_noise_ns_per_gaussian\": %.3f}\n",
      rounds, pairs, add);
  return 0;
}
