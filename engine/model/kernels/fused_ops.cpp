// Fused element-wise CPU ops for the Llama layer: each replaces 3-6 torch ops (and as
// many passes over memory) with one. They round to the tensor dtype at the same points
// as the reference PyTorch code (HF transformers), so bf16 results match it bit for bit
// wherever the float math agrees.
//
// Vector paths: bf16 has hand-written AVX-512 code; everywhere else the plain loops are
// left to the compiler, which vectorizes them for the build target (AVX2 + FMA ymm code
// with -march=x86-64-v3, NEON on Arm; float32 exp through libmvec). Measured on Zen 5,
// float32, 64 rows: those loops beat vec.h's explicit vectors (add+RMSNorm 6.5 vs 7.6 us,
// RoPE 4.8 vs 6.2, SiLU*up 36.6 vs 45.3 on AVX2), so they stay. argmax is not vectorized
// by the compiler (a loop-carried index) and uses vec.h: 1,871 -> 388 us on AVX2.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "simd.h"
#include "vec.h"

namespace {

using flotilla::from_float;
using flotilla::round_to;
using flotilla::to_float;
namespace vec = flotilla::vec;
using vec::L;
using vec::vf;

template <typename T>
void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                       double eps) {
  const int64_t rows = x.size(0), cols = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * cols;
      T* rr = rp + r * cols;
#if FLOTILLA_AVX512
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (cols % 16 == 0) {
          __m512 sq = _mm512_setzero_ps();
          for (int64_t c = 0; c < cols; c += 16) {
            const __m512 h = flotilla::round_bf16(
                _mm512_add_ps(flotilla::load16(rr + c), flotilla::load16(xr + c)));
            flotilla::store16(rr + c, h);
            sq = _mm512_fmadd_ps(h, h, sq);
          }
          const __m512 inv = _mm512_set1_ps(
              1.f / std::sqrt(_mm512_reduce_add_ps(sq) / cols + float(eps)));
          for (int64_t c = 0; c < cols; c += 16) {
            const __m512 n = flotilla::round_bf16(_mm512_mul_ps(flotilla::load16(rr + c), inv));
            flotilla::store16(xr + c, _mm512_mul_ps(flotilla::load16(wp + c), n));
          }
          continue;
        }
      }
#endif
      float sq = 0.f;
      for (int64_t c = 0; c < cols; ++c) {
        T h = from_float<T>(to_float(rr[c]) + to_float(xr[c]));
        rr[c] = h;
        float hf = to_float(h);
        sq += hf * hf;
      }
      const float inv = 1.f / std::sqrt(sq / cols + float(eps));
      for (int64_t c = 0; c < cols; ++c)
        xr[c] = from_float<T>(to_float(wp[c]) * round_to<T>(to_float(rr[c]) * inv));
    }
  });
}

template <typename T>
void silu_and_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = out.size(0), cols = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * cols;
      const T* u = g + cols;
      T* o = op + r * cols;
      int64_t c = 0;
#if FLOTILLA_AVX512
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const __m512 one = _mm512_set1_ps(1.f);
        for (; c + 16 <= cols; c += 16) {
          const __m512 gf = flotilla::load16(g + c);
          const __m512 e = flotilla::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gf));
          const __m512 act = flotilla::round_bf16(_mm512_div_ps(gf, _mm512_add_ps(one, e)));
          flotilla::store16(o + c, _mm512_mul_ps(act, flotilla::load16(u + c)));
        }
      }
#endif
      for (; c < cols; ++c) {
        const float gf = to_float(g[c]);
        // exp clamped: past 88 it overflows to inf, and fast-math division of inf gave NaN
        const float act = round_to<T>(gf / (1.f + std::exp(std::min(-gf, 88.f))));
        o[c] = from_float<T>(act * to_float(u[c]));
      }
    }
  });
}

template <typename T>
void rotary_impl(torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                 const torch::Tensor& sin, int64_t num_rotated_heads, int64_t head_dim) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), half = head_dim / 2;
  T* base = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + pos[t] * head_dim;
      const T* s = sp + pos[t] * head_dim;
