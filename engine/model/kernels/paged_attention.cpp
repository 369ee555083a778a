// Paged attention for the CPU: every query row of a step (decodes and prefill chunks
// alike) attends to its sequence's keys and values straight from the block-structured
// cache, causally (row i of a chunk sees the context up to its own position). No gather
// copy, no padding, no mask tensor.
//
// Cache views (see engine/model/attention/block_major.py): keys [KVH, num_blocks, D, bs] (each
// block stored transposed, so the scores of a block's bs tokens are bs-wide vector
// operations with no horizontal sums), values [KVH, num_blocks, bs, D]; heads and blocks
// may be strided (the engine stores a block's heads, keys and values together), each
// block is contiguous. Work is split over (query row, kv head) pairs; each computes its G = H / KVH query heads' scores, a
// float32 softmax, and the weighted sum of values.
//
// An fp8 cache (kv_cache_dtype fp8: e4m3 bytes, one scale per layer for keys and one for
// values) is written as x / scale, saturated to +-448 and rounded to nearest even, and
// read through run_generic with each byte widened by a table: the scales fold into the
// queries and into the output.
//
// A sliding window (window > 0: a row at position p sees keys p - window + 1 .. p, as
// Mistral's and Gemma's local layers) starts each row's table at the block holding its
// first visible key; the keys before it in that block get -FLT_MAX scores. Blocks before
// it are never read: the KV cache manager may have freed them (their table entries then
// name a null block).
//
// Attention sinks (gpt-oss: a learned logit per query head, sinks [H] float32): the sink
// joins each softmax's denominator as a key with no value, so every kernel's 1 / sum
// becomes 1 / (sum + exp(sink - max)); the output is the same weighted sum of values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "convert.h"
#include "simd.h"
#include "vec.h"

namespace {

using flotilla::from_float;
using flotilla::to_float;

// An fp8 (e4m3) cache element: its byte, widened by a table (exact).
struct E4M3 {
  uint8_t bits;
};

inline float to_float(E4M3 x) { return flotilla::e4m3_to_float(x.bits); }

// x / scale as an e4m3 byte: saturated to the largest finite value (+-448), as vLLM's
// cache write does, since the type's conversion maps overflow to NaN
inline E4M3 to_e4m3(float x, float inv_scale) {
  const float v = std::min(448.f, std::max(-448.f, x * inv_scale));
  return E4M3{c10::Float8_e4m3fn(v).x};
}

// What every kernel variant reads: pointers, sizes, and each query row's sequence,
// visible context length, and whether it is its sequence's first row (which prefetches).
// C: the caches' element type (T, or E4M3 for an fp8 cache with its scales).
template <typename T, typename C = T>
struct Problem {
  const T* q;
  int64_t q_row;  // q may be a row view into the fused qkv
  C* k;  // the caches: written (this step's tokens), then read
  C* v;
  float k_scale = 1.f, v_scale = 1.f;  // fp8: the stored value is x / scale
  T* out;
  const int64_t* tables;
  int64_t max_blocks, heads, kv_heads, group, num_blocks, d, bs;  // num_blocks: in the cache
  int64_t k_hs, k_bs, v_hs, v_bs;  // element strides of a kv head and of a block
  float scale;
  std::vector<int64_t> row_seq, row_len;  // row_len: keys from the row's first table block
  std::vector<int64_t> row_b0, row_skip;  // its first block (window), keys skipped in it
  int64_t window = 0;
  const float* sinks = nullptr;  // [heads] float32, or none
  std::vector<char> row_first, row_decode;  // row_decode: its sequence has this one row
  const T* k_new;  // this step's keys and values [T, KVH, D] (rows may be strided)
  const T* v_new;
  int64_t k_new_row, v_new_row;
  const int64_t* slots;  // [T] cache slot of each row's token: block * bs + offset
  std::vector<int64_t> seq_start;  // [S + 1] each sequence's first row
  std::vector<int64_t> row_ids;  // the rows the per-row kernels attend (all unless AMX takes chunks)

  Problem(const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_,
          const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots_,
          const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
          const torch::Tensor& query_start, torch::Tensor& out_, double scale_,
          int64_t window_ = 0) {
    window = window_;
    q = q_.data_ptr<T>();
    q_row = q_.stride(0);
    k_new = k_.data_ptr<T>();
    v_new = v_.data_ptr<T>();
    k_new_row = k_.stride(0);
    v_new_row = v_.stride(0);
    slots = slots_.data_ptr<int64_t>();
    k = static_cast<C*>(k_cache.data_ptr());
    v = static_cast<C*>(v_cache.data_ptr());
    out = out_.data_ptr<T>();
    tables = block_tables.data_ptr<int64_t>();
    max_blocks = block_tables.size(1);
    heads = q_.size(1);
    kv_heads = k_cache.size(0);
    group = heads / kv_heads;
    num_blocks = k_cache.size(1);
    k_hs = k_cache.stride(0), k_bs = k_cache.stride(1);
    v_hs = v_cache.stride(0), v_bs = v_cache.stride(1);
    d = q_.size(2);
    bs = k_cache.size(3);
    scale = float(scale_);
    const int64_t rows = q_.size(0), seqs = seq_lens.size(0);
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* starts = query_start.data_ptr<int64_t>();
    TORCH_CHECK(query_start.size(0) == seqs + 1 && starts[0] == 0 && starts[seqs] == rows,
                "query_start must hold the S + 1 row offsets of the S sequences");
    row_seq.resize(rows);
    row_len.resize(rows);
    row_b0.assign(rows, 0);
    row_skip.assign(rows, 0);
    row_first.resize(rows);
    row_decode.resize(rows);
    seq_start.assign(starts, starts + seqs + 1);
    row_ids.resize(rows);
    for (int64_t r = 0; r < rows; ++r) row_ids[r] = r;
    TORCH_CHECK(block_tables.size(0) == seqs, "one block table per sequence");
    for (int64_t s = 0; s < seqs; ++s) {
      TORCH_CHECK(starts[s + 1] >= starts[s] && starts[s + 1] - starts[s] <= lens[s] &&
                  lens[s] <= max_blocks * bs,
                  "sequence ", s, ": context length does not fit its queries or block table");
      const int64_t first_key = window > 0 && starts[s + 1] > starts[s]
          ? std::max<int64_t>(0, lens[s] - (starts[s + 1] - starts[s]) + 1 - window) : 0;
      for (int64_t b = first_key / bs; b < (lens[s] + bs - 1) / bs; ++b) {
        const int64_t block = tables[s * max_blocks + b];
        TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block ", block,
                    " is outside the cache");
      }
      for (int64_t r = starts[s]; r < starts[s + 1]; ++r) {
        row_seq[r] = s;
        row_len[r] = lens[s] - (starts[s + 1] - 1 - r);  // keys up to the row's position
        if (window > 0) {
          const int64_t lo = std::max<int64_t>(0, row_len[r] - window);
          row_b0[r] = lo / bs;
          row_skip[r] = lo - row_b0[r] * bs;
          row_len[r] -= row_b0[r] * bs;
        }
        row_first[r] = r == starts[s];
        row_decode[r] = starts[s + 1] - starts[s] == 1;
        TORCH_CHECK(slots[r] >= 0 && slots[r] < num_blocks * bs, "row ", r, ": cache slot ",
                    slots[r], " is outside the cache");
      }
    }
  }

  // Row r's block table from its first visible block.
  const int64_t* row_table(int64_t r) const { return tables + row_seq[r] * max_blocks + row_b0[r]; }

  // The sink of query head hq as softmax_* take it (-inf: none, adds nothing).
  float sink(int64_t hq) const { return sinks ? sinks[hq] : -INFINITY; }

