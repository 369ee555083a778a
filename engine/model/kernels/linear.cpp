// The layers' linears, y = x W^T (+ b), on weights packed once at load.
//
// Why not oneDNN's packed matmul: at decode batch sizes every step reads each weight
// from memory once (W1: 212 MB of layer weights a step, far beyond any cache), and
// oneDNN's loops wait for that read instead of overlapping it with compute; at 64 rows
// their FMA pipes also sit partly idle with the weights cached. Measured on Zen 5, bf16,
// W1's 120 layer linears a step, 2 threads: oneDNN 20.0 ms (679 GFLOP/s), this 13.5 ms
// (1,006); its margin holds from 1 row (1.6x) to 512 (1.4x). docs/benchmarks.md has the
// table.
//
// How: each thread owns a run of column panels. A micro-kernel multiplies a tile of rows
// with a whole panel over all of K, accumulating in float32 registers, and while it does
// it prefetches the panel the thread multiplies next, spread over the tile loop, so the
// weights stream in behind compute. The packed layout serves that: the output columns in
// panels of up to NR vectors (C columns each); a panel is contiguous as
// [k-step][its columns][P], P the k values a step takes (bf16: the pair vdpbf16ps
// multiplies; float32: 1). Columns past N and k past K are zero.
//
// Kinds: bf16 with AVX512_BF16's vdpbf16ps (the products exact, summed in float32 as
// oneDNN's bf16 matmuls do); float32 on vec.h's vectors (AVX-512, AVX2 + FMA, NEON).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define FLOTILLA_DPBF16 1
#else
#define FLOTILLA_DPBF16 0
#endif

namespace {

namespace vec = flotilla::vec;

// Row tiles above this many rows are split, so a thread's rows stay in its L2.
constexpr int64_t kMaxChunkRows = 512;

// The thread's next panel, fetched a few lines per k-step of the current one. A tile
// works on a copy (a local the compiler keeps in registers) and hands it back at its end.
struct Prefetch {
  const char* p;
  const char* end;
  int64_t per_step;
  __attribute__((always_inline)) inline void step() {
    if (p >= end) return;
    for (int64_t l = 0; l < per_step; ++l, p += 64) __builtin_prefetch(p, 0, 3);
  }
};

// ---- float32 on vec.h vectors ------------------------------------------------------
struct F32 {
  using T = float;
  static constexpr int64_t C = vec::L, P = 1;
  static constexpr int MR = vec::kRegs >= 32 ? 8 : 4, NR = 3;  // MR*NR accumulators

  template <int R, int W, typename O>
  static void tile(const float* a, int64_t lda, const float* b, int64_t steps, const float* bias,
                   O* c, int64_t ldc, int64_t ncols, Prefetch& next) {
    Prefetch pf = next;
    vec::vf acc[R][W];
    for (int j = 0; j < W; ++j) {
      const vec::vf init = bias ? vec::load(bias + j * C) : vec::splat(0.f);
      for (int i = 0; i < R; ++i) acc[i][j] = init;
    }
    for (int64_t k = 0; k < steps; ++k) {
      vec::vf w[W];
      for (int j = 0; j < W; ++j) w[j] = vec::load(b + (k * W + j) * C);
      pf.step();
      for (int i = 0; i < R; ++i) {
        const vec::vf x = vec::splat(a[i * lda + k]);
        for (int j = 0; j < W; ++j) acc[i][j] += x * w[j];
      }
    }
    next = pf;
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < W; ++j) {
        const int64_t c0 = j * C;
        if (c0 + C <= ncols) {
          vec::store(c + i * ldc + c0, acc[i][j]);
        } else {
          for (int64_t l = 0; c0 + l < ncols; ++l) c[i * ldc + c0 + l] = acc[i][j][l];
        }
      }
  }
};

// ---- bf16 with vdpbf16ps ------------------------------------------------------------
#if FLOTILLA_DPBF16
struct Bf16 {
  using T = c10::BFloat16;
  static constexpr int64_t C = 16, P = 2;
  static constexpr int MR = 8, NR = 3;  // 24 zmm accumulators