#if FLOTILLA_AVX512
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (half % 16 == 0) {
          for (int64_t h = 0; h < num_rotated_heads; ++h) {
            T* x = base + t * width + h * head_dim;
            for (int64_t i = 0; i < half; i += 16) {
              using flotilla::load16;
              using flotilla::round_bf16;
              const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
              const __m512 a1 = round_bf16(_mm512_mul_ps(x1, load16(c + i)));
              const __m512 b1 = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2),
                                                         load16(s + i)));
              const __m512 a2 = round_bf16(_mm512_mul_ps(x2, load16(c + i + half)));
              const __m512 b2 = round_bf16(_mm512_mul_ps(x1, load16(s + i + half)));
              flotilla::store16(x + i, _mm512_add_ps(a1, b1));
              flotilla::store16(x + i + half, _mm512_add_ps(a2, b2));
            }
          }
          continue;
        }
      }
#endif
      for (int64_t h = 0; h < num_rotated_heads; ++h) {
        T* x = base + t * width + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
          // x * cos + rotate_half(x) * sin, rounded after each op like the torch code
          const float a1 = round_to<T>(x1 * to_float(c[i]));
          const float b1 = round_to<T>(-x2 * to_float(s[i]));
          const float a2 = round_to<T>(x2 * to_float(c[i + half]));
          const float b2 = round_to<T>(x1 * to_float(s[i + half]));
          x[i] = from_float<T>(a1 + b1);
          x[i + half] = from_float<T>(a2 + b2);
        }
      }
    }
  });
}

inline bool is_nan_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// Index of the first maximum of each row, NaN counting as the maximum (torch.argmax's
// rule). torch's CPU argmax is not vectorized: 1.3 ms for 64 x 49152 floats, most of a
// greedy sampler step.
void argmax_rows_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * cols;
      float best = -INFINITY;
      int64_t best_i = 0;
      int64_t i = 0;
      vec::vi nan = vec::splat_i(0);  // NaN by its bits: -ffast-math may drop float NaN compares
      vf vmax = vec::splat(-INFINITY);
      vec::vi vidx = vec::splat_i(0), cur = vec::lanes();
      for (; i + L <= cols; i += L) {  // per lane: the first index of its maximum
        const vf v = vec::load(row + i);
        nan |= (reinterpret_cast<vec::vi>(v) & 0x7FFFFFFF) > 0x7F800000;
        const vec::vi gt = v > vmax;
        vmax = gt ? v : vmax;
        vidx = gt ? cur : vidx;
        cur += int32_t(L);
      }
      bool has_nan = false;
      for (int l = 0; l < L; ++l) {
        if (vmax[l] > best || (vmax[l] == best && vidx[l] < best_i)) { best = vmax[l]; best_i = vidx[l]; }
        has_nan |= nan[l] != 0;
      }
      for (; i < cols; ++i) {
        has_nan |= is_nan_bits(row[i]);
        if (row[i] > best) { best = row[i]; best_i = i; }
      }
      if (has_nan)  // like torch.argmax: NaN counts as the maximum, the first one wins
        for (int64_t j = 0; j < cols; ++j)
          if (is_nan_bits(row[j])) { best_i = j; break; }
      op[r] = best_i;
    }
  });
}

