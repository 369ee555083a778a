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
#include <type_traits>
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
  const int64_t q_row = q.stride(0);  // q may be a row view into the fused qkv
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
          qf[g * d + i] = to_float(qp[s * q_row + (h * group + g) * d + i]) * float(scale);
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

#if FLOTILLA_AVX512
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

template <typename T>
inline void prefetch_bytes(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

template <typename T>
inline void prefetch_l2(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// The common case, block size 16 and head size D (a multiple of 16), with the G query
// heads of a kv head handled together: each key row and value row is loaded and widened
// once for all G heads (not once per head), the softmax is vectorized, and the next
// block is prefetched while the current one is computed (blocks of a sequence are
// scattered over the pool once the prefix cache has churned; without prefetching a
// random block order was 3x slower than a sequential one).
template <typename T, int64_t D, int64_t G>
void run_bs16(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
              double scale) {
  constexpr int64_t BS = 16, C = D / 16;
  // value accumulators: heads per pass so that GC * C registers stay <= 24
  constexpr int64_t GC = std::max<int64_t>(1, std::min<int64_t>(G, 24 / C));
  const int64_t num_seqs = q.size(0), heads = q.size(1);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const int64_t q_row = q.stride(0);  // q may be a row view into the fused qkv
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[G][D];
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, h = work % kv_heads;
      const int64_t len = lens[s], nblocks = (len + BS - 1) / BS, padded = nblocks * BS;
      const int64_t* table = tables + s * max_blocks;
      scores.resize(G * padded);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D; ++i)
          qf[g][i] = to_float(qp[s * q_row + (h * G + g) * D + i]) * float(scale);
      const T* k_head = kp + h * num_blocks * D * BS;
      const T* v_head = vp + h * num_blocks * BS * D;
      // all of this sequence's key and value blocks towards L2 at once (many misses in
      // flight instead of one block's worth), the next key block into L1
      for (int64_t b = 0; b < nblocks; ++b) {
        prefetch_l2(k_head + table[b] * D * BS, D * BS * sizeof(T));
        prefetch_l2(v_head + table[b] * BS * D, D * BS * sizeof(T));
      }
      prefetch_bytes(k_head + table[0] * D * BS, D * BS * sizeof(T));
      for (int64_t b = 0; b < nblocks; ++b) {
        if (b + 1 < nblocks) prefetch_bytes(k_head + table[b + 1] * D * BS, D * BS * sizeof(T));
        const T* kb = k_head + table[b] * D * BS;  // [D][16]
        __m512 a0[G], a1[G];  // two chains per head hide the FMA latency
        for (int64_t g = 0; g < G; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 2) {
          const __m512 k0 = load16(kb + i * BS), k1 = load16(kb + (i + 1) * BS);
          for (int64_t g = 0; g < G; ++g) {
            a0[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g][i]), k0, a0[g]);
            a1[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g][i + 1]), k1, a1[g]);
          }
        }
        for (int64_t g = 0; g < G; ++g)
          _mm512_storeu_ps(&scores[g * padded + b * BS], _mm512_add_ps(a0[g], a1[g]));
      }
      // softmax per head; the last block's lanes past len are masked out
      const __mmask16 tail = (len % BS) ? __mmask16((1u << (len % BS)) - 1) : __mmask16(0xFFFF);
      float inv_sum[G];
      for (int64_t g = 0; g < G; ++g) {
        float* sc = &scores[g * padded];
        __m512 m = _mm512_set1_ps(-FLT_MAX);
        for (int64_t b = 0; b + 1 < nblocks; ++b) m = _mm512_max_ps(m, _mm512_loadu_ps(sc + b * BS));
        m = _mm512_mask_max_ps(m, tail, m, _mm512_loadu_ps(sc + (nblocks - 1) * BS));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; ++b) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + b * BS), mx));
          if (b + 1 == nblocks) e = _mm512_maskz_mov_ps(tail, e);
          _mm512_storeu_ps(sc + b * BS, e);
          sum = _mm512_add_ps(sum, e);
        }
        inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
      }
      // out_g = sum_t p_g[t] v_t, GC heads per pass over the (now cached) value rows
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        constexpr int64_t N = GC;
        const int64_t ng = std::min<int64_t>(N, G - g0);
        __m512 acc[N][C];
        for (int64_t g = 0; g < N; ++g)
          for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; ++b) {
          const T* vb = v_head + table[b] * BS * D;
          const int64_t rows = std::min<int64_t>(BS, len - b * BS);
          for (int64_t j = 0; j < rows; ++j) {
            __m512 v[C];
            for (int64_t c = 0; c < C; ++c) v[c] = load16(vb + j * D + c * 16);
            for (int64_t g = 0; g < N; ++g) {
              if (g >= ng) break;
              const __m512 pt = _mm512_set1_ps(scores[(g0 + g) * padded + b * BS + j]);
              for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pt, v[c], acc[g][c]);
            }
          }
        }
        for (int64_t g = 0; g < ng; ++g) {
          T* o = op + (s * heads + h * G + g0 + g) * D;
          const __m512 inv = _mm512_set1_ps(inv_sum[g0 + g]);
          alignas(64) float row[D];
          for (int64_t c = 0; c < C; ++c) _mm512_store_ps(row + c * 16, _mm512_mul_ps(acc[g][c], inv));
          for (int64_t i = 0; i < D; ++i) o[i] = from_float<T>(row[i]);
        }
      }
    }
  });
}

