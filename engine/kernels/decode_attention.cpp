// Paged decode attention for the CPU: one query token per sequence, keys and values
// read straight from the block-structured cache (no gather copy, no padding).
//
// Cache layout (see engine/layers/attention.py): keys [KVH, num_blocks, D, bs] (each
// block stored transposed, so the scores of a block's bs tokens are bs-wide vector
// FMAs with no horizontal sums), values [KVH, num_blocks, bs, D]. Work is split over
// (sequence, kv head) pairs; each computes its G = H / KVH query heads' scores, a
// float32 softmax, and the weighted sum of values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "convert.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define FLOTILLA_AVX512 1
#else
#define FLOTILLA_AVX512 0
#endif

namespace {

#if FLOTILLA_AVX512
// 16 consecutive elements widened to float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

using flotilla::from_float;
using flotilla::to_float;

// BS and D are the block and head sizes when known at compile time (0: read at run time);
// fixed sizes let the compiler turn the short inner loops into straight vector code.
template <typename T, int64_t BS, int64_t D>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
         double scale) {
  const int64_t num_seqs = q.size(0), heads = q.size(1);
  const int64_t d = D ? D : q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t bs = BS ? BS : k_cache.size(3), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, h = work % kv_heads;
      const int64_t len = lens[s], nblocks = (len + bs - 1) / bs;
      const int64_t* table = tables + s * max_blocks;
      scores.resize(group * nblocks * bs);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = to_float(qp[(s * heads + h * group + g) * d + i]) * float(scale);
      const T* k_head = kp + h * num_blocks * d * bs;
      const T* v_head = vp + h * num_blocks * bs * d;
      // scores[g, t] = q_g . k_t, a block of bs tokens at a time; with fixed sizes the
      // running block scores (and below, the output row) stay in vector registers
      for (int64_t b = 0; b < nblocks; ++b) {
        const T* kb = k_head + table[b] * d * bs;  // [d][bs]
        for (int64_t g = 0; g < group; ++g) {
          float sc[BS ? BS : 1] = {};
          float* __restrict out_sc = &scores[g * nblocks * bs + b * bs];
#if FLOTILLA_AVX512
          if constexpr (BS == 16) {
            // four independent FMA chains hide the FMA latency
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            const float* qg = &qf[g * d];
            int64_t i = 0;
            for (; i + 4 <= d; i += 4) {
              a0 = _mm512_fmadd_ps(_mm512_set1_ps(qg[i]), load16(kb + i * 16), a0);
              a1 = _mm512_fmadd_ps(_mm512_set1_ps(qg[i + 1]), load16(kb + (i + 1) * 16), a1);
              a2 = _mm512_fmadd_ps(_mm512_set1_ps(qg[i + 2]), load16(kb + (i + 2) * 16), a2);
              a3 = _mm512_fmadd_ps(_mm512_set1_ps(qg[i + 3]), load16(kb + (i + 3) * 16), a3);
            }
            for (; i < d; ++i)
              a0 = _mm512_fmadd_ps(_mm512_set1_ps(qg[i]), load16(kb + i * 16), a0);
            _mm512_storeu_ps(out_sc, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
            continue;
          }
#endif
          if constexpr (BS != 0) {
            for (int64_t i = 0; i < d; ++i) {
              const float qi = qf[g * d + i];
              for (int64_t j = 0; j < BS; ++j) sc[j] += qi * to_float(kb[i * BS + j]);
            }
            for (int64_t j = 0; j < BS; ++j) out_sc[j] = sc[j];
          } else {
            for (int64_t j = 0; j < bs; ++j) out_sc[j] = 0.f;
            for (int64_t i = 0; i < d; ++i) {
              const float qi = qf[g * d + i];
              for (int64_t j = 0; j < bs; ++j) out_sc[j] += qi * to_float(kb[i * bs + j]);
            }
          }
        }
      }
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sc = &scores[g * nblocks * bs];
        float m = -FLT_MAX;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const float* p = &scores[g * nblocks * bs];
#if FLOTILLA_AVX512
        if constexpr (D != 0 && D % 16 == 0 && D <= 256) {
          __m512 a[D / 16];
          for (int64_t c = 0; c < D / 16; ++c) a[c] = _mm512_setzero_ps();
          for (int64_t t = 0; t < len; ++t) {
            const T* vrow = v_head + (table[t / bs] * bs + t % bs) * D;
            const __m512 pt = _mm512_set1_ps(p[t]);
            for (int64_t c = 0; c < D / 16; ++c)
              a[c] = _mm512_fmadd_ps(pt, load16(vrow + c * 16), a[c]);
          }
          for (int64_t c = 0; c < D / 16; ++c) _mm512_storeu_ps(&acc[g * D + c * 16], a[c]);
          continue;
        }
#endif
        if constexpr (D != 0) {
          float a[D] = {};
          for (int64_t t = 0; t < len; ++t) {
            const T* vrow = v_head + (table[t / bs] * bs + t % bs) * D;
            const float pt = p[t];
            for (int64_t i = 0; i < D; ++i) a[i] += pt * to_float(vrow[i]);
          }
          for (int64_t i = 0; i < D; ++i) acc[g * D + i] = a[i];
        } else {
          float* __restrict a = &acc[g * d];
          for (int64_t t = 0; t < len; ++t) {
            const T* vrow = v_head + (table[t / bs] * bs + t % bs) * d;
            const float pt = p[t];
            for (int64_t i = 0; i < d; ++i) a[i] += pt * to_float(vrow[i]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          op[(s * heads + h * group + g) * d + i] = from_float<T>(acc[g * d + i] * inv_sum[g]);
    }
  });
}

template <typename T>
void dispatch_sizes(const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& tables,
                    const torch::Tensor& lens, torch::Tensor& out, double scale) {
  const int64_t bs = k_cache.size(3), d = q.size(2);
  if (bs == 16 && d == 64) return run<T, 16, 64>(q, k_cache, v_cache, tables, lens, out, scale);
  if (bs == 16 && d == 128) return run<T, 16, 128>(q, k_cache, v_cache, tables, lens, out, scale);
  run<T, 0, 0>(q, k_cache, v_cache, tables, lens, out, scale);
}

}  // namespace

// q: [S, H, D] contiguous; k_cache [KVH, num_blocks, D, bs], v_cache [KVH, num_blocks, bs, D];
// block_tables: [S, max_blocks]
// int64; seq_lens: [S] int64 (tokens of context, the query's own included). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention needs contiguous inputs");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    dispatch_sizes<c10::BFloat16>(q, k_cache, v_cache, tables, lens, out, scale);
  } else if (q.scalar_type() == torch::kHalf) {
    dispatch_sizes<c10::Half>(q, k_cache, v_cache, tables, lens, out, scale);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "unsupported dtype");
    dispatch_sizes<float>(q, k_cache, v_cache, tables, lens, out, scale);
  }
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_rotated_heads, int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm, in place");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation");
  m.def("rotary_inplace", &rotary_inplace, "neox RoPE on q and k, in place");
}
