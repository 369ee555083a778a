// The GGUF regrouped kernels' shared pieces (quant_regrouped.cpp includes this, and only
// it): the regrouped layout's shape, the activations' int8 runs, and the AVX-512 VNNI
// product for many rows of x in blocks of 4 rows x 2 groups (AVX2's products are in
// quant_regrouped_avx2.h). The layout is described in quant_regrouped.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define FLOTILLA_QR 1
#else
#define FLOTILLA_QR 0
#endif
// AVX2 CPUs without VNNI (Zen 3, ...) multiply the same layout a ymm half at a time:
// quant_regrouped_avx2.h (vpmaddubsw + vpmaddwd; F16C for the scales).
#if !FLOTILLA_QR && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FLOTILLA_QR_AVX2 1
#else
#define FLOTILLA_QR_AVX2 0
#endif
#define FLOTILLA_QR_PRODUCTS (FLOTILLA_QR || FLOTILLA_QR_AVX2)

namespace {

constexpr int64_t kGroup = 16;  // rows a group interleaves: one 32-bit lane each

enum Kind : int { kQ4_0, kQ4_1, kQ8_0 };

Kind parse_kind(const std::string& name) {
  if (name == "Q4_0") return kQ4_0;
  if (name == "Q4_1") return kQ4_1;
  if (name == "Q8_0") return kQ8_0;
  TORCH_CHECK(false, "gguf regrouped kernels: no kernel for ", name, " (Q4_0, Q4_1, Q8_0)");
}

struct Shape {
  Kind kind;
  int64_t n, k, groups, runs;
  int64_t words() const { return kind == kQ8_0 ? 8 : 4; }
  int64_t file_block() const { return kind == kQ8_0 ? 34 : kind == kQ4_1 ? 20 : 18; }
  int64_t qs_at() const { return kind == kQ4_1 ? 4 : 2; }  // in a file block
  int64_t halves() const { return kind == kQ4_1 ? 2 : 1; }  // d (and m) per row
  // bytes of one group's run: scales, then the words
  int64_t run_bytes() const { return kGroup * (2 * halves() + 4 * words()); }
  int64_t numel() const { return groups * runs * run_bytes(); }
  const uint8_t* run(const uint8_t* p, int64_t g, int64_t r) const {
    return p + (g * runs + r) * run_bytes();
  }
};

Shape shape_of(Kind kind, int64_t n, int64_t k) {
  TORCH_CHECK(k % 32 == 0, "gguf regrouped kernels: rows of whole 32-weight blocks, not ", k);
  return Shape{kind, n, k, (n + kGroup - 1) / kGroup, k / 32};
}

// ---- activations: int8 runs, their scales and their scaled sums -------------------------
// An array left uninitialised (std::vector zeroes what it allocates: a memset a call that
// every row overwrites anyway).
template <typename T>
struct Buffer {
  std::unique_ptr<T[]> p;
  void resize(int64_t n) { p.reset(new T[n]); }
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  T operator[](int64_t i) const { return p[i]; }
};

struct Activations {
  Buffer<int8_t> q;   // [m, k]
  Buffer<float> d;    // [m, runs]
  Buffer<float> sum;  // [m, runs]: d * (sum of the run's q)
};

// Rows i0 .. i0 + R of the activations, as a tile reads them: each row's int8 values, its
// runs' scales and their scaled sums.
template <int R>
struct XRows {
  const int8_t* q[R];
  const float* d[R];
  const float* sum[R];
  XRows(const Shape& s, const Activations& a, int64_t i0) {
    for (int t = 0; t < R; ++t) {
      q[t] = a.q.data() + (i0 + t) * s.k;
      d[t] = a.d.data() + (i0 + t) * s.runs;
      sum[t] = a.sum.data() + (i0 + t) * s.runs;
    }
  }
};

template <typename T>
[[maybe_unused]] void quantize_row(const T* x, int64_t k, int8_t* q, float* d_out, float* sum_out) {
  for (int64_t r = 0; r < k / 32; ++r) {
    float v[32], amax = 0.f;
    for (int l = 0; l < 32; ++l) {
      v[l] = flotilla::to_float(x[r * 32 + l]);
      amax = std::max(amax, std::fabs(v[l]));
    }
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int total = 0;
    for (int l = 0; l < 32; ++l) {
      const int qv = int(std::nearbyint(v[l] * inv));
      q[r * 32 + l] = int8_t(qv);
      total += qv;
    }
    d_out[r] = d;
    sum_out[r] = d * total;
  }
}

#if FLOTILLA_QR
// The same values as quantize_row's scalar loop: one rounding of v * inv, to nearest
// even (vcvtps2dq under the default rounding mode, as nearbyint), |q| <= 127.
template <typename T>
void quantize_row_avx512(const T* x, int64_t k, int8_t* q, float* d_out, float* sum_out) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t r = 0; r < k / 32; ++r) {
    const __m512 v0 = flotilla::load16(x + r * 32), v1 = flotilla::load16(x + r * 32 + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + r * 32 + 16), _mm512_cvtepi32_epi8(q1));
    d_out[r] = d;
    sum_out[r] = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}
