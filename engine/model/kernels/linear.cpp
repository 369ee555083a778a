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
// Paired layout (the MLP's fused gate_up projection): panel g holds gate vector g and up
// vector g, so one tile has both halves of its columns and can write silu(gate) * up
// directly (the SwiGLU activation, rounded where engine/model/kernels/fused_ops.cpp's
// silu_and_mul rounds): no [rows, 2 x intermediate] product, no separate pass over it.
// W1 (Zen 5, bf16): silu_and_mul took 0.13 s of a 4.4 s run. Without the activation
// (LoRA adds to the product first) a paired weight writes the plain product.
//
// Kinds: bf16 with AMX's tile product tdpbf16ps where the CPU has AMX_BF16 and Linux
// grants the tile state, else with AVX512_BF16's vdpbf16ps (either way the products
// exact, summed in float32 as oneDNN's bf16 matmuls do); float32 on vec.h's vectors
// (AVX-512, AVX2 + FMA, NEON). Both bf16 kinds read one packed layout (a panel's 16
// k-steps of one vector are an AMX B tile), so a process can switch between them.
// Why AMX: on a Xeon with it (Granite Rapids class, 2 threads), vdpbf16ps peaks at 158
// GFLOP/s and tdpbf16ps at 4,470 (bench/peak_flops.cpp); the vdpbf16ps kernel ran a
// layer's 4 linears at 64 rows 5x slower than oneDNN's AMX matmul.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "simd.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
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

// Where a tile's accumulators go. Vector j of a row: bias at bias + j * bstride; output
// at c + j * vstride with ncols - j * vskip valid lanes (a plain panel: vstride = vskip
// = C; a paired one: vstride = N / 2 apart, both vectors with ncols lanes, vskip = 0).
// glu: one vector per row, silu(vector 0) * vector 1.
template <typename O>
struct Out {
  O* c;
  int64_t ldc, ncols, vstride, vskip;
  const float* bias;
  int64_t bstride;
  // Whole float vectors go past the caches (non-temporal): a large output (the LM head's
  // logits) written through them evicted the weights it was being computed from.
  bool stream = false;
};

// ---- float32 on vec.h vectors ------------------------------------------------------
struct F32 {
  using T = float;
  static constexpr int64_t C = vec::L, P = 1, KS = 1, KALIGN = 1;
  static constexpr int MR = vec::kRegs >= 32 ? 8 : 4, NR = 3;  // MR*NR accumulators
  static constexpr int MR2 = vec::kRegs >= 32 ? 8 : 6;           // rows of a paired tile

  template <int R, int W, bool GLU, typename O>
  static void tile(const float* a, int64_t lda, const float* b, int64_t steps, const Out<O>& out,
                   Prefetch& next) {
    Prefetch pf = next;
    vec::vf acc[R][W];
    for (int j = 0; j < W; ++j) {
      const vec::vf init = out.bias ? vec::load(out.bias + j * out.bstride) : vec::splat(0.f);
      for (int i = 0; i < R; ++i) acc[i][j] = init;
    }
    for (int64_t k = 0; k < steps; ++k) {
      vec::vf w[W];
      for (int j = 0; j < W; ++j) w[j] = vec::load(b + (k * W + j) * C);
      pf.step();
      for (int i = 0; i < R; ++i) {
        const vec::vf x = vec::splat(a[i * lda + k]);
        // each sum in k order: a lone accumulator (a one-row, one-vector tile) was split
        // into several under Zen 3's tuning, so a tail differed between tile shapes
        for (int j = 0; j < W; ++j) acc[i][j] = vec::opaque(acc[i][j] + x * w[j]);
      }
    }
    next = pf;
    for (int i = 0; i < R; ++i) {
      O* row = out.c + i * out.ldc;
      if constexpr (GLU) {
        static_assert(W == 2, "glu tiles hold a gate and an up vector");
        const vec::vf g = acc[i][0];
        store(row, g / (1.f + vec::exp(-g)) * acc[i][1], out.ncols);
      } else {
        for (int j = 0; j < W; ++j)
          store(row + j * out.vstride, acc[i][j], out.ncols - j * out.vskip);
      }
    }
  }

