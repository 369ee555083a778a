// FP8 weight linears (e4m3, vLLM's `fp8` checkpoints and compressed-tensors' FP8 schemes):
// y = (x . w8) * s_w[column] (+ b), the weight's bytes widened to float in registers and
// multiplied with x as it is (bf16 or float32). x is not rounded to fp8: on CPU the cost
// is the weight read, and one byte a weight is half of bf16's.
//
// The widening is exact: an e4m3 byte with its sign moved to bit 15 and its 7 other bits
// to bits 13..7 is an IEEE half whose value is the e4m3 value / 2^8, subnormals included
// (both formats' subnormals are linear), so vcvtph2ps widens 16 at once; 2^8 is folded
// into the column scale.
//
// Layout (fp8_pack): the columns in vectors of 16, each vector contiguous over K as
// [K][16] bytes, one 128-bit load a k. Columns past N are zero.
//
// Block-wise scales (DeepSeek's and Qwen's weight_block_size, e.g. 128 x 128): a scale
// per (16-column vector, run of block_k along K), given as block_scales [vectors, K
// runs]; the widened weight vector is multiplied by its run's scale before the FMAs
// (hoisted per run, one multiply a vector and k), and the per-column scale is then 1.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "convert.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FLOTILLA_F8_AVX512 1
#else
#define FLOTILLA_F8_AVX512 0
#endif

namespace {

constexpr int64_t kC = 16;        // columns of a vector
constexpr int kNR = 3;            // vectors a work item multiplies
constexpr int kMR = 8;            // rows a tile holds (8 x 3 float sums in registers)


// Where a tile's float sums go: row r, column c0.. of the item, times the column scale.
struct Out {
  void* y;
  bool bf16_out, float_out_rounded;
  int64_t ldy, ncols;
  const float* sw;    // per column
  float widened;      // what the sums' weights were divided by (AVX-512: 2^8)
  const float* bias;  // per column or null

  void emit(int64_t r, int64_t c0, const float* acc) const {
    const int64_t lanes = std::min<int64_t>(kC, ncols - c0);
    for (int64_t l = 0; l < lanes; ++l) {
      const int64_t c = c0 + l;
      // an explicit fma: left to contraction, the bf16 and float outputs' loops were
      // compiled differently and a float_out call rounded 1 in 44,000 sums another way
      const float scale = sw[c] * widened;
      const float v = bias ? std::fma(acc[l], scale, bias[c]) : acc[l] * scale;
      if (bf16_out) {
        static_cast<c10::BFloat16*>(y)[r * ldy + c] = c10::BFloat16(v);
      } else {
        static_cast<float*>(y)[r * ldy + c] = float_out_rounded ? float(c10::BFloat16(v)) : v;
      }
    }
  }
};

// The block-wise scales of a work item's vectors: s[j * runs + k / block_k] is vector j's
// scale over k's run (s null: none, the whole of K is one run).
struct KScales {
  const float* s;
  int64_t runs, block_k;

  int64_t run_end(int64_t k0, int64_t k) const {
    return s ? std::min(k, (k0 / block_k + 1) * block_k) : k;
  }
  float at(int j, int64_t k0) const { return s ? s[j * runs + k0 / block_k] : 1.f; }
};

// ---- plain loops (any CPU) ------------------------------------------------------------
void plain_item(const float* x, int64_t ldx, int64_t rows, const uint8_t* w, int64_t k,
                int vectors, const Out& out, const KScales& ks) {
  for (int j = 0; j < vectors; ++j) {
    const uint8_t* b = w + j * k * kC;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * ldx;
      float acc[kC] = {};
      for (int64_t k0 = 0; k0 < k;) {
        const int64_t k1 = ks.run_end(k0, k);
        const float scale = ks.at(j, k0);
        for (int64_t i = k0; i < k1; ++i)
          for (int64_t c = 0; c < kC; ++c)
            acc[c] += xr[i] * (flotilla::e4m3_to_float(b[i * kC + c]) * scale);
        k0 = k1;
      }
      out.emit(r, j * kC, acc);
    }
  }
}

#if FLOTILLA_F8_AVX512
// ---- AVX-512 ------------------------------------------------------------------------------
using flotilla::widen_e4m3;