  // Hides the keys before row r's window in its first block from G heads' scores (each
  // head's `padded` apart), before the softmax.
  void mask_window(int64_t r, float* scores, int64_t heads_, int64_t padded) const {
    for (int64_t g = 0; g < heads_; ++g)
      for (int64_t j = 0; j < row_skip[r]; ++j) scores[g * padded + j] = -FLT_MAX;
  }
};

// Writes row r's key and value of kv head h into its cache slot (keys transposed).
template <typename T, typename C>
inline void store_token(const Problem<T, C>& p, int64_t r, int64_t h) {
  const int64_t block = p.slots[r] / p.bs, off = p.slots[r] % p.bs;
  const T* kr = p.k_new + r * p.k_new_row + h * p.d;
  const T* vr = p.v_new + r * p.v_new_row + h * p.d;
  C* kdst = p.k + h * p.k_hs + block * p.k_bs + off;  // [D][bs] block
  C* vdst = p.v + h * p.v_hs + block * p.v_bs + off * p.d;  // [bs][D] block
  if constexpr (std::is_same_v<T, C>) {
    for (int64_t i = 0; i < p.d; ++i) kdst[i * p.bs] = kr[i];
    std::memcpy(vdst, vr, p.d * sizeof(T));
  } else {
    const float inv_k = 1.f / p.k_scale, inv_v = 1.f / p.v_scale;
    for (int64_t i = 0; i < p.d; ++i) kdst[i * p.bs] = to_e4m3(to_float(kr[i]), inv_k);
    for (int64_t i = 0; i < p.d; ++i) vdst[i] = to_e4m3(to_float(vr[i]), inv_v);
  }
}

// The tokens of prefill chunks go into the cache before any row attends: a row reads the
// keys of the rows before it, which other threads may handle. A decode row writes its
// own token inside its work item instead (no other row reads it this step: a partly
// filled block is never shared), so those writes overlap the context prefetch.
template <typename T, typename C>
void store_prefill_tokens(const Problem<T, C>& p) {
  const int64_t rows = int64_t(p.row_seq.size());
  if (std::all_of(p.row_decode.begin(), p.row_decode.end(), [](char d) { return d != 0; })) return;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (!p.row_decode[r])
        for (int64_t h = 0; h < p.kv_heads; ++h) store_token(p, r, h);
  });
}

