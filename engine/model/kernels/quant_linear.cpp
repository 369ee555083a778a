// Linears on GGUF's quantized blocks as the file stores them (engine/quant/gguf_blocks.py
// has the byte layouts and the torch reference decoders these agree with).
//
// Why: a decode step reads every weight once and is bound by memory bandwidth. The
// default model's Q4_1 weights take 5 bits a weight against bf16's 16, so reading the
// blocks themselves, not a widened copy, is what makes one sequence fast on a CPU.
//
// How, for few rows (decode): each row of x is quantized once per call to int8 in runs
// of 32 (a float scale per run, and the sums of every 16 values), as llama.cpp does;
// each 32-weight run of a weight row is unpacked in registers to 32 unsigned bytes, and
// its dot product with the activations' int8 run is exact integer arithmetic (AVX-512
// VNNI's vpdpbusd where the CPU has it, else AVX2's pmaddubsw + pmaddwd, else scalar
// code). The integer sums are scaled in float32: per run by the weight's scale (two
// scales for Q6_K's 16-weight groups) and the activation's, plus the format's offset
// (Q4_0's -8, Q4_1's min, Q4_K's sub-block min, Q6_K's -32) times the activation sums.
// The only error against the dequantized weights in float32 is the activations'
// rounding to int8 (a relative 2^-8 per run).
//
// For many rows (prefill chunks) the weight is decoded to x's dtype and multiplied by
// torch's matmul (oneDNN: AMX or AVX-512 bf16 on CPUs that have them), where compute,
// not the weight read, is the cost. `dense_rows` picks the crossover.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "convert.h"

#if defined(__F16C__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define FLOTILLA_Q_AVX2 1
#else
#define FLOTILLA_Q_AVX2 0
#endif
#if FLOTILLA_Q_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FLOTILLA_Q_VNNI 1
#else
#define FLOTILLA_Q_VNNI 0
#endif

