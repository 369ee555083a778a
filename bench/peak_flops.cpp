// Measured compute peak of this CPU: every core runs independent chains of the widest
// float32 FMA (and, with AVX512_BF16, of vdpbf16ps, what oneDNN's bf16 matmuls run),
// enough chains to cover the instruction's latency; prints GFLOP/s over all cores.
// Built and run by bench/roofline.py: g++ -O2 -march=native -fopenmp.
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

constexpr int kChains = 16;
constexpr long kIters = 2'000'000'000 / kChains;  // ~0.25-1 s per measurement

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));

template <typename Body>
double gflops(double flop_per_iter, Body body) {
  double total = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : total)
  total += body();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return flop_per_iter * kIters * omp_get_max_threads() / s / 1e9 + 0 * total;
}

// 16 named accumulators (an array indexed in a loop may live in memory).
#define CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11) \
  OP(12) OP(13) OP(14) OP(15)

int main() {
  const double fp32 = gflops(2.0 * kLanes * kChains, [] {
    vf a, b;
    for (int i = 0; i < kLanes; ++i) a[i] = 1.0000001f, b[i] = 1e-7f;
#define INIT(i) vf x##i = b * float(i);
    CHAINS(INIT)
    for (long it = 0; it < kIters; ++it) {
#define STEP(i) x##i = x##i * a + b;
      CHAINS(STEP)
    }
#define SUM(i) s += x##i[0];
    float s = 0;
    CHAINS(SUM)
    return double(s);
  });
  std::printf("fp32_fma %d %.1f\n", omp_get_max_threads(), fp32);
#if defined(__AVX512BF16__)
  const double bf16 = gflops(4.0 * 16 * kChains, [] {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x0001);
#define INIT_BF(i) __m512 y##i = _mm512_set1_ps(float(i));
    CHAINS(INIT_BF)
    for (long it = 0; it < kIters; ++it) {
#define STEP_BF(i) y##i = _mm512_dpbf16_ps(y##i, a, b);
      CHAINS(STEP_BF)
    }
#define SUM_BF(i) s += _mm512_reduce_add_ps(y##i);
    float s = 0;
    CHAINS(SUM_BF)
    return double(s);
  });
  std::printf("bf16_dot %d %.1f\n", omp_get_max_threads(), bf16);
#endif
  return 0;
}
