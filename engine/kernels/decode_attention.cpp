// Paged decode attention for the CPU: one query token per sequence, keys and values
// read straight from the block-structured cache (no gather copy, no padding).
//
// Cache layout (see engine/layers/attention.py): [KVH, num_blocks, block_size, D].
// Work is split over (sequence, kv head) pairs; each pair computes the scores of its
// G = H / KVH query heads against the sequence's tokens, a softmax in float32, and the
// weighted sum of values. Inner loops run over 16 independent lanes so the compiler
// vectorizes them; -ffast-math (see engine/kernels/__init__.py) lets it vectorize exp too.
// Each key/value row is widened to float32 once and reused by all G query heads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* q, const float* k, int64_t d) {
  float acc[kLanes] = {0};
  for (int64_t i = 0; i < d; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += q[i + j] * k[i + j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline void axpy(float a, const float* v, float* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += a * v[i];
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
         double scale) {
  const int64_t num_seqs = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1);
  const int64_t bs = k_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), row_f(d), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, h = work % kv_heads;
      const int64_t len = lens[s];
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = to_float(qp[(s * heads + h * group + g) * d + i]) * float(scale);
      const T* k_head = kp + h * num_blocks * bs * d;
      const T* v_head = vp + h * num_blocks * bs * d;
      for (int64_t t = 0; t < len; ++t) {
        widen(k_head + (tables[s * max_blocks + t / bs] * bs + t % bs) * d, row_f.data(), d);
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + t] = dot(&qf[g * d], row_f.data(), d);
      }
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * len];
        float m = -FLT_MAX;
        for (int64_t t = 0; t < len; ++t) m = std::max(m, row[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - m);
          sum += row[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        widen(v_head + (tables[s * max_blocks + t / bs] * bs + t % bs) * d, row_f.data(), d);
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * len + t], row_f.data(), &acc[g * d], d);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          op[(s * heads + h * group + g) * d + i] = static_cast<T>(acc[g * d + i] * inv_sum[g]);
    }
  });
}

}  // namespace

// q: [S, H, D] contiguous; caches: [KVH, num_blocks, bs, D]; block_tables: [S, max_blocks]
// int64; seq_lens: [S] int64 (tokens of context, the query's own included). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention needs contiguous inputs");
  TORCH_CHECK(q.size(2) % kLanes == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads must be a multiple of kv heads");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    run<c10::BFloat16>(q, k_cache, v_cache, tables, lens, out, scale);
  } else if (q.scalar_type() == torch::kHalf) {
    run<c10::Half>(q, k_cache, v_cache, tables, lens, out, scale);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat, "unsupported dtype");
    run<float>(q, k_cache, v_cache, tables, lens, out, scale);
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