template <int R, int W, bool SCALED>
void avx512_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t k, const Out& out,
                 int64_t r0, int64_t c0, const KScales& ks) {
  // one row (a sequence's decode): two sums a vector, even and odd k, so the adds of
  // successive k do not wait on each other
  constexpr int P = R == 1 ? 2 : 1;
  __m512 acc[P][R][W];
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < W; ++j) acc[p][i][j] = _mm512_setzero_ps();
  // block scales: sc[j] is vector j's over the run that holds k index `s`; reloaded where
  // the next run starts (one loop over K as unscaled: a loop per run kept GCC from
  // unrolling the tile into registers, 2.3x slower)
  __m512 sc[W];
  int64_t next_run = 0;
  auto enter_run = [&](int64_t at) {
    if constexpr (SCALED) {
      if (at == next_run) {
        for (int j = 0; j < W; ++j) sc[j] = _mm512_set1_ps(ks.at(j, at));
        next_run = ks.run_end(at, k);
      }
    }
  };
  int64_t s = 0;
  for (; s + P <= k; s += P) {
    // one row: 64 k ahead in each vector's stream (the hardware prefetcher alone left a
    // sequence's decode at ~11 GB/s a thread on Zen 4, out of cache; 12.8 with this). Not
    // in the 8-row tiles: there it made GCC spill the 24 sums, 2x slower
    if constexpr (R == 1)
      for (int j = 0; j < W; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j * k + s) * kC + 64 * kC), _MM_HINT_T0);
    for (int p = 0; p < P; ++p) {
      enter_run(s + p);
      __m512 b[W];
      for (int j = 0; j < W; ++j) {
        b[j] = widen_e4m3(w + (j * k + s + p) * kC);
        if constexpr (SCALED) b[j] = _mm512_mul_ps(b[j], sc[j]);
      }
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(x[i * ldx + s + p]);
        for (int j = 0; j < W; ++j) acc[p][i][j] = _mm512_fmadd_ps(a, b[j], acc[p][i][j]);
      }
    }
  }
  for (; s < k; ++s) {
    enter_run(s);
    for (int j = 0; j < W; ++j) {
      __m512 b = widen_e4m3(w + (j * k + s) * kC);
      if constexpr (SCALED) b = _mm512_mul_ps(b, sc[j]);
      for (int i = 0; i < R; ++i)
        acc[0][i][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + s]), b, acc[0][i][j]);
    }
  }
  alignas(64) float sums[kC];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < W; ++j) {
      __m512 v = acc[0][i][j];
      if constexpr (P > 1) v = _mm512_add_ps(v, acc[1][i][j]);
      _mm512_store_ps(sums, v);
      out.emit(r0 + i, c0 + j * kC, sums);
    }
}

template <int W, bool SCALED, int R = kMR>
void avx512_rows(const float* x, int64_t ldx, int64_t rows, const uint8_t* w, int64_t k,
                 const Out& out, int64_t r0, const KScales& ks) {
  if constexpr (R > 0) {
    while (rows >= R) {
      avx512_tile<R, W, SCALED>(x, ldx, w, k, out, r0, 0, ks);
      x += R * ldx, rows -= R, r0 += R;
    }
    if (rows > 0) avx512_rows<W, SCALED, R - 1>(x, ldx, rows, w, k, out, r0, ks);
  }
}

template <bool SCALED>
void avx512_vectors(const float* x, int64_t ldx, int64_t rows, const uint8_t* w, int64_t k,
                    int vectors, const Out& out, const KScales& ks) {
  if (vectors == 3) return avx512_rows<3, SCALED>(x, ldx, rows, w, k, out, 0, ks);
  if (vectors == 2) return avx512_rows<2, SCALED>(x, ldx, rows, w, k, out, 0, ks);
  avx512_rows<1, SCALED>(x, ldx, rows, w, k, out, 0, ks);
}

void avx512_item(const float* x, int64_t ldx, int64_t rows, const uint8_t* w, int64_t k,
                 int vectors, const Out& out, const KScales& ks) {
  if (ks.s) return avx512_vectors<true>(x, ldx, rows, w, k, vectors, out, ks);
  avx512_vectors<false>(x, ldx, rows, w, k, vectors, out, ks);
}
#endif

// set_fp8_kernel("plain"): the table loops even where AVX-512 runs
std::atomic<bool> g_plain{false};
// Rows of x past which a product decodes the weight (w x scale in x's dtype) and
// multiplies it with at::matmul (oneDNN: bf16 dot products, where the kernel above pays
// float32 FMAs and widens again for every 8 rows). Measured on Zen 4, a layer's four
// linears of the default model: 64 rows 2.7-2.9 ms either way, 128 rows 3.9-4.0 ms
// decoded against 5.4 (bf16: 2.2); 16-32 rows the FMA tiles win 2x. set_fp8_dense_rows.
std::atomic<int64_t> g_dense_rows{96};
// Columns a decoded panel holds: its buffer is k x 1024 in x's dtype (8 MiB at k 4096 in
// bf16), not the whole weight's k x n (235 MB for an 8B model's gate/up in bf16).
constexpr int64_t kPanelVectors = 64;

