// float <-> storage type conversions that the compiler can vectorize.
#pragma once
#include <torch/extension.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace flotilla {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T> inline T from_float(float x) { return static_cast<T>(x); }
template <> inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  // round to nearest even, as torch does (inputs here are finite)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}

// An e4m3 byte (float8_e4m3fn: fp8 weights, an fp8 KV cache) as a float, by a table:
// exact (the two NaN bytes aside, which neither holds).
inline float e4m3_to_float(uint8_t bits) {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(float(8 + m), e - 10);
      t[b] = (b & 0x80) ? -v : v;
    }
    return t;
  }();
  return table[bits];
}

// Round a float to the storage type and back: what a torch op on T tensors produces.
template <typename T> inline float round_to(float x) { return to_float(from_float<T>(x)); }

}  // namespace flotilla