  template <int R, int W, typename O>
  static void tile(const T* a, int64_t lda, const T* b, int64_t steps, const float* bias, O* c,
                   int64_t ldc, int64_t ncols, Prefetch& next) {
    Prefetch pf = next;
    __m512 acc[R][W];
    for (int j = 0; j < W; ++j) {
      const __m512 init = bias ? _mm512_loadu_ps(bias + j * C) : _mm512_setzero_ps();
      for (int i = 0; i < R; ++i) acc[i][j] = init;
    }
    const auto* ap = reinterpret_cast<const int32_t*>(a);  // a row's k pairs
    const int64_t lda2 = lda / 2;
    for (int64_t k = 0; k < steps; ++k) {
      __m512bh w[W];
      for (int j = 0; j < W; ++j) w[j] = (__m512bh)_mm512_loadu_si512(b + (k * W + j) * C * P);
      pf.step();
      for (int i = 0; i < R; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(ap[i * lda2 + k]);
        for (int j = 0; j < W; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], x, w[j]);
      }
    }
    next = pf;
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < W; ++j) {
        const int64_t c0 = j * C;
        if (c0 >= ncols) continue;
        const __mmask16 mask = c0 + C <= ncols ? 0xFFFF : (1u << (ncols - c0)) - 1;
        if constexpr (std::is_same_v<O, float>) {  // bf16 values, widened: logits
          _mm512_mask_storeu_ps(c + i * ldc + c0, mask, flotilla::round_bf16(acc[i][j]));
        } else {
          const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[i][j]);  // round to nearest even
          _mm256_mask_storeu_epi16(c + i * ldc + c0, mask, out);
        }
      }
  }
};
#endif

// Rows [0, rows) of a with one panel of W vectors: full MR tiles, then the remainder.
template <class K, typename O, int W, int R = K::MR>
void panel_tail(const typename K::T* a, int64_t lda, const typename K::T* b, int64_t steps,
                const float* bias, O* c, int64_t ldc, int64_t ncols, int64_t rows, Prefetch& pf) {
  if constexpr (R > 0) {
    if (rows == R) return K::template tile<R, W, O>(a, lda, b, steps, bias, c, ldc, ncols, pf);
    panel_tail<K, O, W, R - 1>(a, lda, b, steps, bias, c, ldc, ncols, rows, pf);
  }
}

template <class K, typename O, int W>
void panel(const typename K::T* a, int64_t lda, const typename K::T* b, int64_t steps,
           const float* bias, O* c, int64_t ldc, int64_t ncols, int64_t rows, Prefetch& pf) {
  int64_t m = 0;
  for (; m + K::MR <= rows; m += K::MR)
    K::template tile<K::MR, W, O>(a + m * lda, lda, b, steps, bias, c + m * ldc, ldc, ncols, pf);
  if (m < rows)
    panel_tail<K, O, W>(a + m * lda, lda, b, steps, bias, c + m * ldc, ldc, ncols, rows - m, pf);
}

template <class K, typename O, int W = K::NR>
void panel_any(int64_t width, const typename K::T* a, int64_t lda, const typename K::T* b,
               int64_t steps, const float* bias, O* c, int64_t ldc, int64_t ncols, int64_t rows,
               Prefetch& pf) {
  if constexpr (W > 0) {
    if (width == W) return panel<K, O, W>(a, lda, b, steps, bias, c, ldc, ncols, rows, pf);
    panel_any<K, O, W - 1>(width, a, lda, b, steps, bias, c, ldc, ncols, rows, pf);
  }
}

template <class K>
int64_t packed_numel(int64_t n, int64_t k) {
  return (n + K::C - 1) / K::C * K::C * ((k + K::P - 1) / K::P) * K::P;
}

template <class K>
torch::Tensor pack(const torch::Tensor& weight) {
  using T = typename K::T;
  const torch::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), steps = (k + K::P - 1) / K::P;
  const int64_t vectors = (n + K::C - 1) / K::C;
  torch::Tensor out = torch::zeros({packed_numel<K>(n, k)}, w.options());
  const T* src = w.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (int64_t v0 = 0; v0 < vectors; v0 += K::NR) {
    const int64_t width = std::min<int64_t>(K::NR, vectors - v0);
    T* base = dst + v0 * K::C * steps * K::P;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t col = 0; col < width * K::C; ++col)
        for (int64_t p = 0; p < K::P; ++p) {
          const int64_t row = v0 * K::C + col, kk = s * K::P + p;
          if (row < n && kk < k) base[(s * width * K::C + col) * K::P + p] = src[row * k + kk];
        }
  }
  return out;
}