namespace {

enum Fmt : int { kQ8_0, kQ4_0, kQ4_1, kQ4_K, kQ6_K };
struct Layout {
  const char* name;
  int64_t weights, nbytes;
};
constexpr Layout kLayouts[] = {{"Q8_0", 32, 34}, {"Q4_0", 32, 18}, {"Q4_1", 32, 20},
                               {"Q4_K", 256, 144}, {"Q6_K", 256, 210}};

Fmt parse_format(const std::string& name) {
  for (int f = 0; f < 5; ++f)
    if (name == kLayouts[f].name) return Fmt(f);
  TORCH_CHECK(false, "gguf kernels: no kernel for block format ", name);
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction; the portable conversion is a dozen
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Q4_K's 6-bit scale and min of sub-block j from the block's 12 packed bytes.
inline void q4k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ---- the 32-weight runs --------------------------------------------------------------
// A run of a weight row as the dot product needs it: 32 unsigned bytes q in weight order
// (Q8_0: |q|, its signs applied to the activations instead), the scales of its first and
// second 16 weights (sa, sb) and its offsets (oa, ob): the run's weights are
// w = s * q + o (Q8_0: s * q with q signed).
struct Run {
  uint8_t q[32];
  float sa, sb, oa, ob;
  bool signed_q;  // Q8_0: q holds int8 values
};

template <int F>
inline void scalar_run(const uint8_t* block, int64_t r, Run& run) {
  run.signed_q = F == kQ8_0;
  if constexpr (F == kQ8_0) {
    std::memcpy(run.q, block + 2, 32);
    run.sa = run.sb = f16(block);
    run.oa = run.ob = 0.f;
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    const uint8_t* qs = block + (F == kQ4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {
      run.q[i] = qs[i] & 0xF;
      run.q[i + 16] = qs[i] >> 4;
    }
    run.sa = run.sb = f16(block);
    run.oa = run.ob = F == kQ4_0 ? -8.f * run.sa : f16(block + 2);
  } else if constexpr (F == kQ4_K) {
    int sc, mn;
    q4k_scale_min(block + 4, int(r), sc, mn);
    const uint8_t* qs = block + 16 + 32 * (r / 2);
    const int shift = 4 * (r & 1);
    for (int i = 0; i < 32; ++i) run.q[i] = (qs[i] >> shift) & 0xF;
    run.sa = run.sb = f16(block) * sc;
    run.oa = run.ob = -f16(block + 2) * mn;
  } else {  // Q6_K: run r = half h (128 weights), quarter j
    const int64_t h = r / 4, j = r % 4;
    const uint8_t* ql = block + 64 * h + 32 * (j & 1);
    const uint8_t* qh = block + 128 + 32 * h;
    const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int i = 0; i < 32; ++i)
      run.q[i] = ((ql[i] >> (4 * (j >> 1))) & 0xF) | (((qh[i] >> (2 * j)) & 3) << 4);
    const float d = f16(block + 208);
    run.sa = d * scales[8 * h + 2 * j];
    run.sb = d * scales[8 * h + 2 * j + 1];
    run.oa = -32.f * run.sa;
    run.ob = -32.f * run.sb;
  }
}

// ---- dequantize ----------------------------------------------------------------------
template <typename T>
void dequantize_rows(const uint8_t* raw, int64_t rows, int64_t row_bytes, Fmt fmt,
                     int64_t columns, T* out) {
  const Layout lay = kLayouts[fmt];
  const int64_t runs_per_block = lay.weights / 32, blocks = columns / lay.weights;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    Run run;
    for (int64_t row = r0; row < r1; ++row) {
      T* dst = out + row * columns;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = raw + row * row_bytes + b * lay.nbytes;
        for (int64_t r = 0; r < runs_per_block; ++r, dst += 32) {
          switch (fmt) {
            case kQ8_0: scalar_run<kQ8_0>(block, r, run); break;
            case kQ4_0: scalar_run<kQ4_0>(block, r, run); break;
            case kQ4_1: scalar_run<kQ4_1>(block, r, run); break;
            case kQ4_K: scalar_run<kQ4_K>(block, r, run); break;
            case kQ6_K: scalar_run<kQ6_K>(block, r, run); break;
          }
          for (int i = 0; i < 32; ++i) {
            const float q = run.signed_q ? float(int8_t(run.q[i])) : float(run.q[i]);
            dst[i] = flotilla::from_float<T>(i < 16 ? run.sa * q + run.oa : run.sb * q + run.ob);
          }
        }
      }
    }
  });
}

// ---- activations quantized to int8 runs ------------------------------------------------
struct QuantizedRows {
  std::vector<int8_t> q;    // [m, k]
  std::vector<float> d;     // [m, k / 32] the runs' scales
  std::vector<float> sums;  // [m, k / 16] d * (sum of the 16 values' q)
  std::vector<float> sums32;  // [m, k / 32] d * (sum of the run's q)
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m, int64_t k) {
  QuantizedRows out{std::vector<int8_t>(m * k), std::vector<float>(m * k / 32),
                    std::vector<float>(m * k / 16), std::vector<float>(m * k / 32)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < k / 32; ++r) {
      const T* src = x + i * k + r * 32;
      float v[32], amax = 0.f;
      for (int l = 0; l < 32; ++l) {
        v[l] = flotilla::to_float(src[l]);
        amax = std::max(amax, std::fabs(v[l]));
      }
      const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
      int8_t* q = out.q.data() + i * k + r * 32;
      int s0 = 0, s1 = 0;
      for (int l = 0; l < 32; ++l) {
        q[l] = int8_t(std::nearbyint(v[l] * inv));
        (l < 16 ? s0 : s1) += q[l];
      }
      out.d[i * (k / 32) + r] = d;
      out.sums[i * (k / 16) + 2 * r] = d * s0;
      out.sums[i * (k / 16) + 2 * r + 1] = d * s1;
      out.sums32[i * (k / 32) + r] = d * (s0 + s1);
    }
  }
  return out;
}