template <typename T, int64_t D>
bool dispatch_group(int64_t group, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& tables,
                    const torch::Tensor& lens, torch::Tensor& out, double scale) {
  switch (group) {
    case 1: run_bs16<T, D, 1>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 2: run_bs16<T, D, 2>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 3: run_bs16<T, D, 3>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 4: run_bs16<T, D, 4>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 5: run_bs16<T, D, 5>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 6: run_bs16<T, D, 6>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 7: run_bs16<T, D, 7>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    case 8: run_bs16<T, D, 8>(q, k_cache, v_cache, tables, lens, out, scale); return true;
    default: return false;
  }
}
#endif

template <typename T>
void dispatch_sizes(const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& tables,
                    const torch::Tensor& lens, torch::Tensor& out, double scale) {
  const int64_t bs = k_cache.size(3), d = q.size(2);
#if FLOTILLA_AVX512
  if constexpr (!std::is_same_v<T, c10::Half>) {
    const int64_t group = q.size(1) / k_cache.size(0);
    if (bs == 16 && d == 64 && dispatch_group<T, 64>(group, q, k_cache, v_cache, tables, lens, out, scale)) return;
    if (bs == 16 && d == 128 && dispatch_group<T, 128>(group, q, k_cache, v_cache, tables, lens, out, scale)) return;
  }
#endif
  if (bs == 16 && d == 64) return run<T, 16, 64>(q, k_cache, v_cache, tables, lens, out, scale);
  if (bs == 16 && d == 128) return run<T, 16, 128>(q, k_cache, v_cache, tables, lens, out, scale);
  run<T, 0, 0>(q, k_cache, v_cache, tables, lens, out, scale);
}

}  // namespace

// q: [S, H, D], heads contiguous within a row (rows may be strided); k_cache [KVH, num_blocks, D, bs], v_cache [KVH, num_blocks, bs, D];
// block_tables: [S, max_blocks]
// int64; seq_lens: [S] int64 (tokens of context, the query's own included). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_decode_attention needs contiguous heads and caches");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty(q.sizes(), q.options());
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
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots);
torch::Tensor argmax_rows(torch::Tensor x);
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_rotated_heads, int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm, in place");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation");
  m.def("rotary_inplace", &rotary_inplace, "neox RoPE on q and k, in place");
  m.def("store_kv", &store_kv, "write keys/values into their paged cache slots");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (float32)");
}