// Columns [v0 * 16, v1 * 16) of the weight (n columns) times their scales, as panel
// [k, ld] in T; AVX-512: 16 at once (a scalar loop made the decode cost more than the
// matmul at 64 rows).
template <typename T>
void decode_panel(const uint8_t* packed, int64_t k, int64_t n, int64_t v0, int64_t v1,
                  const float* sw, const KScales& ks, T* panel, int64_t ld, bool simd) {
  at::parallel_for(0, k, 64, [&](int64_t k0, int64_t k1) {
    for (int64_t v = v0; v < v1; ++v) {
      const uint8_t* src = packed + v * k * kC;
      T* dst = panel + (v - v0) * kC;
#if FLOTILLA_F8_AVX512
      if (simd) {
        const int64_t lanes = std::min<int64_t>(kC, n - v * kC);
        const __m512 col = _mm512_mul_ps(
            _mm512_maskz_loadu_ps(__mmask16((1u << lanes) - 1), sw + v * kC),
            _mm512_set1_ps(flotilla::kE4M3Widened));  // zero past the last column
        for (int64_t i = k0; i < k1; ++i) {
          const __m512 scale =
              ks.s ? _mm512_mul_ps(col, _mm512_set1_ps(ks.s[v * ks.runs + i / ks.block_k])) : col;
          flotilla::store16(dst + i * ld, _mm512_mul_ps(widen_e4m3(src + i * kC), scale));
        }
        continue;
      }
#endif
      for (int64_t i = k0; i < k1; ++i) {
        const float block = ks.s ? ks.s[v * ks.runs + i / ks.block_k] : 1.f;
        for (int64_t c = 0; c < kC; ++c) {
          const float scale = v * kC + c < n ? sw[v * kC + c] * block : 0.f;
          dst[i * ld + c] = T(flotilla::e4m3_to_float(src[i * kC + c]) * scale);
        }
      }
    }
  });
}

// The weight decoded a panel of kPanelVectors vectors at a time, a matmul each (panels of
// 256 columns measured within noise of one whole-weight matmul, 1024 bound the buffer).
torch::Tensor dense_product(const torch::Tensor& x, const uint8_t* packed, int64_t n,
                            const float* sw, const KScales& ks, bool simd) {
  const int64_t m = x.size(0), k = x.size(1), vectors = (n + kC - 1) / kC;
  const int64_t width = std::min(vectors, kPanelVectors) * kC;
  torch::Tensor panel = torch::empty({k, width}, x.options());
  auto product = [&](int64_t v0, int64_t v1) {  // vectors [v0, v1) decoded and multiplied
    if (x.scalar_type() == torch::kFloat32) {
      decode_panel(packed, k, n, v0, v1, sw, ks, panel.data_ptr<float>(), width, simd);
    } else {
      decode_panel(packed, k, n, v0, v1, sw, ks, panel.data_ptr<c10::BFloat16>(), width, simd);
    }
    return at::matmul(x, panel.narrow(1, 0, std::min(n, v1 * kC) - v0 * kC));
  };
  if (vectors <= kPanelVectors) return product(0, vectors);  // one panel: its output is y
  torch::Tensor y = torch::empty({m, n}, x.options());
  for (int64_t v0 = 0; v0 < vectors; v0 += kPanelVectors) {
    const int64_t v1 = std::min(vectors, v0 + kPanelVectors);
    y.narrow(1, v0 * kC, std::min(n, v1 * kC) - v0 * kC).copy_(product(v0, v1));
  }
  return y;
}

}  // namespace

torch::Tensor fp8_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == torch::kUInt8 ||
                                    weight.scalar_type() == c10::ScalarType::Float8_e4m3fn),
              "fp8_pack: an e4m3 [out, in] weight (float8_e4m3fn or its uint8 bytes), got ",
              weight.scalar_type(), " of ", weight.dim(), " dims");
  const torch::Tensor w = weight.contiguous().view(torch::kUInt8);
  const int64_t n = w.size(0), k = w.size(1), vectors = (n + kC - 1) / kC;
  torch::Tensor packed = torch::zeros({vectors * k * kC}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      uint8_t* base = dst + (row / kC) * k * kC + row % kC;
      for (int64_t i = 0; i < k; ++i) base[i * kC] = src[row * k + i];
    }
  });
  return packed;
}