// ---- the dot products ---------------------------------------------------------------------
#if FLOTILLA_Q_AVX2
// 8 int32 lanes: lane l sums the products of bytes 4l..4l+3 (u: unsigned, s: signed).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if FLOTILLA_Q_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The run's 32 unsigned bytes, unpacked in registers (Q8_0: its signed bytes as loaded).
template <int F>
inline __m256i load_run(const uint8_t* block, int64_t r) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (F == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == kQ4_0 ? 2 : 4)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
    return _mm256_and_si256(both, low4);
  } else if constexpr (F == kQ4_K) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * (r / 2)));
    return _mm256_and_si256(_mm256_srli_epi16(qs, int(4 * (r & 1))), low4);
  } else {
    const int64_t h = r / 4, j = r % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * (j & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, int(4 * (j >> 1))), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, int(2 * j)), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

// Scales and offsets of run r of a block (the part of scalar_run the vector path needs).
template <int F>
inline void run_scales(const uint8_t* block, int64_t r, float& sa, float& sb, float& oa, float& ob) {
  if constexpr (F == kQ8_0) {
    sa = sb = f16(block);
    oa = ob = 0.f;
  } else if constexpr (F == kQ4_0) {
    sa = sb = f16(block);
    oa = ob = -8.f * sa;
  } else if constexpr (F == kQ4_1) {
    sa = sb = f16(block);
    oa = ob = f16(block + 2);
  } else if constexpr (F == kQ4_K) {
    int sc, mn;
    q4k_scale_min(block + 4, int(r), sc, mn);
    sa = sb = f16(block) * sc;
    oa = ob = -f16(block + 2) * mn;
  } else {
    const int64_t h = r / 4, j = r % 4;
    const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = f16(block + 208);
    sa = d * scales[8 * h + 2 * j];
    sb = d * scales[8 * h + 2 * j + 1];
    oa = -32.f * sa;
    ob = -32.f * sb;
  }
}

// A tile: MT rows of x against NT rows of W. The activations' runs are loaded once for
// NT weight rows, and each weight run, unpacked once, serves MT activation rows; the
// MT x NT accumulator chains are independent, so their float latency overlaps.
#if FLOTILLA_Q_AVX2 && defined(__AVX512F__)
constexpr int kMaxMT = 4;  // 32 vector registers: 16 accumulators
#else
constexpr int kMaxMT = 2;  // 16: 8 accumulators
#endif
constexpr int kNT = 4;

template <int F, int MT, int NT>
void tile(const uint8_t* w0, int64_t row_bytes, int64_t k, const QuantizedRows& xq, int64_t i0,
          float (&result)[kMaxMT][kNT]) {
  constexpr Layout lay = kLayouts[F];
  constexpr int64_t runs_per_block = lay.weights / 32;
  const int64_t runs = k / 32;
#if FLOTILLA_Q_AVX2
  __m256 acc[MT][NT];
  float corr[MT][NT];
  for (int t = 0; t < MT; ++t)
    for (int j = 0; j < NT; ++j) {
      acc[t][j] = _mm256_setzero_ps();
      corr[t][j] = 0.f;
    }
  for (int64_t run = 0; run < runs; ++run) {
    const int64_t boff = (run / runs_per_block) * lay.nbytes, r = run % runs_per_block;
    __m256i xs[MT];
    float dx[MT];
    for (int t = 0; t < MT; ++t) {
      const int64_t i = i0 + t;
      xs[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + i * k + run * 32));
      dx[t] = xq.d[i * runs + run];
    }
    for (int j = 0; j < NT; ++j) {
      const uint8_t* block = w0 + j * row_bytes + boff;
      const __m256i w = load_run<F>(block, r);
      float sa, sb, oa, ob;
      run_scales<F>(block, r, sa, sb, oa, ob);
      const __m256i wu = F == kQ8_0 ? _mm256_sign_epi8(w, w) : w;  // |q| for Q8_0
      // Q6_K: a scale per 16 weights (dot lanes 0-3, 4-7); the others one per run
      const __m256 ws = F == kQ6_K ? _mm256_setr_ps(sa, sa, sa, sa, sb, sb, sb, sb)
                                   : _mm256_set1_ps(sa);
      for (int t = 0; t < MT; ++t) {
        const __m256i xx = F == kQ8_0 ? _mm256_sign_epi8(xs[t], w) : xs[t];  // q's signs
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, xx));
        acc[t][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(ws, _mm256_set1_ps(dx[t])), acc[t][j]);
        if constexpr (F == kQ6_K) {
          const float* s = xq.sums.data() + (i0 + t) * (k / 16) + 2 * run;
          corr[t][j] += oa * s[0] + ob * s[1];
        } else if constexpr (F != kQ8_0) {
          corr[t][j] += oa * xq.sums32[(i0 + t) * runs + run];
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int j = 0; j < NT; ++j) result[t][j] = hsum(acc[t][j]) + corr[t][j];
#else
  Run w;
  for (int t = 0; t < MT; ++t)
    for (int j = 0; j < NT; ++j) result[t][j] = 0.f;
  for (int64_t run = 0; run < runs; ++run) {
    const int64_t boff = (run / runs_per_block) * lay.nbytes, r = run % runs_per_block;
    for (int j = 0; j < NT; ++j) {
      scalar_run<F>(w0 + j * row_bytes + boff, r, w);
      for (int t = 0; t < MT; ++t) {
        const int64_t i = i0 + t;
        const int8_t* xs = xq.q.data() + i * k + run * 32;
        int32_t da = 0, db = 0;
        for (int l = 0; l < 16; ++l) {
          da += (w.signed_q ? int8_t(w.q[l]) : int32_t(w.q[l])) * xs[l];
          db += (w.signed_q ? int8_t(w.q[l + 16]) : int32_t(w.q[l + 16])) * xs[l + 16];
        }
        const float d = xq.d[i * runs + run];
        const float* s = xq.sums.data() + i * (k / 16) + 2 * run;
        result[t][j] += d * (w.sa * da + w.sb * db) + w.oa * s[0] + w.ob * s[1];
      }
    }
  }
#endif
}