  static void store(float* c, vec::vf v, int64_t lanes) {
    if (lanes >= C) return vec::store(c, v);
    for (int64_t l = 0; l < lanes; ++l) c[l] = v[l];
  }
};

// ---- bf16 with vdpbf16ps ------------------------------------------------------------
#if FLOTILLA_DPBF16
struct Bf16 {
  using T = c10::BFloat16;
  static constexpr int64_t C = 16, P = 2;
  static constexpr int64_t KS = 1;      // k-steps an iteration of the tile loop takes
  static constexpr int64_t KALIGN = 16;  // the layout's k-steps: whole AMX B tiles
  static constexpr int MR = 8, NR = 3;  // 24 zmm accumulators
  static constexpr int MR2 = 8;          // rows of a paired tile (12 measured no faster)

  template <int R, int W, bool GLU, typename O>
  static void tile(const T* a, int64_t lda, const T* b, int64_t steps, const Out<O>& out,
                   Prefetch& next) {
    Prefetch pf = next;
    __m512 acc[R][W];
    for (int j = 0; j < W; ++j) {
      const __m512 init = out.bias ? _mm512_loadu_ps(out.bias + j * out.bstride)
                                   : _mm512_setzero_ps();
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
    for (int i = 0; i < R; ++i) emit<W, GLU>(out.c + i * out.ldc, acc[i], out);
  }

  // One output row from its W float32 accumulators (bias included).
  template <int W, bool GLU, typename O>
  static void emit(O* row, const __m512* acc, const Out<O>& out) {
    if constexpr (GLU) {  // gate and up rounded to bf16 first, as silu_and_mul reads them
      static_assert(W == 2, "glu tiles hold a gate and an up vector");
      const __m512 g = flotilla::round_bf16(acc[0]);
      const __m512 e = flotilla::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 act = flotilla::round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      store(row, _mm512_mul_ps(act, flotilla::round_bf16(acc[1])), out.ncols);
    } else {
      for (int j = 0; j < W; ++j)
        store(row + j * out.vstride, acc[j], out.ncols - j * out.vskip, out.stream);
    }
  }

  template <typename O>
  static void store(O* c, __m512 v, int64_t lanes, bool stream = false) {
    if (lanes <= 0) return;
    const __mmask16 mask = lanes >= C ? 0xFFFF : (1u << lanes) - 1;
    if constexpr (std::is_same_v<O, float>) {  // bf16 values, widened: logits
      flotilla::store_floats(c, flotilla::round_bf16(v), mask, stream);
    } else {
      _mm256_mask_storeu_epi16(c, mask, (__m256i)_mm512_cvtneps_pbh(v));  // nearest even
    }
  }
};
#endif

// ---- bf16 on AMX tiles --------------------------------------------------------------
#if FLOTILLA_AMX
// A unit of up to 2 row blocks (16 rows each) x up to 2 vectors of a panel (of PW): the
// canonical 2 x 2 tile blocking, float32 products in tiles 0-3 (row block i, vector j in
// tile 2i + j), the A tiles (16 rows x 32 k) of both row blocks in 4 and 5, the B tiles
// (32 k x 16 columns: a vector's 16 k-steps, read in place at the panel's row stride) in
// 6 and 7: every tile loaded once a k-tile feeds two products. A panel of 3 vectors is a
// unit of 2 and one of 1. The first version reloaded one A tile for every product (6 A
// and 3 B loads for 6 products), and its loads waited on the product before them: the
// 64-row LM head (49,152 x 576) spent half its samples on those loads. A unit's products
// go through a float32 scratch to Bf16::emit, which adds the bias and rounds. No
// software prefetch: the vector kinds' next-panel prefetch made AMX slower on the Xeon
// measured (a layer's 4 linears at 64 rows, weights from memory: 574 us with it, 446
// without; the hardware prefetchers follow the tile loads' stream).
struct Amx : Bf16 {
  static constexpr int64_t KS = 16;  // a B tile's k-steps
  static constexpr int MR = 32;      // rows of a unit (x's rows are padded to 16)