torch::Tensor fp8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor scales,
                         c10::optional<torch::Tensor> bias, int64_t n, bool float_out,
                         c10::optional<torch::Tensor> block_scales, int64_t block_k) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "fp8_linear: float32 or bfloat16 input, not ", dtype);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kFloat32 &&
                  scales.numel() == n,
              "fp8_linear: a weight from fp8_pack and ", n, " float32 scales");
  const int64_t k = input.size(-1), vectors = (n + kC - 1) / kC;
  TORCH_CHECK(packed.numel() == vectors * kC * k, "fp8_linear: the packed weight does not hold ",
              n, " x ", k);
  torch::Tensor ks_t;
  int64_t runs = 0;
  if (block_scales && block_scales->defined()) {
    runs = block_k > 0 ? (k + block_k - 1) / block_k : 0;
    TORCH_CHECK(block_k > 0 && block_scales->scalar_type() == torch::kFloat32 &&
                    block_scales->dim() == 2 && block_scales->size(0) == vectors &&
                    block_scales->size(1) == runs,
                "fp8_linear: block scales [", vectors, " vectors, ", runs,
                " runs of block_k] float32, block_k > 0; got block_k ", block_k, " and ",
                block_scales->sizes());
    ks_t = block_scales->contiguous();
  }
  const int64_t m = input.numel() / std::max<int64_t>(k, 1);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  if (m > g_dense_rows && n > 0) {  // compute-bound: decoded panels, oneDNN multiplies
    torch::Tensor xd = input.reshape({-1, k}).contiguous();
    const KScales ks{ks_t.defined() ? ks_t.data_ptr<float>() : nullptr, runs, block_k};
    torch::Tensor y = dense_product(xd, packed.data_ptr<uint8_t>(), n,
                                    scales.contiguous().data_ptr<float>(), ks,
                                    FLOTILLA_F8_AVX512 && !g_plain);
    if (bias && bias->defined()) {
      TORCH_CHECK(bias->numel() == n, "fp8_linear: a bias of ", bias->numel(), " for ", n,
                  " outputs");
      y.add_(bias->to(dtype));
    }
    return (float_out ? y.to(torch::kFloat32) : y).reshape(shape);
  }
  const torch::Tensor x = input.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const bool bf16 = dtype == torch::kBFloat16;
  torch::Tensor y = torch::empty({m, n}, input.options().dtype(float_out ? torch::kFloat32 : dtype));
  if (m == 0 || n == 0) return y.reshape(shape);
  torch::Tensor bias_f;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "fp8_linear: a bias of ", bias->numel(), " for ", n,
                " outputs");
    bias_f = bias->to(torch::kFloat32).contiguous();
  }
  const bool simd = FLOTILLA_F8_AVX512 && !g_plain;
  const torch::Tensor sw = scales.contiguous();
  float widened = 1.f;  // the AVX-512 sums are of value / 2^8
#if FLOTILLA_F8_AVX512
  if (simd) widened = flotilla::kE4M3Widened;
#endif
  const float* swp = sw.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  // Work items (row chunk, panel of kNR vectors), chunk-major; rows are split only when
  // there are fewer panels than threads.
  const int64_t panels = (vectors + kNR - 1) / kNR, threads = at::get_num_threads();
  int64_t chunk_rows = m;
  if (panels < threads && m > kMR) chunk_rows = std::max<int64_t>(kMR, (m + threads - 1) / threads);
  const int64_t chunks = (m + chunk_rows - 1) / chunk_rows;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, g = item % panels;
      const int64_t r0 = chunk * chunk_rows, rows = std::min(chunk_rows, m - r0);
      const int64_t c0 = g * kNR * kC;
      const int nv = int(std::min<int64_t>(kNR, vectors - g * kNR));
      Out out{static_cast<char*>(y.data_ptr()) + (r0 * n + c0) * (float_out ? 4 : y.element_size()),
              bf16 && !float_out, bf16 && float_out, n, std::min<int64_t>(nv * kC, n - c0),
              swp + c0, widened, bp ? bp + c0 : nullptr};
      const float* a = xp + r0 * k;
      const uint8_t* w = wp + c0 * k;
      const KScales ks{ks_t.defined() ? ks_t.data_ptr<float>() + (c0 / kC) * runs : nullptr,
                       runs, block_k};
#if FLOTILLA_F8_AVX512
      if (simd) {
        avx512_item(a, k, rows, w, k, nv, out, ks);
        continue;
      }
#endif
      plain_item(a, k, rows, w, k, nv, out, ks);
    }
  });
  return y.reshape(shape);
}

std::vector<std::string> fp8_kernels() {
  std::vector<std::string> names;
  if (FLOTILLA_F8_AVX512) names.push_back("avx512");
  names.push_back("plain");
  return names;
}

std::string fp8_kernel() { return FLOTILLA_F8_AVX512 && !g_plain ? "avx512" : "plain"; }

int64_t set_fp8_dense_rows(int64_t rows) { return g_dense_rows.exchange(rows); }

bool set_fp8_kernel(const std::string& name) {
  if (name == "plain") { g_plain = true; return true; }
  if (name == "avx512" && FLOTILLA_F8_AVX512) { g_plain = false; return true; }
  return false;
}