#endif

#if FLOTILLA_QR_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is a float32's top half
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The same values as quantize_row's scalar loop (vcvtps2dq rounds to nearest even, as
// nearbyint), 8 lanes at a time.
template <typename T>
void quantize_row_avx2(const T* x, int64_t k, int8_t* q, float* d_out, float* sum_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < k / 32; ++r) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + r * 32 + 8 * i);
    const __m256 a = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));
    // the packs work within 128-bit lanes: the permute puts their 4-byte pieces in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * 32),
                        _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                        _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d_out[r] = d;
    sum_out[r] = d * float(_mm_cvtsi128_si32(s4));
  }
}
#endif

template <typename T>
Activations quantize(const T* x, int64_t m, int64_t k) {
  const int64_t runs = k / 32;
  Activations a;
  a.q.resize(m * k);
  a.d.resize(m * runs);
  a.sum.resize(m * runs);
  // a row is ~1 us: rows split across threads only when there are enough of them
  at::parallel_for(0, m, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
#if FLOTILLA_QR
      quantize_row_avx512(x + i * k, k, a.q.data() + i * k, a.d.data() + i * runs,
                          a.sum.data() + i * runs);
#elif FLOTILLA_QR_AVX2
      quantize_row_avx2(x + i * k, k, a.q.data() + i * k, a.d.data() + i * runs,
                        a.sum.data() + i * runs);
#else
      quantize_row(x + i * k, k, a.q.data() + i * k, a.d.data() + i * runs,
                   a.sum.data() + i * runs);
#endif
    }
  });
  return a;
}

#if FLOTILLA_QR
constexpr int64_t kAhead = 8;  // runs between a prefetch and its use

// ---- many rows of x: blocks of kBlockRows rows x 2 groups ------------------------------
// group_tile spends ~15 vector instructions a row and run beside its 8 products (its
// own unpacking, C chains summed, scales): at 64 rows it ran at 36 % of the CPU's int8
// peak (Zen 4: 1,403 us for a layer's four linears, slower than the bf16 kernel's 1,089).
// Here a run's weights of two groups are unpacked once for 4 rows, each (row, group)
// sums its products in one chain (8 chains in flight cover vpdpbusd's latency), and a
// run ends with 4 instructions a (row, group): convert, the two scales' product, and two
// fused multiply-adds into one float accumulator (the min term included). The same
// layer: 924 us at 64 rows, 55 % of the int8 peak (8 rows x 1 group: 986 us; 4 rows x 2
// groups leave ~27 of the 32 vector registers in use).
constexpr int kBlockRows = 4;
constexpr int kBlockGroups = 2;  // groups a block takes (1 or 2)
constexpr int64_t kManyRows = 2;  // rows of x from which matmul takes these blocks