  template <int R, int W, int PW, bool GLU, typename O>
  static void unit(const T* a, int64_t lda, const T* b, int64_t steps, const Out<O>& out,
                   int64_t rows) {
    static_assert(W <= 2 && W <= PW, "a unit holds up to 2 vectors of its panel");
    const long as = lda * sizeof(T), bs = PW * C * P * sizeof(T);
    _tile_zero(0); if constexpr (W > 1) _tile_zero(1);
    if constexpr (R > 1) { _tile_zero(2); if constexpr (W > 1) _tile_zero(3); }
    const T* a1 = a + 16 * lda;
    for (int64_t s = 0; s < steps; s += KS) {
      const T* bt = b + s * PW * C * P;
      _tile_loadd(6, bt, bs);
      if constexpr (W > 1) _tile_loadd(7, bt + C * P, bs);
      _tile_loadd(4, a + s * P, as);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (W > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (R > 1) {
        _tile_loadd(5, a1 + s * P, as);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (W > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
    alignas(64) float acc[4][16 * 16];
    _tile_stored(0, acc[0], 64);
    if constexpr (W > 1) _tile_stored(1, acc[1], 64);
    if constexpr (R > 1) {
      _tile_stored(2, acc[2], 64);
      if constexpr (W > 1) _tile_stored(3, acc[3], 64);
    }
    for (int64_t r = 0; r < rows; ++r) {
      __m512 v[W];
      const int64_t blk = r / 16, in = r % 16;
      for (int j = 0; j < W; ++j) {
        v[j] = _mm512_load_ps(acc[2 * blk + j] + in * 16);
        if (out.bias) v[j] = _mm512_add_ps(v[j], _mm512_loadu_ps(out.bias + j * out.bstride));
      }
      emit<W, GLU>(out.c + r * out.ldc, v, out);
    }
  }

  // Rows of a with vectors [j0, j0 + W) of a panel of PW: out moved to vector j0.
  template <int R, int W, int PW, bool GLU, typename O>
  static void part(const T* a, int64_t lda, const T* b, int64_t steps, Out<O> out,
                   int64_t rows, int j0) {
    out.c += j0 * out.vstride;
    out.ncols -= j0 * out.vskip;
    if (out.bias) out.bias += j0 * out.bstride;
    unit<R, W, PW, GLU, O>(a, lda, b + j0 * C * P, steps, out, rows);
  }

  // Rows [0, rows) of a (padded to whole row blocks) with one panel of W vectors.
  template <int W, bool GLU, typename O>
  static void panel(const T* a, int64_t lda, const T* b, int64_t steps, Out<O> out,
                    int64_t rows) {
    static_assert(!GLU || W == 2, "glu panels hold a gate and an up vector");
    for (int64_t m = 0; m < rows; m += MR, out.c += MR * out.ldc) {
      const int64_t n = std::min<int64_t>(MR, rows - m);
      const T* am = a + m * lda;
      if (n > 16) {
        if constexpr (W >= 2) part<2, 2, W, GLU, O>(am, lda, b, steps, out, n, 0);
        if constexpr (W != 2) part<2, 1, W, GLU, O>(am, lda, b, steps, out, n, W - 1);
      } else {
        if constexpr (W >= 2) part<1, 2, W, GLU, O>(am, lda, b, steps, out, n, 0);
        if constexpr (W != 2) part<1, 1, W, GLU, O>(am, lda, b, steps, out, n, W - 1);
      }
    }
  }
};
#endif

// Rows [0, rows) of a with one panel of W vectors: full tiles of MR rows, then the rest.
template <class K, int W, bool GLU, typename O, int R>
void panel_tail(const typename K::T* a, int64_t lda, const typename K::T* b, int64_t steps,
                Out<O> out, int64_t rows, Prefetch& pf) {
  if constexpr (R > 0) {
    if (rows == R) return K::template tile<R, W, GLU, O>(a, lda, b, steps, out, pf);
    panel_tail<K, W, GLU, O, R - 1>(a, lda, b, steps, out, rows, pf);
  }
}

// (The AMX kind walks its own units of row blocks and does not prefetch.)
template <class K, int W, bool GLU, typename O, int MR = K::MR>
void panel(const typename K::T* a, int64_t lda, const typename K::T* b, int64_t steps,
           Out<O> out, int64_t rows, Prefetch& pf) {
  if constexpr (K::KS > 1) {
    K::template panel<W, GLU, O>(a, lda, b, steps, out, rows);
  } else {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR, out.c += MR * out.ldc)
      K::template tile<MR, W, GLU, O>(a + m * lda, lda, b, steps, out, pf);
    if (m < rows) panel_tail<K, W, GLU, O, MR - 1>(a + m * lda, lda, b, steps, out, rows - m, pf);
  }
}

template <class K, typename O, int W = K::NR>
void panel_any(int64_t width, const typename K::T* a, int64_t lda, const typename K::T* b,
               int64_t steps, const Out<O>& out, int64_t rows, Prefetch& pf) {
  if constexpr (W > 0) {
    if (width == W) return panel<K, W, false, O>(a, lda, b, steps, out, rows, pf);
    panel_any<K, O, W - 1>(width, a, lda, b, steps, out, rows, pf);
  }
}

// Which weight row feeds each column of each panel, and where panels lie.
template <class K>
struct Geometry {
  int64_t n, k, steps;  // steps: the layout's k-steps (whole K::KALIGN runs, zero past K)
  int64_t ksteps;       // the k-steps holding K
  bool paired;
  int64_t half;     // paired: N / 2, the columns of each half
  int64_t vectors;  // plain: vectors of C columns; paired: pairs of them
  int64_t panels;

  Geometry(int64_t n_, int64_t k_, bool paired_)
      : n(n_), k(k_), steps(((k_ + K::P - 1) / K::P + K::KALIGN - 1) / K::KALIGN * K::KALIGN),
        ksteps((k_ + K::P - 1) / K::P), paired(paired_), half(n_ / 2) {
    vectors = paired ? (half + K::C - 1) / K::C : (n + K::C - 1) / K::C;
    panels = paired ? vectors : (vectors + K::NR - 1) / K::NR;
  }
  int64_t width(int64_t g) const { return paired ? 2 : std::min<int64_t>(K::NR, vectors - g * K::NR); }
  int64_t step_elems(int64_t g) const { return width(g) * K::C * K::P; }
  int64_t offset(int64_t g) const { return g * (paired ? 2 : K::NR) * K::C * steps * K::P; }
  int64_t numel() const { return (paired ? 2 : 1) * vectors * K::C * steps * K::P; }
  // The weight row of column `col` of panel g, or -1 for padding.
  int64_t source_row(int64_t g, int64_t col) const {
    if (!paired) {
      const int64_t row = g * K::NR * K::C + col;
      return row < n ? row : -1;
    }
    const int64_t in_half = g * K::C + col % K::C;
    return in_half < half ? in_half + (col < K::C ? 0 : half) : -1;
  }
};

template <class K>
torch::Tensor pack(const torch::Tensor& weight, bool paired) {
  using T = typename K::T;
  const torch::Tensor w = weight.contiguous();
  TORCH_CHECK(!paired || w.size(0) % 2 == 0,
              "pack_linear: a paired weight needs an even row count, got ", w.size(0));
  const Geometry<K> geo(w.size(0), w.size(1), paired);
  torch::Tensor out = torch::zeros({geo.numel()}, w.options());
  const T* src = w.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  for (int64_t g = 0; g < geo.panels; ++g) {
    T* base = dst + geo.offset(g);
    const int64_t cols = geo.width(g) * K::C;
    for (int64_t col = 0; col < cols; ++col) {
      const int64_t row = geo.source_row(g, col);
      if (row < 0) continue;
      for (int64_t s = 0; s < geo.steps; ++s)
        for (int64_t p = 0; p < K::P && s * K::P + p < geo.k; ++p)
          base[(s * cols + col) * K::P + p] = src[row * geo.k + s * K::P + p];
    }
  }
  return out;
}

// O: the output's element type, K::T or float32 (holding values rounded to K::T).
// Groups (a mixture of experts' experts): rows [ends[e-1], ends[e]) of the input times
// weight e, all in one parallel region whose threads prefetch across the weights (one
// call an expert lost the first panel's latency and a fork-join each); one weight is a
// single group over every row.
template <class K, typename O = typename K::T>
torch::Tensor run(const torch::Tensor& input, const std::vector<torch::Tensor>& weights,
                  const std::vector<int64_t>& ends, const c10::optional<torch::Tensor>& bias,
                  int64_t n, bool paired, bool glu) {
  using T = typename K::T;
  const int64_t k = input.size(-1);
  TORCH_CHECK(!glu || paired, "linear: glu needs a weight packed paired");
  TORCH_CHECK(!paired || n % 2 == 0, "linear: a paired weight has an even out_features");
  const Geometry<K> geo(n, k, paired);
  // The packed size pins K (to the k-step) and N to the vector width: out_features is
  // the caller's (Linear keeps it), the check catches a weight packed for other shapes.
  for (const torch::Tensor& packed : weights)
    TORCH_CHECK(packed.numel() == geo.numel(), "linear: the packed weight does not hold ", n,
                " x ", k);
  torch::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0), width_out = glu ? geo.half : n;
  TORCH_CHECK(ends.size() == weights.size() && !ends.empty() && ends.back() == m,
              "linear: the groups' row ends must close on the input's ", m, " rows");
  TORCH_CHECK(K::KS == 1 || weights.size() == 1, "linear: AMX tiles take one weight a call");
  // The k-steps a tile runs: all of K (vector kinds), or whole B tiles (AMX: x padded
  // with zeros to them, and its rows to whole 16-row blocks).
  const int64_t steps = K::KS > 1 ? geo.steps : geo.ksteps;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = width_out;
  torch::Tensor y = torch::empty({m, width_out},
                                 input.options().dtype(c10::CppTypeToScalarType<O>::value));
  if (m == 0 || n == 0) return y.reshape(shape);
  const int64_t pad_k = steps * K::P - k, pad_m = K::KS > 1 ? (16 - m % 16) % 16 : 0;
  if (pad_k || pad_m) x = torch::constant_pad_nd(x, {0, pad_k, 0, pad_m});
  const int64_t lda = x.size(1);

  // float32 bias, padded to whole vectors (paired: each half padded on its own)
  const int64_t span = paired ? geo.vectors * K::C : 0;
  std::vector<float> bias_f;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear: a bias of ", bias->numel(), " for ", n,
                " output features");
    const torch::Tensor bf = bias->to(torch::kFloat32).contiguous();
    const float* src = bf.data_ptr<float>();
    bias_f.assign(paired ? 2 * span : geo.vectors * K::C, 0.f);
    if (paired) {
      std::copy(src, src + geo.half, bias_f.begin());
      std::copy(src + geo.half, src + n, bias_f.begin() + span);
    } else {
      std::copy(src, src + n, bias_f.begin());
    }
  }
  // Work items (group, row chunk, panel), chunk-major in each group; each thread takes a
  // contiguous run, so its next item is usually the next panel. Rows are split only when
  // there are fewer panels than threads, or a chunk would outgrow kMaxChunkRows.
  const int64_t panels = geo.panels, threads = at::get_num_threads();
  struct Work { const T* w; int64_t r0, rows, g; };
  std::vector<Work> work;
  for (size_t e = 0; e < weights.size(); ++e) {
    const int64_t start = e ? ends[e - 1] : 0, rows_e = ends[e] - start;
    if (rows_e <= 0) continue;
    const int64_t tiles = (rows_e + K::MR - 1) / K::MR;
    int64_t chunks = std::max<int64_t>((rows_e + kMaxChunkRows - 1) / kMaxChunkRows,
                                       panels < threads ? (threads + panels - 1) / panels : 1);
    chunks = std::min(chunks, tiles);
    const int64_t chunk_rows = (tiles + chunks - 1) / chunks * K::MR;
    for (int64_t r = 0; r < rows_e; r += chunk_rows)
      for (int64_t g = 0; g < panels; ++g)
        work.push_back({weights[e].data_ptr<T>(), start + r, std::min(chunk_rows, rows_e - r), g});
  }
  const T* xp = x.data_ptr<T>();
  O* yp = y.data_ptr<O>();
  const bool stream = std::is_same_v<T, c10::BFloat16> && std::is_same_v<O, float> &&
                      m * n * int64_t(sizeof(O)) > flotilla::kStreamBytes;
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();

