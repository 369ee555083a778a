// AVX-512 helpers shared by the CPU kernels: bf16 <-> float32 lanes and a vector exp.
// Only compiled where the build targets AVX-512 (-march=native on such a CPU); every
// kernel keeps a scalar path for other machines.
#pragma once
#include <torch/extension.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FLOTILLA_AVX512 1
#else
#define FLOTILLA_AVX512 0
#endif

namespace flotilla {
// Float outputs larger than this are written around the caches (store_floats' stream):
// the LM head's logits at 64 rows (12.6 MB for a 49k vocabulary), written through them,
// evicted the head's own weights (Zen 5: the Q8_0 head 5.3 -> 3.2 ms streamed, bf16's
// 4.5 -> 3.6 ms).
constexpr int64_t kStreamBytes = 4 << 20;
}  // namespace flotilla

#if FLOTILLA_AVX512
namespace flotilla {

// 16 consecutive elements widened to float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 e4m3 bytes widened to float32 lanes / kE4M3Widened, exactly: a byte's sign moved
// to bit 15 and its other 7 bits to bits 13..7 is the IEEE half of its value / 2^8
// (subnormals included: both formats' are linear), which vcvtph2ps widens.
constexpr float kE4M3Widened = 256.f;
inline __m512 widen_e4m3(const uint8_t* p) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(int16_t(0xBFFF))));
}

// float32 lanes -> bf16, round to nearest even (what torch's .to(bfloat16) does for
// finite values), as the raw 16-bit patterns.
inline __m256i to_bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(x));
}
// 16 float32 lanes (mask: the real ones) to p; with `stream`, a whole vector at a
// 64-byte boundary goes around the caches (a non-temporal store: the writing thread
// fences before the output is read).
inline void store_floats(float* p, __m512 x, __mmask16 mask, bool stream) {
  if (stream && mask == 0xFFFF && (reinterpret_cast<uintptr_t>(p) & 63) == 0)
    return _mm512_stream_ps(p, x);
  _mm512_mask_storeu_ps(p, mask, x);
}
// Round float32 lanes to bf16 and widen back: what a torch op on bf16 tensors yields.
inline __m512 round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xFFFF0000u))));
}

// exp on 16 float lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-6
// Taylor polynomial (relative error ~2e-7, below float32 rounding of the softmax sums).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);        // ln2, low part
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace flotilla
#endif