// O: the output's element type, K::T or float32 (holding values rounded to K::T).
template <class K, typename O = typename K::T>
torch::Tensor run(const torch::Tensor& input, const torch::Tensor& packed,
                  const c10::optional<torch::Tensor>& bias, int64_t n) {
  using T = typename K::T;
  const int64_t k = input.size(-1);
  // The packed size pins K (to the k-step) and N to the vector width: out_features is
  // the caller's (Linear keeps it), the check catches a weight packed for other shapes.
  TORCH_CHECK(packed.numel() == packed_numel<K>(n, k),
              "linear: the packed weight does not hold ", n, " x ", k);
  torch::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0), steps = (k + K::P - 1) / K::P;
  if (k % K::P) x = torch::constant_pad_nd(x, {0, K::P - k % K::P});  // whole k-steps
  const int64_t lda = x.size(1);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  torch::Tensor y = torch::empty({m, n}, input.options().dtype(c10::CppTypeToScalarType<O>::value));
  if (m == 0 || n == 0) return y.reshape(shape);

  const int64_t vectors = (n + K::C - 1) / K::C, panels = (vectors + K::NR - 1) / K::NR;
  std::vector<float> bias_f;  // float32, padded to whole vectors
  if (bias && bias->defined()) {
    const torch::Tensor bf = bias->to(torch::kFloat32).contiguous();
    bias_f.assign(vectors * K::C, 0.f);
    std::copy(bf.data_ptr<float>(), bf.data_ptr<float>() + n, bias_f.begin());
  }
  // Work items (row chunk, panel), chunk-major; each thread takes a contiguous run, so
  // its next item is usually the next panel. Rows are split only when there are fewer
  // panels than threads, or a chunk would outgrow kMaxChunkRows.
  const int64_t threads = at::get_num_threads(), tiles = (m + K::MR - 1) / K::MR;
  int64_t chunks = std::max<int64_t>((m + kMaxChunkRows - 1) / kMaxChunkRows,
                                     panels < threads ? (threads + panels - 1) / panels : 1);
  chunks = std::min(chunks, tiles);
  const int64_t chunk_rows = (tiles + chunks - 1) / chunks * K::MR;
  chunks = (m + chunk_rows - 1) / chunk_rows;
  const int64_t panel_elems = K::NR * K::C * steps * K::P;
  const T* xp = x.data_ptr<T>();
  const T* wp = packed.data_ptr<T>();
  O* yp = y.data_ptr<O>();
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();

  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, g = item % panels;
      const int64_t r0 = chunk * chunk_rows, rows = std::min(chunk_rows, m - r0);
      const int64_t width = std::min<int64_t>(K::NR, vectors - g * K::NR);
      const int64_t col0 = g * K::NR * K::C, ncols = std::min(width * K::C, n - col0);
      const T* b = wp + g * panel_elems;
      Prefetch pf{nullptr, nullptr, 0};
      if (item + 1 < end && (item + 1) % panels != g) {
        const int64_t g2 = (item + 1) % panels;
        const int64_t width2 = std::min<int64_t>(K::NR, vectors - g2 * K::NR);
        pf.p = reinterpret_cast<const char*>(wp + g2 * panel_elems);
        pf.end = pf.p + width2 * K::C * steps * K::P * sizeof(T);
        const int64_t lines = (pf.end - pf.p + 63) / 64, tile_steps = (rows + K::MR - 1) / K::MR * steps;
        pf.per_step = (lines + tile_steps - 1) / tile_steps;
      }
      panel_any<K, O>(width, xp + r0 * lda, lda, b, steps, bp ? bp + col0 : nullptr,
                   yp + r0 * n + col0, n, ncols, rows, pf);
    }
  });
  return y.reshape(shape);
}

}  // namespace

std::vector<std::string> linear_dtypes() {
#if FLOTILLA_DPBF16
  return {"float32", "bfloat16"};
#else
  return {"float32"};
#endif
}

torch::Tensor pack_linear(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear: the weight must be 2-D, got ", weight.dim(), "-D");
  if (weight.scalar_type() == torch::kFloat32) return pack<F32>(weight);
#if FLOTILLA_DPBF16
  if (weight.scalar_type() == torch::kBFloat16) return pack<Bf16>(weight);
#endif
  TORCH_CHECK(false, "pack_linear: no kernel for ", weight.scalar_type(), " in this build");
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                     int64_t out_features, bool float_out) {
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: input ", x.scalar_type(),
              " against a ", packed.scalar_type(), " weight");
  if (x.scalar_type() == torch::kFloat32) return run<F32>(x, packed, bias, out_features);
#if FLOTILLA_DPBF16
  if (x.scalar_type() == torch::kBFloat16) {
    return float_out ? run<Bf16, float>(x, packed, bias, out_features)
                     : run<Bf16>(x, packed, bias, out_features);
  }
#endif
  TORCH_CHECK(false, "linear: no kernel for ", x.scalar_type(), " in this build");
}