// Any head and block size: BS and D are the sizes when known at compile time (0: read at
// run time); fixed sizes let the compiler turn the short inner loops into vector code.
// The one kernel of fp8 caches (C = E4M3): k_scale folds into the queries, v_scale into
// the output (1 for other caches: the same values).
template <typename T, int64_t BS, int64_t D, typename C = T>
void run_generic(const Problem<T, C>& p) {
  const int64_t d = D ? D : p.d, bs = BS ? BS : p.bs, group = p.group;
  at::parallel_for(0, int64_t(p.row_ids.size()) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores, inv_sum(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t r = p.row_ids[work / p.kv_heads], h = work % p.kv_heads;
      const int64_t len = p.row_len[r], nblocks = (len + bs - 1) / bs;
      const int64_t* table = p.row_table(r);
      if (p.row_decode[r]) store_token(p, r, h);
      scores.resize(group * nblocks * bs);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = to_float(p.q[r * p.q_row + (h * group + g) * d + i]) * p.scale *
                          p.k_scale;
      const C* k_head = p.k + h * p.k_hs;
      const C* v_head = p.v + h * p.v_hs;
      for (int64_t b = 0; b < nblocks; ++b) {
        const C* kb = k_head + table[b] * p.k_bs;  // [d][bs]
        for (int64_t g = 0; g < group; ++g) {
          float* __restrict out_sc = &scores[g * nblocks * bs + b * bs];
          if constexpr (BS != 0) {
            float sc[BS] = {};
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
      p.mask_window(r, scores.data(), group, nblocks * bs);
      for (int64_t g = 0; g < group; ++g) {
        float* sc = &scores[g * nblocks * bs];
        float m = -FLT_MAX;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sc[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sc[t] = std::exp(sc[t] - m);
          sum += sc[t];
        }
        inv_sum[g] = p.v_scale / (sum + std::exp(p.sink(h * group + g) - m));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const float* pr = &scores[g * nblocks * bs];
        float* __restrict a = &acc[g * d];
        for (int64_t t = 0; t < len; ++t) {
          const C* vrow = v_head + table[t / bs] * p.v_bs + (t % bs) * d;
          const float pt = pr[t];
          for (int64_t i = 0; i < d; ++i) a[i] += pt * to_float(vrow[i]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          p.out[(r * p.heads + h * group + g) * d + i] = from_float<T>(acc[g * d + i] * inv_sum[g]);
    }
  });
}

// BYTES of memory into L1. The size is a template argument: passed at run time, GCC kept
// the loop opaque and the next-item fetches below gained nothing (346 vs 193 us a call).
template <int64_t BYTES>
__attribute__((always_inline)) inline void prefetch_l1(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < BYTES; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// The next work item's context is fetched while this one computes. Decode attention
// streams each layer's KV from memory (W1: 6.3 MB a layer call, 189 MB a step at bf16),
// and a core that loads a block only when it reaches it waits out the memory latency
// block after block. So item (row r, kv head h) fetches what the thread's next item
// reads, spread over its own blocks: key block b pulls in block b's share of the next
// item's key blocks, value block b the same share of its value blocks. Into L1 (T0; T2
// measured 8 % slower); a burst of the whole 32 KB at the item's start, every other line,
// or dropping the next-key-block fetch each measured slower. bench/kernels.py, 2 threads,
// Zen 5, each call on the next of 30 layers' caches: bf16 450 -> 220 us (the AVX2 build
// 615 -> 319), float32 639 -> 460 (586 -> 400), against ~150 us to read the same bf16
// bytes with no compute. The instructions cost where a layer's KV stays in cache (the
// same call repeated on one layer: bf16 99 -> 104 us, float32 150 -> 181), which a step
// of the engine meets only with a tiny batch. The previous scheme (the next row's blocks
// towards L2, a sequence's whole context at a thread's start) measured no better than no
// prefetching.
//
// Only an item whose context is not cached yet is fetched ahead: one that starts a
// sequence (every decode row; a prefill chunk's first row). A chunk's later rows read the
// blocks its first row brought in.
struct Item {
  int64_t r, h, len, nblocks, padded;
  const int64_t* table;
  const int64_t* next_table = nullptr;  // the next item's blocks, when fetched ahead
  int64_t next_blocks = 0, next_h = 0;
};

template <typename T, typename E>
inline Item start_item(const Problem<T, E>& p, int64_t work, int64_t end) {
  constexpr int64_t BS = 16;
  Item it;
  it.r = p.row_ids[work / p.kv_heads], it.h = work % p.kv_heads;
  it.len = p.row_len[it.r], it.nblocks = (it.len + BS - 1) / BS, it.padded = it.nblocks * BS;
  it.table = p.row_table(it.r);
  if (work + 1 < end) {
    const int64_t next_r = p.row_ids[(work + 1) / p.kv_heads];
    if (p.row_first[next_r]) {
      it.next_table = p.row_table(next_r);
      it.next_blocks = (p.row_len[next_r] + BS - 1) / BS;
      it.next_h = (work + 1) % p.kv_heads;
    }
  }
  if (p.row_decode[it.r]) store_token(p, it.r, it.h);
  return it;
}

// Block b's share of the next item's blocks of one cache (keys or values): `next_head`
// is that cache at the next item's kv head, `stride` its block stride, BYTES a block's
// size.
template <int64_t BYTES, typename E>
__attribute__((always_inline)) inline void prefetch_next(const Item& it, int64_t b,
                                                         const E* next_head, int64_t stride) {
  for (int64_t j = b * it.next_blocks / it.nblocks; j < (b + 1) * it.next_blocks / it.nblocks; ++j)
    prefetch_l1<BYTES>(next_head + it.next_table[j] * stride);
}

// Before key block b of an item: its next key block into L1, and block b's share of the
// next item's key blocks (`k_next`: the keys at the next item's kv head).
template <int64_t BYTES, typename E>
__attribute__((always_inline)) inline void prefetch_keys(const Item& it, int64_t b, const E* k_head,
                                                         const E* k_next, int64_t stride) {
  if (b + 1 < it.nblocks) prefetch_l1<BYTES>(k_head + it.table[b + 1] * stride);
  prefetch_next<BYTES>(it, b, k_next, stride);
}

// An item's G query heads, widened to float32 and scaled (times k_scale_eff: an fp8
// cache's key scale as its keys are widened, 1 otherwise).
template <typename T, int64_t D, int64_t G, typename E>
inline void load_queries(const Problem<T, E>& p, const Item& it, float (&qf)[G][D],
                         float k_scale_eff = 1.f) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i)
      qf[g][i] = to_float(p.q[it.r * p.q_row + (it.h * G + g) * D + i]) * p.scale * k_scale_eff;
}

namespace vec = flotilla::vec;

// Softmax of one head's scores in place (float32, vectorized); lanes past len are zeroed
// (their keys may be garbage, NaN included). Returns 1 / sum.
inline float softmax_vec(float* sc, int64_t len, int64_t padded, float sink) {
  using vec::L;
  const int64_t full = len / L * L;
  vec::vf m = vec::splat(-FLT_MAX);
  for (int64_t t = 0; t < full; t += L) m = vec::vmax(m, vec::load(sc + t));
  if (full < len)
    m = vec::vmax(m, vec::lanes() < int32_t(len - full) ? vec::load(sc + full) : vec::splat(-FLT_MAX));
  const float mx = vec::reduce_max(m);
  vec::vf sum = vec::splat(0.f);
  for (int64_t t = 0; t < padded; t += L) {
    vec::vf e = vec::exp(vec::load(sc + t) - mx);
    if (t + L > len) e = vec::lanes() < int32_t(len - t) ? e : vec::splat(0.f);
    vec::store(sc + t, e);
    sum += e;
  }
  return 1.f / (vec::reduce_add(sum) + std::exp(sink - mx));
}

// Block size 16 and head size D (a multiple of the lanes L): the kernel of every target
// without a hand-written one (AVX2 + FMA, NEON, SSE2), float32 FMAs on widened keys and
// values in vec.h's vectors. As run_fma below: the G query heads of a kv head share each
// key and value load, the next key block is prefetched into L1 while one is computed, the
// next item's context a share per block (start_item). Tiles fit the target's registers: GS heads' score
// accumulators (a block's 16 scores are NB vectors) and GC heads' value accumulators (a
// value row is C vectors) per pass.
template <typename T, int64_t D, int64_t G>
void run_vec(const Problem<T>& p) {
  using vec::L;
  using vec::vf;
  constexpr int64_t BS = 16, NB = BS / L, C = D / L;
  static_assert(BS % L == 0 && D % L == 0, "blocks and heads must be whole vectors");
  constexpr int64_t GS = std::max<int64_t>(1, std::min<int64_t>(G, (vec::kRegs - NB) / NB * 3 / 4));
  constexpr int64_t GC = std::max<int64_t>(1, std::min<int64_t>(G, vec::kRegs * 3 / 4 / C));
  at::parallel_for(0, int64_t(p.row_ids.size()) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[G][D];
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const Item it = start_item(p, work, end);
      const int64_t r = it.r, h = it.h, len = it.len, nblocks = it.nblocks, padded = it.padded;
      const int64_t* table = it.table;
      scores.resize(G * padded);
      load_queries(p, it, qf);
      const T* k_head = p.k + h * p.k_hs;
      const T* v_head = p.v + h * p.v_hs;
      const T* k_next = p.k + it.next_h * p.k_hs;
      const T* v_next = p.v + it.next_h * p.v_hs;
      prefetch_l1<D * BS * sizeof(T)>(k_head + table[0] * p.k_bs);
      for (int64_t b = 0; b < nblocks; ++b) {
        prefetch_keys<D * BS * sizeof(T)>(it, b, k_head, k_next, p.k_bs);
        const T* kb = k_head + table[b] * p.k_bs;  // [D][16]
        for (int64_t g0 = 0; g0 < G; g0 += GS) {
          vf a[GS][NB];
          for (int64_t g = 0; g < GS; ++g)
            for (int64_t n = 0; n < NB; ++n) a[g][n] = vec::splat(0.f);
          for (int64_t i = 0; i < D; ++i) {
            vf k[NB];
            for (int64_t n = 0; n < NB; ++n) k[n] = vec::load(kb + i * BS + n * L);
            for (int64_t g = 0; g < GS && g0 + g < G; ++g) {
              const vf q = vec::splat(qf[g0 + g][i]);
              for (int64_t n = 0; n < NB; ++n) a[g][n] += q * k[n];
            }
          }
          for (int64_t g = 0; g < GS && g0 + g < G; ++g)
            for (int64_t n = 0; n < NB; ++n)
              vec::store(&scores[(g0 + g) * padded + b * BS + n * L], a[g][n]);
        }
      }
      float inv_sum[G];
      p.mask_window(r, scores.data(), G, padded);
      for (int64_t g = 0; g < G; ++g)
        inv_sum[g] = softmax_vec(&scores[g * padded], len, padded, p.sink(h * G + g));
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        vf acc[GC][C];
        for (int64_t g = 0; g < GC; ++g)
          for (int64_t c = 0; c < C; ++c) acc[g][c] = vec::splat(0.f);
        for (int64_t b = 0; b < nblocks; ++b) {
          const T* vb = v_head + table[b] * p.v_bs;
          const int64_t rows = std::min<int64_t>(BS, len - b * BS);
          if (g0 == 0) prefetch_next<D * BS * sizeof(T)>(it, b, v_next, p.v_bs);
          for (int64_t j = 0; j < rows; ++j) {
            vf v[C];
            for (int64_t c = 0; c < C; ++c) v[c] = vec::load(vb + j * D + c * L);
            for (int64_t g = 0; g < GC && g0 + g < G; ++g) {
              const vf pt = vec::splat(scores[(g0 + g) * padded + b * BS + j]);
              for (int64_t c = 0; c < C; ++c) acc[g][c] += pt * v[c];
            }
          }
        }
        for (int64_t g = 0; g < GC && g0 + g < G; ++g) {
          T* o = p.out + (r * p.heads + h * G + g0 + g) * D;
          for (int64_t c = 0; c < C; ++c) vec::store(o + c * L, acc[g][c] * inv_sum[g0 + g]);
        }
      }
    }
  });
}

#if FLOTILLA_AVX512
using flotilla::exp16;
using flotilla::load16;
using flotilla::kE4M3Widened;
inline __m512 load16(const E4M3* p) {  // value / kE4M3Widened
  return flotilla::widen_e4m3(reinterpret_cast<const uint8_t*>(p));
}

// Softmax of one head's scores in place (float32, vectorized); lanes of the last block
// past len are zeroed. Returns 1 / sum.
inline float softmax_blocks(float* sc, int64_t len, int64_t nblocks, float sink) {
  constexpr int64_t BS = 16;
  const __mmask16 tail = (len % BS) ? __mmask16((1u << (len % BS)) - 1) : __mmask16(0xFFFF);
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
  return 1.f / (_mm512_reduce_add_ps(sum) + std::exp(sink - _mm512_reduce_max_ps(mx)));
}

// Block size 16 and head size D (a multiple of 16), float32 FMAs on widened keys and
// values, the G query heads of a kv head together: each key row and value row is loaded
// and widened once for all G heads, and the next key block is prefetched into L1 while
// the current one is computed (the next item's context too, see start_item). E: the
// cache's element type (T, or E4M3: its scales, and the widening's 2^8, fold into the
// queries and the output).
template <typename T, int64_t D, int64_t G, typename E = T>
void run_fma(const Problem<T, E>& p) {
  constexpr int64_t BS = 16, C = D / 16;
  constexpr float widened = std::is_same_v<E, E4M3> ? kE4M3Widened : 1.f;
  const float k_eff = p.k_scale * widened, v_eff = p.v_scale * widened;
  // value accumulators: heads per pass so that GC * C registers stay <= 24
  constexpr int64_t GC = std::max<int64_t>(1, std::min<int64_t>(G, 24 / C));
  at::parallel_for(0, int64_t(p.row_ids.size()) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qf[G][D];
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const Item it = start_item(p, work, end);
      const int64_t r = it.r, h = it.h, len = it.len, nblocks = it.nblocks, padded = it.padded;
      const int64_t* table = it.table;
      scores.resize(G * padded);
      load_queries(p, it, qf, k_eff);
      const E* k_head = p.k + h * p.k_hs;
      const E* v_head = p.v + h * p.v_hs;
      const E* k_next = p.k + it.next_h * p.k_hs;
      const E* v_next = p.v + it.next_h * p.v_hs;
      prefetch_l1<D * BS * sizeof(E)>(k_head + table[0] * p.k_bs);
      for (int64_t b = 0; b < nblocks; ++b) {
        prefetch_keys<D * BS * sizeof(E)>(it, b, k_head, k_next, p.k_bs);
        const E* kb = k_head + table[b] * p.k_bs;  // [D][16]
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
      float inv_sum[G];
      p.mask_window(r, scores.data(), G, padded);
      for (int64_t g = 0; g < G; ++g)
        inv_sum[g] = softmax_blocks(&scores[g * padded], len, nblocks, p.sink(h * G + g)) * v_eff;
      // out_g = sum_t p_g[t] v_t, GC heads per pass over the (now cached) value rows
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        const int64_t ng = std::min<int64_t>(GC, G - g0);
        __m512 acc[GC][C];
        for (int64_t g = 0; g < GC; ++g)
          for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; ++b) {
          const E* vb = v_head + table[b] * p.v_bs;
          const int64_t rows = std::min<int64_t>(BS, len - b * BS);
          if (g0 == 0) prefetch_next<D * BS * sizeof(E)>(it, b, v_next, p.v_bs);
          for (int64_t j = 0; j < rows; ++j) {
            __m512 v[C];
            for (int64_t c = 0; c < C; ++c) v[c] = load16(vb + j * D + c * 16);
            for (int64_t g = 0; g < GC; ++g) {
              if (g >= ng) break;
              const __m512 pt = _mm512_set1_ps(scores[(g0 + g) * padded + b * BS + j]);
              for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pt, v[c], acc[g][c]);
            }
          }
        }
        for (int64_t g = 0; g < ng; ++g) {
          T* o = p.out + (r * p.heads + h * G + g0 + g) * D;
          const __m512 inv = _mm512_set1_ps(inv_sum[g0 + g]);
          for (int64_t c = 0; c < C; ++c) flotilla::store16(o + c * 16, _mm512_mul_ps(acc[g][c], inv));
        }
      }
    }
  });
}
#endif