  at::parallel_for(0, int64_t(work.size()), 1, [&](int64_t begin, int64_t end) {
#if FLOTILLA_AMX
    std::conditional_t<std::is_same_v<K, Amx>, flotilla::amx::Tiles, int> tiles_in_use{};
    (void)tiles_in_use;
#endif
    for (int64_t item = begin; item < end; ++item) {
      const Work& it = work[item];
      const int64_t r0 = it.r0, rows = it.rows, g = it.g;
      Prefetch pf{nullptr, nullptr, 0};
      if (K::KS == 1 && item + 1 < end &&
          (work[item + 1].g != g || work[item + 1].w != it.w)) {
        const int64_t g2 = work[item + 1].g;
        pf.p = reinterpret_cast<const char*>(work[item + 1].w + geo.offset(g2));
        pf.end = pf.p + geo.step_elems(g2) * steps * sizeof(T);
        const int64_t mr = paired ? K::MR2 : K::MR;
        const int64_t lines = (pf.end - pf.p + 63) / 64, tile_steps = (rows + mr - 1) / mr * steps;
        pf.per_step = (lines + tile_steps - 1) / tile_steps;
      }
      const T* a = xp + r0 * lda;
      const T* b = it.w + geo.offset(g);
      if (paired) {
        const int64_t col0 = g * K::C, ncols = std::min<int64_t>(K::C, geo.half - col0);
        Out<O> out{yp + r0 * width_out + col0, width_out, ncols, geo.half, 0,
                   bp ? bp + col0 : nullptr, span};
        if (glu) {
          panel<K, 2, true, O, K::MR2>(a, lda, b, steps, out, rows, pf);
        } else {
          panel<K, 2, false, O, K::MR2>(a, lda, b, steps, out, rows, pf);
        }
      } else {
        const int64_t col0 = g * K::NR * K::C, width = geo.width(g);
        Out<O> out{yp + r0 * n + col0, n, std::min(width * K::C, n - col0), K::C, K::C,
                   bp ? bp + col0 : nullptr, K::C, stream};
        panel_any<K, O>(width, a, lda, b, steps, out, rows, pf);
      }
    }
#if defined(__x86_64__)
    if (stream) _mm_sfence();  // this thread's streamed lines out before the join
#endif
  });
  return y.reshape(shape);
}

#if FLOTILLA_DPBF16
// Whether this process can run the AMX kind: the build has it and Linux granted the tile
// state. Asked on first use, not at load: once granted, every signal frame of the process
// grows by the 8 KB of tile state, which a bf16-free process should not pay for.
bool amx_runs() {
#if FLOTILLA_AMX
  return flotilla::amx::granted();
#else
  return false;
#endif
}

// The bf16 kind in use: -1 until the first bf16 call picks AMX where it runs (the faster
// by far, see the top), else vdpbf16ps; set_linear_bf16_kernel forces one.
enum Bf16Kind : int { kUnresolved = -1, kDpbf16 = 0, kAmx = 1 };
std::atomic<int> g_bf16_kind{kUnresolved};

Bf16Kind bf16_kind() {
  int kind = g_bf16_kind.load(std::memory_order_relaxed);
  if (kind == kUnresolved) {
    kind = amx_runs() ? kAmx : kDpbf16;
    g_bf16_kind.store(kind);
  }
  return Bf16Kind(kind);
}

template <typename O = c10::BFloat16>
torch::Tensor run_bf16(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                       const std::vector<int64_t>& ends, const c10::optional<torch::Tensor>& bias,
                       int64_t n, bool paired, bool glu) {
#if FLOTILLA_AMX
  if (bf16_kind() == kAmx) {
    if (weights.size() == 1) return run<Amx, O>(x, weights, ends, bias, n, paired, glu);
    std::vector<torch::Tensor> parts;  // AMX pads each call's rows to whole tiles: one a group
    for (size_t e = 0; e < weights.size(); ++e) {
      const int64_t start = e ? ends[e - 1] : 0;
      const torch::Tensor rows = x.narrow(0, start, ends[e] - start);
      parts.push_back(run<Amx, O>(rows, {weights[e]}, {rows.size(0)}, bias, n, paired, glu));
    }
    return torch::cat(parts);
  }
#endif
  return run<Bf16, O>(x, weights, ends, bias, n, paired, glu);
}
#endif

}  // namespace

