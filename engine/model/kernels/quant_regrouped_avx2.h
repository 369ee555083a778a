// The regrouped GGUF products on AVX2 CPUs without AVX-512 VNNI (Zen 3, Haswell to Alder
// Lake): the same layout as quant_regrouped.cpp's (16 rows a group, a row a 32-bit lane),
// taken a ymm half (8 rows) at a time, multiplied with vpmaddubsw + vpmaddwd.
//
// Why: the file layout's kernel (quant_linear.cpp) spends ~14 instructions a weight row
// and 32-weight run; here a Q4 run of 8 rows takes ~45 for one row of x (~6 a row), and
// two rows of x share the unpacked weights.
//
// Q4_0 / Q4_1: a word's low and high nibbles (weights 4w.. and 16+4w..) are unsigned
// bytes <= 15, so vpmaddubsw's int16 pairs are <= 2 * 15 * 127 = 3810 and a run's 8 of
// them (4 words x 2 nibbles) sum in int16 without saturating (<= 30480); one vpmaddwd by
// ones widens the run to int32. Q8_0: the layout's q + 128 is flipped back to the signed
// q, and vpmaddubsw(|q|, x signed by q) keeps pairs <= 2 * 128 * 127 = 32512; each word is
// widened to int32 before the next is added. Either way a lane's int32 is the run's exact
// dot product (the VNNI kernel's, less Q8_0's 128 * sum(x)), scaled in float as there:
// Q4's two fused steps (scale, then min or -8 d), Q8_0's one (q is signed: no offset).
// Every tile runs the same float steps a lane, in the same order, so a row's result
// does not depend on how many rows shared the call.
#pragma once

#include "quant_regrouped.h"

#if FLOTILLA_QR_AVX2
namespace {

constexpr int kHalf = 8;        // rows of a ymm: a group is two halves
constexpr int kTileRows = 2;    // rows of x a tile takes at most
constexpr int64_t kAhead = 8;   // runs between a prefetch and its use

inline __m256i bcast4(const int8_t* p) {  // 4 activations, to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 half_floats(const uint8_t* p) {  // 8 f16 scales
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows i0 .. i0+R of x against the first H halves of group g: out[t][h], 8 rows' sums.
// 2 rows x 2 halves keep 15 of the 16 ymm registers (4 float and 4 integer sums, a run's
// 4 unpacked vectors, 2 broadcasts, a mask) and unpack each weight once per 2 rows; 4
// rows x 1 half (14) unpacked it once per 4 but took 7-14 % longer at 2, 8 and 64 rows.
template <int K, int R, int H>
void tile(const Shape& s, const uint8_t* packed, int64_t g, const Activations& a, int64_t i0,
          bool prefetch, __m256 (&out)[kTileRows][2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][H];  // local: `out` might alias what the loop reads (stored every run)
  for (int t = 0; t < R; ++t)
    for (int h = 0; h < H; ++h) acc[t][h] = _mm256_setzero_ps();
  const XRows<R> x(s, a, i0);
  const auto& xq = x.q;
  const auto& xd = x.d;
  const auto& xs = x.sum;
  const int64_t rb = s.run_bytes();
  constexpr int64_t scale_bytes = 2 * kGroup * (K == kQ4_1 ? 2 : 1);
  for (int64_t r = 0; r < s.runs; ++r) {
    const uint8_t* grun = s.run(packed, g, r);
    if (prefetch)  // the first pass streams the group; later ones find it cached
      for (int64_t l = 0; l < rb; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(grun + kAhead * rb + l), _MM_HINT_T0);
    const uint8_t* q = grun + scale_bytes;
    __m256i dot[R][H];
    if constexpr (K == kQ8_0) {
      for (int t = 0; t < R; ++t)
        for (int h = 0; h < H; ++h) dot[t][h] = _mm256_setzero_si256();
      for (int w = 0; w < 8; ++w) {
        __m256i ws[H], wa[H];
        for (int h = 0; h < H; ++h) {
          ws[h] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + w * 64 + 32 * h)), flip);
          wa[h] = _mm256_abs_epi8(ws[h]);  // -128 -> 0x80: 128 as vpmaddubsw's unsigned
        }
        for (int t = 0; t < R; ++t) {
          const __m256i xb = bcast4(xq[t] + r * 32 + 4 * w);
          for (int h = 0; h < H; ++h) {
            const __m256i p = _mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(xb, ws[h]));
            dot[t][h] = _mm256_add_epi32(dot[t][h], _mm256_madd_epi16(p, ones));
            // the chain kept as written: the compiler reassociated it into a tree of
            // products spilled to the stack
            asm("" : "+x"(dot[t][h]));
          }
        }
      }
    } else {
      __m256i sum[R][H];
      for (int t = 0; t < R; ++t)
        for (int h = 0; h < H; ++h) sum[t][h] = _mm256_setzero_si256();
      for (int w = 0; w < 4; ++w) {
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i bytes =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + w * 64 + 32 * h));
          lo[h] = _mm256_and_si256(bytes, low4);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        }
        for (int t = 0; t < R; ++t) {
          const __m256i xl = bcast4(xq[t] + r * 32 + 4 * w);
          const __m256i xh = bcast4(xq[t] + r * 32 + 16 + 4 * w);
          // adds_epi16 never saturates here (<= 30480); being saturating, the compiler
          // keeps these chains as written, where it reassociated plain adds into a
          // tree of maddubs results spilled to the stack
          for (int h = 0; h < H; ++h) {
            sum[t][h] = _mm256_adds_epi16(sum[t][h], _mm256_maddubs_epi16(lo[h], xl));
            sum[t][h] = _mm256_adds_epi16(sum[t][h], _mm256_maddubs_epi16(hi[h], xh));
          }
        }
      }
      for (int t = 0; t < R; ++t)
        for (int h = 0; h < H; ++h) dot[t][h] = _mm256_madd_epi16(sum[t][h], ones);
    }
    for (int h = 0; h < H; ++h) {
      const __m256 d = half_floats(grun + 2 * kHalf * h);
      __m256 m = _mm256_setzero_ps();
      if constexpr (K == kQ4_1) {
        m = half_floats(grun + 2 * kGroup + 2 * kHalf * h);
      } else if constexpr (K == kQ4_0) {
        m = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
      }
      for (int t = 0; t < R; ++t) {
        acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]),
                                    _mm256_mul_ps(d, _mm256_set1_ps(xd[t][r])), acc[t][h]);
        if constexpr (K != kQ8_0)
          acc[t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t][r]), acc[t][h]);
      }
    }
  }
  for (int t = 0; t < R; ++t)
    for (int h = 0; h < H; ++h) out[t][h] = acc[t][h];
}