// One random draw per row from softmax(x / T), by inverting the row's CDF at (1 - u) of
// its total (u in [0, 1), so the target is never 0 and no zero-weight token is chosen).
// What engine/executor/sampler.py's torch path computes (scale, softmax, a float64
// cumsum over the whole [B, V] batch, searchsorted) in two passes over each row and no
// [B, V] temporaries: the weights exp((x - max) / T) are summed per chunk of kChunk
// (float32 within a chunk, float64 across), the chunk holding the target is found from
// the chunk sums, and only its weights are computed again to find the token. Logits of
// -inf (masked tokens) weigh exactly 0.
void sample_rows_impl(const torch::Tensor& x, const torch::Tensor& inv_temp,
                      const torch::Tensor& u, torch::Tensor& out) {
  constexpr int64_t kChunk = 4 * L;
  const int64_t rows = x.size(0), cols = x.size(1), chunks = (cols + kChunk - 1) / kChunk;
  const float* xp = x.data_ptr<float>();
  const float* tp = inv_temp.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(chunks);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * cols;
      const float it = tp[r];
      vf vm = vec::splat(-INFINITY);
      int64_t i = 0;
      for (; i + L <= cols; i += L) vm = vec::vmax(vm, vec::load(row + i));
      float m = vec::reduce_max(vm);
      for (; i < cols; ++i) m = std::max(m, row[i]);
      // weight of tokens [a, b), a chunk: exp((x - m) * it), 0 below the float range
      auto weights = [&](int64_t a, int64_t b, float* w) {
        int64_t j = a;
        for (; j + L <= b; j += L) {
          const vf d = (vec::load(row + j) - m) * it;
          const vf e = vec::exp(d);
          vec::store(w + (j - a), d > vec::splat(-87.f) ? e : vec::splat(0.f));
        }
        for (; j < b; ++j) {
          const float d = (row[j] - m) * it;
          w[j - a] = d > -87.f ? std::exp(d) : 0.f;
        }
      };
      alignas(64) float w[kChunk];
      double total = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t a = c * kChunk, b = std::min(cols, a + kChunk);
        weights(a, b, w);
        float s = 0.f;
        for (int64_t j = 0; j < b - a; ++j) s += w[j];
        sums[c] = s;
        total += s;
      }
      const double target = (1.0 - up[r]) * total;
      double cum = 0;
      int64_t pick = -1;
      for (int64_t c = 0; c < chunks && pick < 0; ++c) {
        if (sums[c] <= 0) continue;
        if (cum + sums[c] < target) {
          cum += sums[c];
          continue;
        }
        const int64_t a = c * kChunk, b = std::min(cols, a + kChunk);
        weights(a, b, w);
        for (int64_t j = 0; j < b - a; ++j) {
          cum += w[j];
          if (w[j] > 0 && cum >= target) { pick = a + j; break; }
        }
      }
      // rounding left the target past the end: the last token of positive weight (0 when
      // none has any, as in a row that masks every token, which the engine fails)
      for (int64_t c = chunks - 1; c >= 0 && pick < 0; --c) {
        if (sums[c] <= 0) continue;
        const int64_t a = c * kChunk, b = std::min(cols, a + kChunk);
        weights(a, b, w);
        for (int64_t j = b - a - 1; j >= 0 && pick < 0; --j)
          if (w[j] > 0) pick = a + j;
      }
      op[r] = pick >= 0 ? pick : 0;
    }
  });
}

#define DISPATCH(dtype, NAME, ...)                                        \
  if (dtype == torch::kBFloat16) { NAME<c10::BFloat16>(__VA_ARGS__); }   \
  else if (dtype == torch::kHalf) { NAME<c10::Half>(__VA_ARGS__); }      \
  else { TORCH_CHECK(dtype == torch::kFloat, "unsupported dtype"); NAME<float>(__VA_ARGS__); }

}  // namespace

// residual += x; x = weight * rms_norm(residual), both in place. x, residual: [T, C].
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous());
  DISPATCH(x.scalar_type(), add_rms_norm_impl, x, residual, weight, eps);
}

// gate_up: [T, 2I] (gate then up) -> silu(gate) * up: [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous());
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  DISPATCH(gate_up.scalar_type(), silu_and_mul_impl, gate_up, out);
  return out;
}

// First index of each row's maximum (NaN first): x [B, V] float32 -> [B] int64.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat);
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "argmax_rows: row too long");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  argmax_rows_impl(x, out);
  return out;
}

// One token per row drawn from softmax(x * inv_temp) at uniform u: x [B, V] float32,
// inv_temp [B] float32 (1 / temperature), u [B] float64 in [0, 1) -> [B] int64.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor inv_temp, torch::Tensor u) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat);
  TORCH_CHECK(inv_temp.is_contiguous() && inv_temp.scalar_type() == torch::kFloat &&
              inv_temp.numel() == x.size(0), "sample_rows: one float32 1/temperature per row");
  TORCH_CHECK(u.is_contiguous() && u.scalar_type() == torch::kDouble && u.numel() == x.size(0),
              "sample_rows: one float64 uniform per row");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  sample_rows_impl(x, inv_temp, u, out);
  return out;
}

// Rotates, in place, the first num_rotated_heads heads of each row of qkv [T, W] (q heads
// then k heads, head_dim apart) with the cos/sin tables [max_pos, head_dim] at positions.
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_rotated_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type(), "cos/sin must have the dtype of qkv");
  DISPATCH(qkv.scalar_type(), rotary_impl, qkv, positions, cos, sin, num_rotated_heads, head_dim);
}