#if FLOTILLA_AVX512 && defined(__AVX512BF16__)
#define FLOTILLA_DPBF16 1
// bf16 on CPUs with AVX512_BF16: vdpbf16ps multiplies pairs of bf16 and adds both
// products to a float32 lane, so no key or value is widened and each instruction does two
// multiply-adds per lane (the widening FMA kernel spent more instructions converting than
// multiplying: 30 layers of W1 decode attention with the data in cache 5.5 -> 4.0 ms).
// Keys: rows i and i+1 of a [D][16] block are one 64-byte load, interleaved into
// (k[i][t], k[i+1][t]) pairs by one vpermw; q is bf16 already, so q.k is exact products
// summed in float32, scaled afterwards. Values: rows t and t+1 are interleaved by channel
// with vpermt2w and multiplied by (p[t], p[t+1]). p is split into a bf16 head and a bf16
// remainder (p = hi + lo to ~2^-16 relative), keeping float32-class accuracy instead of
// the 2^-9 of probabilities rounded to bf16.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
inline __m512bh bcast_pair(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return as_bh(_mm512_set1_epi32(int(w)));
}

// The vpermw / vpermt2w indices that pair bf16 rows for a dot product of pairs: `key`
// interleaves rows i, i + 1 of a [D][16] key block (token j's two channels side by side),
// `val_lo` / `val_hi` two value rows t, t + 1 by channel (channels 0..15, 16..31 of 32).
struct PairPerms {
  __m512i key, val_lo, val_hi;
};

inline const PairPerms& pair_perms() {
  static const PairPerms perms = [] {
    alignas(64) int16_t kidx[32], vlo[32], vhi[32];
    for (int j = 0; j < 16; ++j) {
      kidx[2 * j] = j, kidx[2 * j + 1] = 16 + j;
      vlo[2 * j] = j, vlo[2 * j + 1] = 32 + j;
      vhi[2 * j] = 16 + j, vhi[2 * j + 1] = 48 + j;
    }
    return PairPerms{_mm512_load_si512(kidx), _mm512_load_si512(vlo), _mm512_load_si512(vhi)};
  }();
  return perms;
}

