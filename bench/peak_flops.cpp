// Measured compute peak of this CPU: every core runs independent chains of the widest
// float32 FMA (and, with AVX512_BF16, of vdpbf16ps; with AMX_BF16, of the tile
// instruction tdpbf16ps: what oneDNN's bf16 matmuls run on such CPUs; with AVX512_VNNI,
// of vpdpbusd, the int8 kernels' instruction), enough chains to
// cover the instruction's latency; prints GFLOP/s over all cores. Then the memory side of
// the roofline: GB/s all cores read from a 1 GiB buffer (far past any cache; each core
// sums its own part, first touched by it), the best of three passes ("read_gbs").
// Built and run by bench/throughput.py (_peaks): g++ -O2 -march=<isa> -fopenmp.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

// Enough chains to cover the FMA latency on two pipes (4 cycles x 2 = 8), and no more
// than the register file holds beside the two operands: AVX-512 has 32 vector registers,
// AVX2 and SSE 16, where 16 chains spilled to the stack and read half the peak (Zen 4,
// x86-64-v3 build: 121-128 GFLOP/s against 229 at 512 bits, which this core runs on the
// same two 256-bit pipes).
#if defined(__AVX512F__)
constexpr int kChains = 16;
#define CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11) \
  OP(12) OP(13) OP(14) OP(15)
#else
constexpr int kChains = 12;
#define CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#endif
constexpr long kIters = 2'000'000'000 / kChains;  // ~0.25-1 s per measurement
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

// CHAINS names each accumulator (an array indexed in a loop may live in memory).

#if defined(__AVX512F__)
// Ops a second of kChains independent chains of step() over V registers, all cores.
template <typename V, typename Init, typename Step, typename Reduce>
double chain_rate(double ops_per_step, Init init, Step step, Reduce reduce) {
  return gflops(ops_per_step * kChains, [&] {
#define INIT_V(i) V v##i = init(i);
    CHAINS(INIT_V)
    for (long it = 0; it < kIters; ++it) {
#define STEP_V(i) v##i = step(v##i);
      CHAINS(STEP_V)
    }
    double s = 0;
#define SUM_V(i) s += reduce(v##i);
    CHAINS(SUM_V)
    return s;
  });
}
#endif

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
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3F80), b = (__m512bh)_mm512_set1_epi16(0x0001);
  const double bf16 = chain_rate<__m512>(
      4.0 * 16, [](int i) { return _mm512_set1_ps(float(i)); },
      [&](__m512 y) { return _mm512_dpbf16_ps(y, a, b); },
      [](__m512 y) { return double(_mm512_reduce_add_ps(y)); });
  std::printf("bf16_dot %d %.1f\n", omp_get_max_threads(), bf16);
#endif
#if defined(__AVX512VNNI__)
  // int8 multiply-adds (vpdpbusd: 64 a 512-bit instruction, what the GGUF and W8A8
  // kernels run without AMX), counted as 2 ops each like the float rows.
  const __m512i ones = _mm512_set1_epi8(1);
  const double int8 = chain_rate<__m512i>(
      2.0 * 64, [](int i) { return _mm512_set1_epi32(i); },
      [&](__m512i z) { return _mm512_dpbusd_epi32(z, ones, ones); },
      [](__m512i z) { return double(_mm512_reduce_add_epi32(z)); });
  std::printf("int8_dot %d %.1f\n", omp_get_max_threads(), int8);
#endif
#if defined(__AMX_BF16__)
  // Linux hands out the tile registers' state only on request (once per process).
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) {
    // Four 16x16 float32 accumulator tiles, each fed by one of two 16x32 bf16 A tiles and
    // one of two B tiles: four independent chains, 16*16*32 multiply-adds per instruction.
    const double amx = gflops(4.0 * 2 * 16 * 16 * 32 / kChains, [] {
      alignas(64) unsigned char cfg[64] = {};
      cfg[0] = 1;  // palette 1
      for (int t = 0; t < 8; ++t) cfg[16 + 2 * t] = 64, cfg[48 + t] = 16;  // 16 rows x 64 B
      _tile_loadconfig(cfg);
      alignas(64) static thread_local unsigned short src[16 * 32];
      for (auto& v : src) v = 0x3F80;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, src, 64); _tile_loadd(5, src, 64);
      _tile_loadd(6, src, 64); _tile_loadd(7, src, 64);
      for (long it = 0; it < kIters / kChains; ++it) {
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      alignas(64) static thread_local float out[16 * 16];
      _tile_stored(0, out, 64);
      _tile_release();
      return double(out[0]);
    });
    std::printf("bf16_amx %d %.1f\n", omp_get_max_threads(), amx);
  }
#endif
  constexpr long kFloats = (1L << 30) / sizeof(float);
  std::vector<vf> buf(kFloats / kLanes);
  const long n = long(buf.size());
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; ++i) buf[i] = vf{} + float(i & 7);
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    vf total{};
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
    {
      vf s0{}, s1{}, s2{}, s3{};
#pragma omp for schedule(static) nowait
      for (long i = 0; i < n; i += 4) s0 += buf[i], s1 += buf[i + 1], s2 += buf[i + 2], s3 += buf[i + 3];
#pragma omp critical
      total += s0 + s1 + s2 + s3;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, (1L << 30) / s / 1e9 + 0 * total[0]);
  }
  std::printf("read_gbs %d %.1f\n", omp_get_max_threads(), best);
  return 0;
}