std::vector<std::string> linear_bf16_kernels() {
#if FLOTILLA_DPBF16
  if (amx_runs()) return {"amx", "dpbf16"};
  return {"dpbf16"};
#else
  return {};
#endif
}

std::string linear_bf16_kernel() {
#if FLOTILLA_DPBF16
  return bf16_kind() == kAmx ? "amx" : "dpbf16";
#else
  return "";
#endif
}

bool set_linear_bf16_kernel(const std::string& name) {
#if FLOTILLA_DPBF16
  if (name == "dpbf16" || (name == "amx" && amx_runs())) {
    g_bf16_kind.store(name == "amx" ? kAmx : kDpbf16);
    return true;
  }
#endif
  return false;
}

// The float32 packed layout's vector width and the vectors a plain panel holds: what a
// caller filling that layout itself (quant_regrouped.cpp's GGUF prompt path) must match.
std::vector<int64_t> linear_f32_layout() { return {F32::C, F32::NR}; }

std::vector<std::string> linear_dtypes() {
#if FLOTILLA_DPBF16
  return {"float32", "bfloat16"};
#else
  return {"float32"};
#endif
}

torch::Tensor pack_linear(torch::Tensor weight, bool paired) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear: the weight must be 2-D, got ", weight.dim(), "-D");
  if (weight.scalar_type() == torch::kFloat32) return pack<F32>(weight, paired);