template <int64_t D, int64_t G>
void run_dpbf16(const Problem<c10::BFloat16>& p) {
  constexpr int64_t BS = 16, C = D / 32;  // value channels per pass: 32 (two accumulators)
  constexpr int64_t GC = std::max<int64_t>(1, std::min<int64_t>(G, 12 / C));
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(p.q);
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(p.k);
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(p.v);
  const PairPerms& perms = pair_perms();
  const __m512i key_perm = perms.key, val_lo = perms.val_lo, val_hi = perms.val_hi;
  const __m512 scale = _mm512_set1_ps(p.scale);

  at::parallel_for(0, int64_t(p.row_ids.size()) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<uint16_t> p_hi, p_lo;
    for (int64_t work = begin; work < end; ++work) {
      const Item it = start_item(p, work, end);
      const int64_t r = it.r, h = it.h, len = it.len, nblocks = it.nblocks, padded = it.padded;
      const int64_t* table = it.table;
      scores.resize(G * padded);
      p_hi.resize(G * padded);
      p_lo.resize(G * padded);
      const uint16_t* qh = qp + r * p.q_row + h * G * D;
      const uint16_t* k_head = kp + h * p.k_hs;
      const uint16_t* v_head = vp + h * p.v_hs;
      const uint16_t* k_next = kp + it.next_h * p.k_hs;
      const uint16_t* v_next = vp + it.next_h * p.v_hs;
      prefetch_l1<D * BS * 2>(k_head + table[0] * p.k_bs);
      for (int64_t b = 0; b < nblocks; ++b) {
        prefetch_keys<D * BS * 2>(it, b, k_head, k_next, p.k_bs);
        const uint16_t* kb = k_head + table[b] * p.k_bs;  // [D][16]
        __m512 a0[G], a1[G];
        for (int64_t g = 0; g < G; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 4) {
          const __m512bh k0 = as_bh(_mm512_permutexvar_epi16(key_perm, _mm512_loadu_si512(kb + i * BS)));
          const __m512bh k1 = as_bh(_mm512_permutexvar_epi16(key_perm, _mm512_loadu_si512(kb + (i + 2) * BS)));
          for (int64_t g = 0; g < G; ++g) {
            a0[g] = _mm512_dpbf16_ps(a0[g], k0, bcast_pair(qh + g * D + i));
            a1[g] = _mm512_dpbf16_ps(a1[g], k1, bcast_pair(qh + g * D + i + 2));
          }
        }
        for (int64_t g = 0; g < G; ++g)
          _mm512_storeu_ps(&scores[g * padded + b * BS], _mm512_mul_ps(_mm512_add_ps(a0[g], a1[g]), scale));
      }
      float inv_sum[G];
      p.mask_window(r, scores.data(), G, padded);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = &scores[g * padded];
        inv_sum[g] = softmax_blocks(sc, len, nblocks, p.sink(h * G + g));
        for (int64_t t = 0; t < padded; t += 16) {
          const __m512 e = _mm512_loadu_ps(sc + t);
          const __m256bh hi = _mm512_cvtneps_pbh(e);
          const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(e, _mm512_cvtpbh_ps(hi)));
          std::memcpy(&p_hi[g * padded + t], &hi, 32);
          std::memcpy(&p_lo[g * padded + t], &lo, 32);
        }
      }
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        const int64_t ng = std::min<int64_t>(GC, G - g0);
        __m512 acc[GC][2 * C];
        for (int64_t g = 0; g < GC; ++g)
          for (int64_t c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; ++b) {
          const uint16_t* vb = v_head + table[b] * p.v_bs;
          const int64_t rows = std::min<int64_t>(BS, len - b * BS);
          if (g0 == 0) prefetch_next<D * BS * 2>(it, b, v_next, p.v_bs);
          for (int64_t j = 0; j < rows; j += 2) {
            // an odd last row pairs with a zero row (the slot past len may hold anything)
            const __mmask32 second = (j + 1 < rows) ? __mmask32(0xFFFFFFFFu) : __mmask32(0);
            const int64_t t = b * BS + j;
            for (int64_t c = 0; c < C; ++c) {
              const __m512i r0 = _mm512_loadu_si512(vb + j * D + c * 32);
              const __m512i r1 = _mm512_maskz_loadu_epi16(second, vb + (j + 1) * D + c * 32);
              const __m512bh lo = as_bh(_mm512_permutex2var_epi16(r0, val_lo, r1));
              const __m512bh hi = as_bh(_mm512_permutex2var_epi16(r0, val_hi, r1));
              for (int64_t g = 0; g < GC; ++g) {
                if (g >= ng) break;
                const int64_t at = (g0 + g) * padded + t;
                const __m512bh ph = bcast_pair(&p_hi[at]), pl = bcast_pair(&p_lo[at]);
                acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, ph);
                acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, ph);
                acc[g][2 * c] = _mm512_dpbf16_ps(acc[g][2 * c], lo, pl);
                acc[g][2 * c + 1] = _mm512_dpbf16_ps(acc[g][2 * c + 1], hi, pl);
              }
            }
          }
        }
        for (int64_t g = 0; g < ng; ++g) {
          c10::BFloat16* o = p.out + (r * p.heads + h * G + g0 + g) * D;
          const __m512 inv = _mm512_set1_ps(inv_sum[g0 + g]);
          for (int64_t c = 0; c < 2 * C; ++c) flotilla::store16(o + c * 16, _mm512_mul_ps(acc[g][c], inv));
        }
      }
    }
  });
}

// vdpbf16ps is not faster everywhere: Zen 5 runs it at twice float32 FMA's FLOPs, an
// Intel Xeon (Sapphire Rapids class) at half (measured with bench/peak_flops.cpp: 1,043 vs
// 518 and 240 vs 484 GFLOP/s on two cores), where the widening FMA kernel is the faster
// one (there, bench/kernels.py bf16: decode 183-193 vs 220-230 us, a 64-row prefill 69
// vs 90). Which one bf16 runs is measured once per process: 16 independent chains of
// each instruction on one core for ~1 ms each; vdpbf16ps must win by 10 %.
#define FLOTILLA_CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) \
  OP(10) OP(11) OP(12) OP(13) OP(14) OP(15)