inline __m512i bcast4(const int8_t* p) {  // 4 activations, to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int K, int R, int G>
void block_tile(const Shape& s, const uint8_t* packed, int64_t g0, const Activations& a,
                int64_t i0, bool prefetch, __m512 (&acc)[kBlockRows][2]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < R; ++t)
    for (int g = 0; g < G; ++g) acc[t][g] = _mm512_setzero_ps();
  const XRows<R> x(s, a, i0);
  const auto& xq = x.q;
  const auto& xd = x.d;
  const auto& xs = x.sum;
  const int64_t rb = s.run_bytes();
  constexpr int64_t scale_bytes = 2 * kGroup * (K == kQ4_1 ? 2 : 1);
  for (int64_t r = 0; r < s.runs; ++r) {
    const uint8_t* grun[G];
    for (int g = 0; g < G; ++g) {
      grun[g] = s.run(packed, g0 + g, r);
      if (prefetch)  // the first rows' pass streams the weights; the others find them cached
        for (int64_t l = 0; l < rb; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(grun[g] + kAhead * rb + l), _MM_HINT_T0);
    }
    __m512i dot[R][G];
    for (int t = 0; t < R; ++t)
      for (int g = 0; g < G; ++g) dot[t][g] = _mm512_setzero_si512();
    if constexpr (K == kQ8_0) {
      for (int w = 0; w < 8; ++w) {
        __m512i ws[G];
        for (int g = 0; g < G; ++g) ws[g] = _mm512_loadu_si512(grun[g] + scale_bytes + w * 64);
        for (int t = 0; t < R; ++t) {
          const __m512i xb = bcast4(xq[t] + r * 32 + 4 * w);
          for (int g = 0; g < G; ++g) dot[t][g] = _mm512_dpbusd_epi32(dot[t][g], ws[g], xb);
        }
      }
    } else {
      for (int w = 0; w < 4; ++w) {
        __m512i lo[G], hi[G];
        for (int g = 0; g < G; ++g) {
          const __m512i bytes = _mm512_loadu_si512(grun[g] + scale_bytes + w * 64);
          lo[g] = _mm512_and_si512(bytes, low4);
          hi[g] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        }
        for (int t = 0; t < R; ++t) {
          const __m512i xl = bcast4(xq[t] + r * 32 + 4 * w);
          const __m512i xh = bcast4(xq[t] + r * 32 + 16 + 4 * w);
          for (int g = 0; g < G; ++g) {
            dot[t][g] = _mm512_dpbusd_epi32(dot[t][g], lo[g], xl);
            dot[t][g] = _mm512_dpbusd_epi32(dot[t][g], hi[g], xh);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grun[g])));
      __m512 m;
      if constexpr (K == kQ4_1) {
        m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grun[g] + 32)));
      } else {
        m = _mm512_mul_ps(d, _mm512_set1_ps(K == kQ4_0 ? -8.f : -128.f));
      }
      for (int t = 0; t < R; ++t) {
        acc[t][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][g]),
                                    _mm512_mul_ps(d, _mm512_set1_ps(xd[t][r])), acc[t][g]);
        acc[t][g] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t][r]), acc[t][g]);
      }
    }
  }
}

template <int K, int G, int R = kBlockRows>
void block_any(int rows, const Shape& s, const uint8_t* packed, int64_t g0,
               const Activations& a, int64_t i0, bool prefetch,
               __m512 (&acc)[kBlockRows][2]) {
  if constexpr (R > 0) {
    if (rows == R) return block_tile<K, R, G>(s, packed, g0, a, i0, prefetch, acc);
    block_any<K, G, R - 1>(rows, s, packed, g0, a, i0, prefetch, acc);
  }
}

// 16 lanes of a row of y (cols of them real), bias added, in y's type: bf16 rounded to
// nearest even; float32 logits of a bf16 x hold bf16-rounded values, as the 1-row path.
// stream: a whole, aligned float vector is written non-temporally (see matmul_rows).
template <typename T, typename O>
inline void store_lanes(O* dst, __m512 v, const float* bias, int64_t cols, bool stream) {
  const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  if constexpr (std::is_same_v<O, c10::BFloat16>) {
    _mm256_mask_storeu_epi16(dst, mask, flotilla::to_bf16_bits(v));
  } else {
    flotilla::store_floats(dst, std::is_same_v<T, float> ? v : flotilla::round_bf16(v), mask,
                           stream);
  }
}

template <int K, typename T, typename O>
void matmul_rows(const Shape& s, const Activations& a, int64_t m, const uint8_t* packed,
                 const float* bias, O* y) {
  const int64_t blocks = (s.groups + kBlockGroups - 1) / kBlockGroups;
  const bool stream =
      std::is_same_v<O, float> && m * s.n * int64_t(sizeof(O)) > flotilla::kStreamBytes;
  at::parallel_for(0, blocks, 1, [&](int64_t p0, int64_t p1) {
    __m512 acc[kBlockRows][2];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = kBlockGroups * p;
      const int64_t groups = std::min<int64_t>(kBlockGroups, s.groups - g0);
      for (int64_t i0 = 0; i0 < m; i0 += kBlockRows) {
        const int rows = int(std::min<int64_t>(kBlockRows, m - i0));
        if (groups == 2) {
          block_any<K, 2>(rows, s, packed, g0, a, i0, i0 == 0, acc);
        } else {
          block_any<K, 1>(rows, s, packed, g0, a, i0, i0 == 0, acc);
        }
        for (int t = 0; t < rows; ++t)
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t j0 = (g0 + g) * kGroup;
            store_lanes<T>(y + (i0 + t) * s.n + j0, acc[t][g], bias ? bias + j0 : nullptr,
                           std::min<int64_t>(kGroup, s.n - j0), stream);
          }
      }
    }
    if (stream) _mm_sfence();  // this thread's streamed lines out before the join
  });
}

#endif

}  // namespace