#if FLOTILLA_DPBF16
  if (weight.scalar_type() == torch::kBFloat16) return pack<Bf16>(weight, paired);
#endif
  TORCH_CHECK(false, "pack_linear: no kernel for ", weight.scalar_type(), " in this build");
}

torch::Tensor grouped(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                      const std::vector<int64_t>& ends, const c10::optional<torch::Tensor>& bias,
                      int64_t out_features, bool float_out, bool paired, bool glu);

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                     int64_t out_features, bool float_out, bool paired, bool glu) {
  TORCH_CHECK(!(float_out && glu), "linear: float_out and glu do not go together");
  return grouped(x, {packed}, {x.numel() / std::max<int64_t>(x.size(-1), 1)}, bias,
                 out_features, float_out, paired, glu);
}

torch::Tensor grouped(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                      const std::vector<int64_t>& ends, const c10::optional<torch::Tensor>& bias,
                      int64_t out_features, bool float_out, bool paired, bool glu) {
  for (const torch::Tensor& w : weights)
    TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: input ", x.scalar_type(),
                " against a ", w.scalar_type(), " weight");
  if (x.scalar_type() == torch::kFloat32)
    return run<F32>(x, weights, ends, bias, out_features, paired, glu);
#if FLOTILLA_DPBF16
  if (x.scalar_type() == torch::kBFloat16) {
    return float_out ? run_bf16<float>(x, weights, ends, bias, out_features, paired, glu)
                     : run_bf16(x, weights, ends, bias, out_features, paired, glu);
  }
#endif
  TORCH_CHECK(false, "linear: no kernel for ", x.scalar_type(), " in this build");
}

torch::Tensor grouped_linear(torch::Tensor x, std::vector<torch::Tensor> weights,
                             std::vector<int64_t> ends, int64_t out_features, bool paired,
                             bool glu) {
  TORCH_CHECK(x.dim() == 2, "grouped_linear: x must be [rows, in_features]");
  return grouped(x, weights, ends, c10::nullopt, out_features, false, paired, glu);
}