template <bool DOT>
double chains_gflops() {
  constexpr long kIters = 50000;
  const __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(1e-7f);
  const __m512bh ha = as_bh(_mm512_set1_epi16(0x3F80)), hb = as_bh(_mm512_set1_epi16(0x0001));
#define FLOTILLA_INIT(i) __m512 x##i = _mm512_set1_ps(float(i));
  FLOTILLA_CHAINS(FLOTILLA_INIT)
  const auto start = std::chrono::steady_clock::now();
  for (long it = 0; it < kIters; ++it) {
#define FLOTILLA_STEP(i)                                                   \
    x##i = DOT ? _mm512_dpbf16_ps(x##i, ha, hb) : _mm512_fmadd_ps(x##i, a, b); \
    asm volatile("" : "+v"(x##i));  // opaque to the optimizer, kept in a register
    FLOTILLA_CHAINS(FLOTILLA_STEP)
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sink = 0;
#define FLOTILLA_SUM(i) sink += _mm512_reduce_add_ps(x##i);
  FLOTILLA_CHAINS(FLOTILLA_SUM)
  asm volatile("" : : "r"(sink));
  return (DOT ? 64.0 : 32.0) * 16 * kIters / s / 1e9;
}
#undef FLOTILLA_SUM
#undef FLOTILLA_STEP
#undef FLOTILLA_INIT
#undef FLOTILLA_CHAINS

std::atomic<int> g_bf16_kernel{-1};  // -1: not chosen yet; 0: widening FMA; 1: vdpbf16ps

bool use_dpbf16() {
  int k = g_bf16_kernel.load(std::memory_order_relaxed);
  if (k < 0) {
    double dot = 0, fma = 0;
    for (int round = 0; round < 3; ++round)  // the best of three: a busy core only slows it
      dot = std::max(dot, chains_gflops<true>()), fma = std::max(fma, chains_gflops<false>());
    k = dot > 1.1 * fma ? 1 : 0;
    g_bf16_kernel.store(k);
  }
  return k == 1;
}
#else
#define FLOTILLA_DPBF16 0
#endif

#if FLOTILLA_AMX
// ---- prefill chunks on AMX tiles ------------------------------------------------------
// A prefill chunk's rows all read the same keys and values, so they are tile products:
// per item (16 consecutive rows of one sequence's chunk, one kv head) the scores of each
// of the G query heads are S = Q K^T in tiles of 16 rows x 16 keys, an exact float32
// softmax per row over its visible keys, then O = P V in tiles of 16 rows x 16 channels.
// The per-row kernels above spend ~130 vector instructions per row, key block and head
// on what this does in four tile products (a chunk's rows ran at ~140 GFLOP/s of
// float32 FMA on the AMX Xeon measured; docs/benchmarks.md has the figures).
// Layouts: a key block [D][16] becomes B tiles of 16 channel pairs x 16 keys (rows 2p and
// 2p + 1 interleaved by one vpermw), two value blocks become B tiles of 16 key pairs x 16
// channels (vpermt2w), both in a per-thread scratch that consecutive items of the same
// sequence and head extend rather than rebuild. Probabilities go to bf16 as a head and a
// remainder (p = hi + lo), two products each, keeping float32-class accuracy like the
// vdpbf16ps kernel. Keys past a row's length are masked out of its softmax; value rows
// past the item's context are zeros in the scratch (0 x NaN garbage would be NaN).
constexpr int64_t kAmxMinRows = 8;  // chunks of fewer rows stay on the per-row kernels

std::atomic<int> g_prefill_amx{-1};  // -1: not resolved; 0: per-row kernels; 1: AMX

bool prefill_amx() {
  int v = g_prefill_amx.load(std::memory_order_relaxed);
  if (v < 0) {
    v = flotilla::amx::granted() ? 1 : 0;
    g_prefill_amx.store(v);
  }
  return v == 1;
}

// Rows [r0, r0 + rows) of sequence `seq`'s chunk at kv head h; len: the last row's
// context (the item's widest).
struct AmxItem {
  int64_t seq, h, r0, rows, len;
};

// A thread's buffers, kept between calls (no page faults inside a step once warm).
struct AmxScratch {
  std::vector<uint16_t> q, kp, vp, p_hi, p_lo;
  std::vector<float> s;
  int64_t seq = -1, h = -1, keys = 0;  // what kp and vp hold: this sequence, head, keys
};

template <int64_t D, int64_t G>
void amx_item(const Problem<c10::BFloat16>& p, const AmxItem& it, AmxScratch& sc) {
  constexpr int64_t BS = 16, KT = D * BS;  // a key block's packed elements
  const int64_t nblocks = (it.len + BS - 1) / BS, npairs = (nblocks + 1) / 2, padded = npairs * 32;
  const int64_t* table = p.tables + it.seq * p.max_blocks;
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(p.k) + it.h * p.k_hs;
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(p.v) + it.h * p.v_hs;
  const PairPerms& perms = pair_perms();
  const __m512i key_perm = perms.key, val_lo = perms.val_lo, val_hi = perms.val_hi;

  // the queries, 16 rows x G heads (rows past the chunk zero)
  sc.q.resize(16 * G * D);
  for (int64_t m = 0; m < 16; ++m) {
    uint16_t* dst = sc.q.data() + m * G * D;
    if (m < it.rows)
      std::memcpy(dst, reinterpret_cast<const uint16_t*>(p.q) + (it.r0 + m) * p.q_row + it.h * G * D,
                  G * D * 2);
    else
      std::memset(dst, 0, G * D * 2);
  }
  // keys and values, packed from where the scratch's copy of this sequence and head ends
  const bool extend = sc.seq == it.seq && sc.h == it.h && sc.keys <= it.len;
  const int64_t from = extend ? sc.keys : 0;
  sc.kp.resize(2 * npairs * KT);  // whole pairs: a pass may read a block past the context
  sc.vp.resize(npairs * 32 * D);
  for (int64_t b = from / BS; b < nblocks; ++b) {
    const uint16_t* kb = kp + table[b] * p.k_bs;
    uint16_t* dst = sc.kp.data() + b * KT;
    for (int64_t i = 0; i < D; i += 2)
      _mm512_storeu_si512(dst + i * 16, _mm512_permutexvar_epi16(key_perm, _mm512_loadu_si512(kb + i * 16)));
  }
  for (int64_t pair = from / 32; pair < npairs; ++pair) {
    uint16_t* dst = sc.vp.data() + pair * 32 * D;  // column tile e at dst + e * 512
    for (int64_t t = 0; t < 16; ++t) {
      const int64_t key = pair * 32 + 2 * t;
      if (key >= it.len) {
        for (int64_t e = 0; e < D / 16; ++e) std::memset(dst + e * 512 + t * 32, 0, 64);
        continue;
      }
      const uint16_t* row = vp + table[key / BS] * p.v_bs + (key % BS) * D;
      const __mmask32 second = key + 1 < it.len ? __mmask32(0xFFFFFFFFu) : __mmask32(0);
      for (int64_t c = 0; c < D / 32; ++c) {
        const __m512i r0 = _mm512_loadu_si512(row + c * 32);
        const __m512i r1 = _mm512_maskz_loadu_epi16(second, row + D + c * 32);
        _mm512_storeu_si512(dst + 2 * c * 512 + t * 32, _mm512_permutex2var_epi16(r0, val_lo, r1));
        _mm512_storeu_si512(dst + (2 * c + 1) * 512 + t * 32, _mm512_permutex2var_epi16(r0, val_hi, r1));
      }
    }
  }
  sc.seq = it.seq, sc.h = it.h, sc.keys = it.len;

  sc.s.resize(16 * padded);
  sc.p_hi.resize(16 * padded);
  sc.p_lo.resize(16 * padded);
  float* s = sc.s.data();
  uint16_t* phi = sc.p_hi.data();
  uint16_t* plo = sc.p_lo.data();
  const uint16_t* kt = sc.kp.data();
  const uint16_t* vt = sc.vp.data();
  const long qstride = G * D * 2, sstride = padded * 4, pstride = padded * 2;
  const __m512 scale = _mm512_set1_ps(p.scale);
  alignas(64) float o[16 * D];
  float inv[16];
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* qg = sc.q.data() + g * D;
    // S = Q K^T into s, two or four key blocks a pass (tiles 0-1 or 0-3)
    if constexpr (D == 64) {  // Q in tiles 4 and 5, keys in 6 and 7
      _tile_loadd(4, qg, qstride);
      _tile_loadd(5, qg + 32, qstride);
      int64_t pair = 0;
      for (; pair + 1 < npairs; pair += 2) {  // four key blocks a pass: four chains in flight
        const uint16_t* k0 = kt + 2 * pair * KT;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
#define FLOTILLA_AMX_KEYS(C, Q)                  \
  _tile_loadd(6, k0 + C * 512, 64);              \
  _tile_dpbf16ps(0, Q, 6);                       \
  _tile_loadd(7, k0 + KT + C * 512, 64);         \
  _tile_dpbf16ps(1, Q, 7);                       \
  _tile_loadd(6, k0 + 2 * KT + C * 512, 64);     \
  _tile_dpbf16ps(2, Q, 6);                       \
  _tile_loadd(7, k0 + 3 * KT + C * 512, 64);     \
  _tile_dpbf16ps(3, Q, 7);
        FLOTILLA_AMX_KEYS(0, 4)
        FLOTILLA_AMX_KEYS(1, 5)
#undef FLOTILLA_AMX_KEYS
        _tile_stored(0, s + pair * 32, sstride);
        _tile_stored(1, s + pair * 32 + 16, sstride);
        _tile_stored(2, s + pair * 32 + 32, sstride);
        _tile_stored(3, s + pair * 32 + 48, sstride);
      }
      if (pair < npairs) {
        const uint16_t* k0 = kt + 2 * pair * KT;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, k0, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, k0 + KT, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, k0 + 512, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_loadd(7, k0 + KT + 512, 64);
        _tile_dpbf16ps(1, 5, 7);
        _tile_stored(0, s + pair * 32, sstride);
        _tile_stored(1, s + pair * 32 + 16, sstride);
      }
    } else {
      static_assert(D == 128, "the AMX prefill kernel takes head sizes 64 and 128");
      _tile_loadd(2, qg, qstride);
      _tile_loadd(3, qg + 32, qstride);
      _tile_loadd(4, qg + 64, qstride);
      _tile_loadd(5, qg + 96, qstride);
      for (int64_t pair = 0; pair < npairs; ++pair) {
        const uint16_t* k0 = kt + 2 * pair * KT;
        const uint16_t* k1 = k0 + KT;
        _tile_zero(0);
        _tile_zero(1);
#define FLOTILLA_AMX_KEYS(C, Q)          \
  _tile_loadd(6, k0 + C * 512, 64);      \
  _tile_loadd(7, k1 + C * 512, 64);      \
  _tile_dpbf16ps(0, Q, 6);               \
  _tile_dpbf16ps(1, Q, 7);
        FLOTILLA_AMX_KEYS(0, 2)
        FLOTILLA_AMX_KEYS(1, 3)
        FLOTILLA_AMX_KEYS(2, 4)
        FLOTILLA_AMX_KEYS(3, 5)
#undef FLOTILLA_AMX_KEYS
        _tile_stored(0, s + pair * 32, sstride);
        _tile_stored(1, s + pair * 32 + 16, sstride);
      }
    }
    // softmax of each row over its own keys; probabilities as bf16 head + remainder
    for (int64_t m = 0; m < 16; ++m) {
      const int64_t len = m < it.rows ? p.row_len[it.r0 + m] : it.len;
      const float* sr = s + m * padded;
      __m512 mx = _mm512_set1_ps(-FLT_MAX);
      for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 live = t + 16 <= len ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(sr + t));
      }
      const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * p.scale);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < padded; t += 32) {
        __m512 e[2];
        for (int64_t u = 0; u < 2; ++u) {
          const int64_t at = t + 16 * u;
          const __mmask16 live = at + 16 <= len ? __mmask16(0xFFFF)
                                 : at < len ? __mmask16((1u << (len - at)) - 1) : __mmask16(0);
          e[u] = live ? _mm512_maskz_mov_ps(live, flotilla::exp16(_mm512_fmsub_ps(
                            _mm512_loadu_ps(sr + at), scale, shift)))
                      : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, e[u]);
        }
        // hi: e truncated to bf16 (exact in bf16), lo: the exact remainder rounded
        const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
        const __m512 h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e[0]), top));
        const __m512 h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(e[1]), top));
        const __m512bh hi = _mm512_cvtne2ps_pbh(h1, h0);
        const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(e[1], h1), _mm512_sub_ps(e[0], h0));
        _mm512_storeu_si512(phi + m * padded + t, reinterpret_cast<__m512i>(hi));
        _mm512_storeu_si512(plo + m * padded + t, reinterpret_cast<__m512i>(lo));
      }
      inv[m] = 1.f / _mm512_reduce_add_ps(sum);
    }
    // O = P V, 16 rows x 64 channels a pass (tiles 0-3), P's head in tile 4, remainder in 5
    for (int64_t half = 0; half < D / 64; ++half) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t pair = 0; pair < npairs; ++pair) {
        const uint16_t* v = vt + pair * 32 * D + half * 4 * 512;
        _tile_loadd(4, phi + pair * 32, pstride);
        _tile_loadd(5, plo + pair * 32, pstride);
#define FLOTILLA_AMX_VALUES(E, VT)         \
  _tile_loadd(VT, v + E * 512, 64);        \
  _tile_dpbf16ps(E, 4, VT);                \
  _tile_dpbf16ps(E, 5, VT);
        FLOTILLA_AMX_VALUES(0, 6)
        FLOTILLA_AMX_VALUES(1, 7)
        FLOTILLA_AMX_VALUES(2, 6)
        FLOTILLA_AMX_VALUES(3, 7)
#undef FLOTILLA_AMX_VALUES
      }
      float* oh = o + half * 64;
      _tile_stored(0, oh, D * 4);
      _tile_stored(1, oh + 16, D * 4);
      _tile_stored(2, oh + 32, D * 4);
      _tile_stored(3, oh + 48, D * 4);
    }
    for (int64_t m = 0; m < it.rows; ++m) {
      c10::BFloat16* out = p.out + ((it.r0 + m) * p.heads + it.h * G + g) * D;
      const __m512 f = _mm512_set1_ps(inv[m]);
      for (int64_t c = 0; c < D; c += 16)
        flotilla::store16(out + c, _mm512_mul_ps(_mm512_load_ps(o + m * D + c), f));
    }
  }
}