// float32 lanes -> bf16 (round to nearest even, as convert.h's from_float), as bits.
inline __m256i bf16_rounded(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}
inline __m128i to_bf16_bits8(__m256 x) {
  const __m256i top = _mm256_srli_epi32(bf16_rounded(x), 16);
  // packus works within 128-bit lanes: take quadwords 0 and 2 for the 8 halves in order
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08));
}

// 8 lanes of a row of y (cols of them real), bias added, in y's type: bf16 rounded to
// nearest even; float32 logits of a bf16 x hold bf16-rounded values. Plain stores (the
// AVX-512 kernels stream large float outputs; unmeasured here).
template <typename T, typename O>
inline void store_lanes(O* dst, __m256 v, const float* bias, int64_t cols) {
  if (cols >= kHalf) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if constexpr (std::is_same_v<O, c10::BFloat16>) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), to_bf16_bits8(v));
    } else if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(dst, v);
    } else {
      _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_and_si256(
                                bf16_rounded(v), _mm256_set1_epi32(int(0xFFFF0000u)))));
    }
    return;
  }
  alignas(32) float lanes[kHalf];
  _mm256_store_ps(lanes, v);
  for (int64_t j = 0; j < cols; ++j) {
    const float x = bias ? lanes[j] + bias[j] : lanes[j];
    if constexpr (std::is_same_v<O, float> && !std::is_same_v<T, float>) {
      dst[j] = flotilla::round_to<T>(x);
    } else {
      dst[j] = flotilla::from_float<O>(x);
    }
  }
}