// The tile for the rows and weight rows left (MT <= kMaxMT, NT <= kNT), by dispatch.
template <int F, int MT = kMaxMT, int NT = kNT>
void tile_any(int mt, int nt, const uint8_t* w0, int64_t row_bytes, int64_t k,
              const QuantizedRows& xq, int64_t i0, float (&result)[kMaxMT][kNT]) {
  if constexpr (MT > 0 && NT > 0) {
    if (mt == MT && nt == NT) return tile<F, MT, NT>(w0, row_bytes, k, xq, i0, result);
    if (nt == NT) return tile_any<F, MT - 1, NT>(mt, nt, w0, row_bytes, k, xq, i0, result);
    return tile_any<F, MT, NT - 1>(mt, nt, w0, row_bytes, k, xq, i0, result);
  }
}

template <int F, typename T, typename O>
void quantized_matmul(const T* x, int64_t m, int64_t k, const uint8_t* raw, int64_t n,
                      int64_t row_bytes, const float* bias, O* y) {
  const QuantizedRows xq = quantize_rows(x, m, k);
  const int64_t groups = (n + kNT - 1) / kNT;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    float part[kMaxMT][kNT];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * kNT;
      const int nt = int(std::min<int64_t>(kNT, n - j0));
      for (int64_t i0 = 0; i0 < m; i0 += kMaxMT) {
        const int mt = int(std::min<int64_t>(kMaxMT, m - i0));
        tile_any<F>(mt, nt, raw + j0 * row_bytes, row_bytes, k, xq, i0, part);
        for (int t = 0; t < mt; ++t)
          for (int j = 0; j < nt; ++j) {
            const float v = part[t][j] + (bias ? bias[j0 + j] : 0.f);
            O* dst = y + (i0 + t) * n + j0 + j;
            if constexpr (std::is_same_v<O, float> && !std::is_same_v<T, float>) {
              *dst = flotilla::round_to<T>(v);  // logits: x's dtype, widened
            } else {
              *dst = flotilla::from_float<O>(v);
            }
          }
      }
    }
  });
}