// The items split over the threads by their context lengths (a chunk's later rows see
// more keys; equal counts of items left one thread waiting on the other).
template <int64_t D, int64_t G>
void run_amx_prefill(const Problem<c10::BFloat16>& p, const std::vector<AmxItem>& items) {
  std::vector<int64_t> ends(items.size());
  int64_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) ends[i] = total += items[i].len + 32;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    flotilla::amx::Tiles tiles_in_use;
    thread_local AmxScratch scratch;
    scratch.seq = -1;  // the cache may have changed since the last call
    for (int64_t t = begin; t < end; ++t) {
      // item i goes to the thread whose share holds the middle of its cost
      for (size_t i = 0; i < items.size(); ++i) {
        const int64_t mid = 2 * ends[i] - (items[i].len + 32);  // 2 x the item's middle
        if (mid * threads >= 2 * t * total && mid * threads < 2 * (t + 1) * total)
          amx_item<D, G>(p, items[i], scratch);
      }
    }
  });
}
#endif

// The specialised kernels for block size 16, head size 64 or 128 and up to 8 query heads
// per kv head; false where none applies.
template <typename T, int64_t D, int64_t G>
bool run_specialised(const Problem<T>& p) {
#if FLOTILLA_DPBF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (use_dpbf16()) {
      run_dpbf16<D, G>(p);
      return true;
    }
  }
#endif
  if constexpr (!std::is_same_v<T, c10::Half>) {
#if FLOTILLA_AVX512 && !defined(FLOTILLA_VEC_ATTENTION)
    run_fma<T, D, G>(p);
#else
    run_vec<T, D, G>(p);
#endif
    return true;
  }
  return false;
}

template <typename T, int64_t D>
bool dispatch_group(const Problem<T>& p) {
  switch (p.group) {
    case 1: return run_specialised<T, D, 1>(p);
    case 2: return run_specialised<T, D, 2>(p);
    case 3: return run_specialised<T, D, 3>(p);
    case 4: return run_specialised<T, D, 4>(p);
    case 5: return run_specialised<T, D, 5>(p);
    case 6: return run_specialised<T, D, 6>(p);
    case 7: return run_specialised<T, D, 7>(p);
    case 8: return run_specialised<T, D, 8>(p);
    default: return false;
  }
}

#if FLOTILLA_AMX
template <int64_t D>
void amx_group(const Problem<c10::BFloat16>& p, const std::vector<AmxItem>& items) {
  switch (p.group) {
    case 1: return run_amx_prefill<D, 1>(p, items);
    case 2: return run_amx_prefill<D, 2>(p, items);
    case 3: return run_amx_prefill<D, 3>(p, items);
    case 4: return run_amx_prefill<D, 4>(p, items);
    case 5: return run_amx_prefill<D, 5>(p, items);
    case 6: return run_amx_prefill<D, 6>(p, items);
    case 7: return run_amx_prefill<D, 7>(p, items);
    default: return run_amx_prefill<D, 8>(p, items);
  }
}
#endif

// Where the AMX kernel runs (bf16, block size 16, head size 64 or 128, up to 8 query
// heads per kv head): it attends every prefill chunk of kAmxMinRows rows or more, and the
// per-row kernels are left the other rows (decodes, short chunks).
template <typename T>
void run_prefill_chunks(Problem<T>& p) {
#if FLOTILLA_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // not with a window: the tile kernel's rows share one key range
    if (p.bs != 16 || (p.d != 64 && p.d != 128) || p.group > 8 || p.window > 0 ||
        p.sinks != nullptr || !prefill_amx())
      return;
    std::vector<AmxItem> items;  // ordered by sequence, head, rows: a thread's run extends its scratch
    std::vector<char> taken(p.row_seq.size(), 0);
    for (size_t s = 0; s + 1 < p.seq_start.size(); ++s) {
      const int64_t r0 = p.seq_start[s], n = p.seq_start[s + 1] - r0;
      if (n < kAmxMinRows) continue;
      for (int64_t h = 0; h < p.kv_heads; ++h)
        for (int64_t j = 0; j < n; j += 16) {
          const int64_t rows = std::min<int64_t>(16, n - j);
          items.push_back({int64_t(s), h, r0 + j, rows, p.row_len[r0 + j + rows - 1]});
        }
      std::fill(taken.begin() + r0, taken.begin() + r0 + n, 1);
    }
    if (items.empty()) return;
    if (p.d == 64) amx_group<64>(p, items);
    else amx_group<128>(p, items);
    p.row_ids.clear();
    for (size_t r = 0; r < taken.size(); ++r)
      if (!taken[r]) p.row_ids.push_back(int64_t(r));
  }