template <int K, typename T, typename O>
void matmul(const Shape& s, const T* x, int64_t m, const uint8_t* packed, const float* bias,
            O* y) {
  const Activations a = quantize(x, m, s.k);
  at::parallel_for(0, s.groups, 1, [&](int64_t g0, int64_t g1) {
    __m256 acc[kTileRows][2];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * kGroup, cols = std::min<int64_t>(kGroup, s.n - j0);
      const int halves = cols > kHalf ? 2 : 1;  // a last group's empty half is not computed
      auto put = [&](int64_t i, __m256 v, int h) {  // row i of y, columns of half h
        const int64_t c0 = j0 + h * kHalf;
        store_lanes<T>(y + i * s.n + c0, v, bias ? bias + c0 : nullptr,
                       std::min<int64_t>(kHalf, s.n - c0));
      };
      for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
        const int rows = int(std::min<int64_t>(kTileRows, m - i0));
        const bool first = i0 == 0;  // streams the group from memory
        if (rows == 2) {
          if (halves == 2) tile<K, 2, 2>(s, packed, g, a, i0, first, acc);
          else tile<K, 2, 1>(s, packed, g, a, i0, first, acc);
        } else {
          if (halves == 2) tile<K, 1, 2>(s, packed, g, a, i0, first, acc);
          else tile<K, 1, 1>(s, packed, g, a, i0, first, acc);
        }
        for (int t = 0; t < rows; ++t)
          for (int h = 0; h < halves; ++h) put(i0 + t, acc[t][h], h);
      }
    }
  });
}

// The weight of groups first .. last decoded to W^T's layout, a half of 8 columns at a
// time: half h of group g goes to where(g, h), which gives the column's k = 0 pointer and
// its row stride ld (or a null pointer: skip it). W^T [k, n] itself (n padded to whole
// groups) for dense_product, or linear.cpp's packed float32 panels for native_product
// (quant_regrouped.cpp). The same values as decode_run's: d * q + m in one rounding
// (Q8_0's d * (q + 128) - 128 d is exact).
template <int K, typename T, typename Where>
void decode_columns(const Shape& s, const uint8_t* packed, int64_t first, int64_t last,
                    const Where& where) {
  at::parallel_for(first, last, 1, [&](int64_t g0, int64_t g1) {
    const __m256i low = _mm256_set1_epi32(K == kQ8_0 ? 0xFF : 0x0F);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < s.runs; ++r)
        for (int h = 0; h < 2; ++h) {
          const auto [base, ld] = where(g, h);
          if (base == nullptr) continue;
          const uint8_t* grun = s.run(packed, g, r);
          const __m256 d = half_floats(grun + 2 * kHalf * h);
          __m256 m;
          if constexpr (K == kQ4_1) {
            m = half_floats(grun + 2 * kGroup + 2 * kHalf * h);
          } else {
            m = _mm256_mul_ps(d, _mm256_set1_ps(K == kQ4_0 ? -8.f : -128.f));
          }
          const uint8_t* q = grun + 2 * kGroup * (K == kQ4_1 ? 2 : 1) + 32 * h;
          T* col = base + r * 32 * ld;
          auto put = [&](int64_t kk, __m256i v) {
            const __m256 w = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(v), m);
            if constexpr (std::is_same_v<T, float>) {
              _mm256_storeu_ps(col + kk * ld, w);
            } else {
              _mm_storeu_si128(reinterpret_cast<__m128i*>(col + kk * ld), to_bf16_bits8(w));
            }
          };
          for (int64_t w = 0; w < s.words(); ++w) {
            const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + w * 64));
            for (int b = 0; b < 4; ++b) {
              const __m256i byte = _mm256_srli_epi32(word, 8 * b);
              put(4 * w + b, _mm256_and_si256(byte, low));
              if constexpr (K != kQ8_0)
                put(16 + 4 * w + b, _mm256_and_si256(_mm256_srli_epi32(byte, 4), low));
            }
          }
        }
  });
}

// W^T [k, n] for groups first .. last, leading dimension ld: dense_product's panels.
template <int K, typename T>
void decode_transposed(const Shape& s, const uint8_t* packed, int64_t first, int64_t last,
                       T* out, int64_t ld) {
  decode_columns<K, T>(s, packed, first, last, [&](int64_t g, int h) {
    return std::pair<T*, int64_t>(out + (g - first) * kGroup + kHalf * h, ld);
  });
}

}  // namespace
#endif