template <typename T, typename O>
void dispatch(Fmt fmt, const T* x, int64_t m, int64_t k, const uint8_t* raw, int64_t n,
              int64_t row_bytes, const float* bias, O* y) {
  switch (fmt) {
    case kQ8_0: return quantized_matmul<kQ8_0>(x, m, k, raw, n, row_bytes, bias, y);
    case kQ4_0: return quantized_matmul<kQ4_0>(x, m, k, raw, n, row_bytes, bias, y);
    case kQ4_1: return quantized_matmul<kQ4_1>(x, m, k, raw, n, row_bytes, bias, y);
    case kQ4_K: return quantized_matmul<kQ4_K>(x, m, k, raw, n, row_bytes, bias, y);
    case kQ6_K: return quantized_matmul<kQ6_K>(x, m, k, raw, n, row_bytes, bias, y);
  }
}

void check_blocks(const torch::Tensor& raw, Fmt fmt, int64_t columns) {
  const Layout lay = kLayouts[fmt];
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "gguf kernels: blocks must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(columns % lay.weights == 0, "gguf kernels: ", lay.name, " rows hold whole blocks of ",
              lay.weights, " weights, not ", columns);
  TORCH_CHECK(raw.size(1) == columns / lay.weights * lay.nbytes, "gguf kernels: ", columns, " ",
              lay.name, " weights take ", columns / lay.weights * lay.nbytes, " bytes a row, got ",
              raw.size(1));
}

}  // namespace

torch::Tensor gguf_dequantize(torch::Tensor raw, const std::string& format, int64_t columns,
                              torch::ScalarType dtype) {
  const Fmt fmt = parse_format(format);
  check_blocks(raw, fmt, columns);
  torch::Tensor out = torch::empty({raw.size(0), columns}, raw.options().dtype(dtype));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  if (dtype == torch::kFloat32) {
    dequantize_rows(src, raw.size(0), raw.size(1), fmt, columns, out.data_ptr<float>());
  } else if (dtype == torch::kBFloat16) {
    dequantize_rows(src, raw.size(0), raw.size(1), fmt, columns, out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "gguf_dequantize: float32 or bfloat16 output, not ", dtype);
  }
  return out;
}

torch::Tensor gguf_linear(torch::Tensor input, torch::Tensor raw, const std::string& format,
                          c10::optional<torch::Tensor> bias, bool float_out, int64_t dense_rows) {
  const Fmt fmt = parse_format(format);
  const int64_t k = input.size(-1), n = raw.size(0);
  check_blocks(raw, fmt, k);
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "gguf_linear: float32 or bfloat16 input, not ", dtype);
  torch::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  if (m > dense_rows) {  // compute-bound: decode once, multiply with oneDNN
    torch::Tensor w = gguf_dequantize(raw, format, k, dtype);
    torch::Tensor y = at::linear(x, w, bias && bias->defined()
                                           ? c10::optional<torch::Tensor>(bias->to(dtype))
                                           : c10::nullopt);
    return (float_out ? y.to(torch::kFloat32) : y).reshape(shape);
  }
  torch::Tensor bf;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "gguf_linear: a bias of ", bias->numel(), " for ", n, " rows");
    // rounded to x's dtype first, as a bias of the activation dtype is held
    bf = bias->to(dtype).to(torch::kFloat32).contiguous();
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const auto out_dtype = float_out ? torch::kFloat32 : dtype;
  torch::Tensor y = torch::empty({m, n}, x.options().dtype(out_dtype));
  if (m == 0 || n == 0) return y.reshape(shape);
  const uint8_t* w = raw.data_ptr<uint8_t>();
  if (dtype == torch::kFloat32) {
    dispatch(fmt, x.data_ptr<float>(), m, k, w, n, raw.size(1), bp, y.data_ptr<float>());
  } else if (float_out) {
    dispatch(fmt, x.data_ptr<c10::BFloat16>(), m, k, w, n, raw.size(1), bp, y.data_ptr<float>());
  } else {
    dispatch(fmt, x.data_ptr<c10::BFloat16>(), m, k, w, n, raw.size(1), bp,
             y.data_ptr<c10::BFloat16>());
  }
  return y.reshape(shape);
}

std::string gguf_dot_kernel() {
#if FLOTILLA_Q_VNNI
  return "vnni";
#elif FLOTILLA_Q_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}
