// Float32 vectors of the widest kind the build target has, written once with the
// compiler's vector extensions (GCC / Clang): 16 lanes with AVX-512, 8 with AVX2 (+FMA,
// F16C), 4 on SSE2 and on Arm (NEON). The same kernel source thus compiles to AVX-512,
// AVX2 or NEON code, chosen at build time by -march; tests build the narrower targets on a
// wider machine (e.g. -march=x86-64-v3 on an AVX-512 host), so every path runs here.
//
// Storage types are widened on load and rounded on store as torch rounds (bf16: round to
// nearest even).
#pragma once
#include <torch/extension.h>

#include <cfloat>
#include <cstdint>
#include <cstring>

#include "convert.h"

namespace flotilla::vec {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t L = 16;
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t L = 8;
constexpr const char* kIsa = "avx2";
#elif defined(__aarch64__) && defined(__ARM_NEON)
constexpr int64_t L = 4;
constexpr const char* kIsa = "neon";
#elif defined(__SSE2__)
constexpr int64_t L = 4;
constexpr const char* kIsa = "sse2";
#else
constexpr int64_t L = 4;  // plain C++: the compiler lowers the vector ops to scalar code
constexpr const char* kIsa = "portable";
#endif

// Vector registers of the target: what register-blocked loops size their tiles to.
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int64_t kRegs = 32;
#else
constexpr int64_t kRegs = 16;
#endif

typedef float vf __attribute__((vector_size(L * 4)));
typedef int32_t vi __attribute__((vector_size(L * 4)));
typedef uint32_t vu __attribute__((vector_size(L * 4)));
typedef uint16_t vh __attribute__((vector_size(L * 2)));

inline vf splat(float x) { return vf{} + x; }

// v, which the compiler must treat as unknown from here on: -ffast-math lets it
// reassociate sums, and it did so in some instantiations of a kernel and not in others
// (under Zen 3's tuning a lone accumulator was split in two, so the same sum came out
// of two tile shapes one bit apart). An empty asm: no instruction is emitted.
inline vf opaque(vf v) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__("" : "+v"(v));
#elif defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}
inline vi splat_i(int32_t x) { return vi{} + x; }

// 0, 1, ..., L - 1: lane numbers, for masks of partial vectors.
inline vi lanes() {
  vi v;
  for (int i = 0; i < L; ++i) v[i] = i;
  return v;
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);  // bf16: a float's top half
}

inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }
inline vu bf16_rounded_bits(vf x) {  // round to nearest even in the top 16 bits (finite x)
  const vu bits = reinterpret_cast<vu>(x);
  return bits + 0x7FFFu + ((bits >> 16) & 1u);
}
inline void store(c10::BFloat16* p, vf x) {
  const vh h = __builtin_convertvector(bf16_rounded_bits(x) >> 16, vh);
  std::memcpy(p, &h, sizeof(h));
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline float reduce_add(vf x) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += x[i];
  return s;
}
inline float reduce_max(vf x) {
  float m = x[0];
  for (int i = 1; i < L; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// exp on every lane: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-6 Taylor
// polynomial (relative error ~2e-7, below float32 rounding of the softmax sums); 2^n is
// built in the exponent bits (x is clamped so that n stays a normal exponent).
inline vf exp(vf x) {
  x = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
  const vf t = x * 1.44269504f;
  const vi n = __builtin_convertvector(t + (t >= 0 ? splat(0.5f) : splat(-0.5f)), vi);
  const vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693145752f;  // ln2, high part
  r = r - nf * 1.42860677e-6f;   // ln2, low part
  vf p = splat(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * reinterpret_cast<vf>((n + 127) << 23);
}

}  // namespace flotilla::vec