#else
  (void)p;
#endif
}

// An fp8 cache at block size 16, head size 64 or 128 and up to 8 query heads per kv head:
// the FMA kernel, widening 16 bytes at once (AVX-512); false elsewhere (run_generic).
template <typename T, int64_t D>
bool dispatch_fp8_group(const Problem<T, E4M3>& p) {
#if FLOTILLA_AVX512 && !defined(FLOTILLA_VEC_ATTENTION)
  switch (p.group) {
    case 1: run_fma<T, D, 1>(p); return true;
    case 2: run_fma<T, D, 2>(p); return true;
    case 3: run_fma<T, D, 3>(p); return true;
    case 4: run_fma<T, D, 4>(p); return true;
    case 5: run_fma<T, D, 5>(p); return true;
    case 6: run_fma<T, D, 6>(p); return true;
    case 7: run_fma<T, D, 7>(p); return true;
    case 8: run_fma<T, D, 8>(p); return true;
    default: return false;
  }
#else
  (void)p;
  return false;
#endif
}

template <typename T>
bool dispatch_fp8(const Problem<T, E4M3>& p) {
  if constexpr (std::is_same_v<T, c10::Half>) {  // as run_specialised: no fp16 FMA kernel
    return false;
  } else {
    if (p.bs == 16 && p.d == 64) return dispatch_fp8_group<T, 64>(p);
    if (p.bs == 16 && p.d == 128) return dispatch_fp8_group<T, 128>(p);
    return false;
  }
}

template <typename T>
void dispatch(const Problem<T>& p) {
  if (p.bs == 16 && p.d == 64 && dispatch_group<T, 64>(p)) return;
  if (p.bs == 16 && p.d == 128 && dispatch_group<T, 128>(p)) return;
  if (p.bs == 16 && p.d == 64) return run_generic<T, 16, 64>(p);
  if (p.bs == 16 && p.d == 128) return run_generic<T, 16, 128>(p);
  run_generic<T, 0, 0>(p);
}

}  // namespace

// The kernel bf16 attention runs on this build and CPU: "dpbf16" (vdpbf16ps), "fma"
// (float32 FMA on widened keys and values) or "vec" (vec.h, builds without AVX-512).
std::string attention_bf16_kernel() {
#if FLOTILLA_DPBF16
  if (use_dpbf16()) return "dpbf16";
#endif
#if FLOTILLA_AVX512 && !defined(FLOTILLA_VEC_ATTENTION)
  return "fma";
#else
  return "vec";
#endif
}

// Overrides the measured choice (tests and benchmarks run both kernels); false where the
// build has no vdpbf16ps kernel.
bool set_attention_bf16_kernel(const std::string& name) {
  TORCH_CHECK(name == "dpbf16" || name == "fma", "bf16 attention kernel: dpbf16 or fma");
#if FLOTILLA_DPBF16
  g_bf16_kernel.store(name == "dpbf16" ? 1 : 0);
  return true;
#else
  return false;
#endif
}

// How bf16 prefill chunks are attended here: "amx" (tile products, where the build has
// AMX and Linux grants the tile state) or "rows" (the per-row kernels, as decodes).
std::string attention_prefill_kernel() {
#if FLOTILLA_AMX
  if (prefill_amx()) return "amx";
#endif
  return "rows";
}

// Forces one (tests and benchmarks run both); false where the build or CPU cannot run it.
bool set_attention_prefill_kernel(const std::string& name) {
  TORCH_CHECK(name == "amx" || name == "rows", "prefill attention kernel: amx or rows");
#if FLOTILLA_AMX
  if (name == "rows" || flotilla::amx::granted()) {
    g_prefill_amx.store(name == "amx" ? 1 : 0);
    return true;
  }
  return false;
#else
  return name == "rows";
#endif
}

// Writes this step's keys and values into the cache, then attends every query row.
// q: [T, H, D], k, v: [T, KVH, D] (heads contiguous within a row; rows may be strided
// views into the fused qkv); k_cache [KVH, num_blocks, D, bs]; v_cache [KVH, num_blocks,
// bs, D]; slots [T] int64: the cache slot (block * bs + offset) of each row's token;
// block_tables [S, max_blocks] int64; seq_lens [S] int64: each sequence's context after
// this step, its new tokens included; query_start [S + 1] int64: sequence s owns rows
// query_start[s] .. query_start[s + 1], its last tokens; window: a sliding window's width
// (0: none); sinks: attention sinks [H] (gpt-oss), or None. Returns [T, H, D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                              torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, double scale, double k_scale,
                              double v_scale, int64_t window,
                              c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, D]");
  for (const auto* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2) && x->size(0) == q.size(0),
                "paged_attention needs the heads of a q/k/v row contiguous, one row per token");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
              v_cache.dim() == 4 && v_cache.stride(3) == 1 && v_cache.stride(2) == v_cache.size(3),
              "paged_attention needs each cache block contiguous (heads and blocks may be strided)");
  TORCH_CHECK(k.size(1) == k_cache.size(0) && v.size(1) == k_cache.size(0) &&
              q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv heads");
  for (const auto* x : {&k, &v})
    TORCH_CHECK(x->scalar_type() == q.scalar_type(), "q, k and v must share a dtype");
  const bool fp8 = k_cache.scalar_type() == c10::ScalarType::Float8_e4m3fn;
  for (const auto* x : {&k_cache, &v_cache})
    TORCH_CHECK(x->scalar_type() == (fp8 ? c10::ScalarType::Float8_e4m3fn : q.scalar_type()),
                "the caches must be q's dtype or both float8_e4m3fn");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "k_scale and v_scale are an fp8 "
              "cache's");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "k_scale and v_scale must be > 0");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  torch::Tensor sinks_;
  if (sinks.has_value()) {
    sinks_ = sinks->to(torch::kFloat).contiguous();
    TORCH_CHECK(sinks_.dim() == 1 && sinks_.size(0) == q.size(1), "sinks must be [heads]");
  }
  auto slots_ = slots.to(torch::kLong).contiguous();
  TORCH_CHECK(slots_.size(0) == q.size(0), "one cache slot per row");
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto starts = query_start.to(torch::kLong).contiguous();
  auto out = torch::empty(q.sizes(), q.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (fp8) {
      Problem<T, E4M3> p(q, k, v, k_cache, v_cache, slots_, tables, lens, starts, out, scale,
                         window);
      p.k_scale = float(k_scale), p.v_scale = float(v_scale);
      if (sinks_.defined()) p.sinks = sinks_.data_ptr<float>();
      store_prefill_tokens(p);
      if (dispatch_fp8(p)) return;
      if (p.bs == 16 && p.d == 64) return run_generic<T, 16, 64>(p);
      if (p.bs == 16 && p.d == 128) return run_generic<T, 16, 128>(p);
      return run_generic<T, 0, 0>(p);
    }
    Problem<T> p(q, k, v, k_cache, v_cache, slots_, tables, lens, starts, out, scale, window);
    if (sinks_.defined()) p.sinks = sinks_.data_ptr<float>();
    store_prefill_tokens(p);
    run_prefill_chunks(p);
    dispatch(p);
  };
  if (q.scalar_type() == torch::kBFloat16) {
    run(c10::BFloat16());
  } else if (q.scalar_type() == torch::kHalf) {
    run(c10::Half());
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "unsupported dtype");
    run(float());
  }
  return out;
}
