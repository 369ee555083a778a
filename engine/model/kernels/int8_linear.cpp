// int8 W8A8 linears (compressed-tensors' int8 checkpoints, as vLLM's CPU backend serves
// them): y = (q_x . q_w) * s_x[row] * s_w[column] (+ b), the weights int8 with one scale
// per output column, the activations quantized to int8 per token at each call.
//
// Why a kernel of its own: the products are integer and exact, so the whole sum over K
// stays in int32 and is scaled once per output, where GGUF's formats scale every run of
// 32 (quant_linear.cpp). Half of bf16's weight bytes are read per step.
//
// Layout (int8_pack): the columns in vectors of 16, each vector contiguous over K (padded
// with zeros to whole 64s) as [K / 4 quads][16 columns][4 bytes]: one quad of 16 columns
// is a 512-bit register, vpdpbusd's operand, and 16 quads are an AMX B tile (64 k x 16
// columns, rows 64 bytes apart). Columns past N are zero.
//
// Kinds: AMX int8 (tdpbssd: signed x signed, 16-row blocks of x) where the CPU has it
// and Linux grants the tile state; AVX-512 VNNI (vpdpbusd: x is shifted to unsigned,
// x + 128, and 128 x the column's weight sum taken back); and plain loops the compiler
// vectorizes for any other CPU. All three give the same int32 sums, so the same outputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "amx.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define FLOTILLA_I8_VNNI 1
#else
#define FLOTILLA_I8_VNNI 0
#endif
#if FLOTILLA_I8_VNNI && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define FLOTILLA_I8_EMIT 1
#else
#define FLOTILLA_I8_EMIT 0
#endif
#if FLOTILLA_AMX && defined(__AMX_INT8__) && FLOTILLA_I8_VNNI
#define FLOTILLA_I8_AMX 1
#else
#define FLOTILLA_I8_AMX 0
#endif

namespace {

constexpr int64_t kC = 16;   // columns of a vector
constexpr int64_t kKB = 64;  // K is padded to whole 64s (an AMX tile's k)
constexpr int kNR = 3;       // vectors a work item multiplies (VNNI, plain: 3 x 8 zmm sums)
constexpr int kAmxNR = 4;    // AMX: two units of 2 vectors
constexpr int kMR = 8;       // rows a VNNI / plain tile holds

int64_t pad_k(int64_t k) { return (k + kKB - 1) / kKB * kKB; }

// kAuto: AMX, but VNNI for up to kVnniRows rows of x (one sequence's decode), where
// padding x to a 16-row tile costs more than it gains (Xeon with AMX, 2 threads, 1 row:
// 1536 x 576 in 18 us on VNNI, 24 on AMX; 8 rows: 43 against 24).
enum Kind : int { kUnresolved = -1, kPlain = 0, kVnni = 1, kAmx = 2, kAuto = 3 };
constexpr int64_t kVnniRows = 4;
std::atomic<int> g_kind{kUnresolved};

bool amx_runs() {
#if FLOTILLA_I8_AMX
  return flotilla::amx::granted();
#else
  return false;
#endif
}

Kind kind() {
  int k = g_kind.load(std::memory_order_relaxed);
  if (k == kUnresolved) {
    k = amx_runs() ? kAuto : FLOTILLA_I8_VNNI ? kVnni : kPlain;
    g_kind.store(k);
  }
  return Kind(k);
}

// Where a tile's sums go and how they are scaled: row r, vector column c of the item.
struct Out {
  void* y;
  bool bf16_out, float_out_rounded;
  int64_t ldy, ncols;        // ncols: valid columns of the item
  const float* sx;           // per row
  const float* sw;           // per column, from the item's first
  const float* bias;         // per column or null
  const int32_t* comp;       // VNNI: 128 x column sums, else null

  void emit(int64_t r, int64_t c0, const int32_t* acc) const {  // 16 sums of row r
    const int64_t lanes = std::min<int64_t>(kC, ncols - c0);
    if (lanes <= 0) return;
#if FLOTILLA_I8_EMIT
    const __mmask16 mask = lanes >= kC ? 0xFFFF : (1u << lanes) - 1;
    __m512i s = _mm512_maskz_loadu_epi32(mask, acc);
    if (comp) s = _mm512_sub_epi32(s, _mm512_maskz_loadu_epi32(mask, comp + c0));
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(s),
                             _mm512_mul_ps(_mm512_set1_ps(sx[r]), _mm512_maskz_loadu_ps(mask, sw + c0)));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + c0));
    if (bf16_out || float_out_rounded) {
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      if (bf16_out) {
        _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(y) + r * ldy + c0, mask, h);
        return;
      }
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    _mm512_mask_storeu_ps(static_cast<float*>(y) + r * ldy + c0, mask, v);
#else
    for (int64_t l = 0; l < lanes; ++l) {
      const int64_t c = c0 + l;
      float v = float(acc[l] - (comp ? comp[c] : 0)) * (sx[r] * sw[c]);
      if (bias) v += bias[c];
      if (bf16_out) {
        static_cast<c10::BFloat16*>(y)[r * ldy + c] = c10::BFloat16(v);
      } else {
        static_cast<float*>(y)[r * ldy + c] = float_out_rounded ? float(c10::BFloat16(v)) : v;
      }
    }
#endif
  }
};

// ---- plain loops (any CPU) ------------------------------------------------------------
void plain_item(const int8_t* x, int64_t lda, int64_t rows, const int8_t* w, int64_t kp,
                int vectors, const Out& out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* xr = x + r * lda;
    for (int j = 0; j < vectors; ++j) {
      const int8_t* b = w + j * kp * kC;
      int32_t acc[kC] = {};
      for (int64_t q = 0; q < kp / 4; ++q)
        for (int64_t c = 0; c < kC; ++c)
          for (int p = 0; p < 4; ++p)
            acc[c] += int32_t(xr[4 * q + p]) * int32_t(b[(q * kC + c) * 4 + p]);
      out.emit(r, j * kC, acc);
    }
  }
}

#if FLOTILLA_I8_VNNI
// ---- AVX-512 VNNI ------------------------------------------------------------------------
// x: unsigned (q + 128); R rows x W vectors of int32 sums in registers.
template <int R, int W>
void vnni_tile(const uint8_t* x, int64_t lda, const int8_t* w, int64_t kp, const Out& out,
               int64_t r0, int64_t c0) {
  // Every loop over the tile's rows and vectors unrolled, so GCC keeps the R x W sums
  // in registers: left to itself it kept the 8 x 3 array on the stack and reloaded
  // and stored each sum every k-step (36 % of vpdpbusd's peak on one Zen 4 core).
  __m512i acc[R][W];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t q = 0; q < kp / 4; ++q) {
    __m512i b[W];
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) b[j] = _mm512_loadu_si512(w + j * kp * kC + q * 64);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      int32_t quad;
      std::memcpy(&quad, x + i * lda + 4 * q, 4);
      const __m512i a = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
      for (int j = 0; j < W; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, b[j]);
    }
  }
  alignas(64) int32_t sums[kC];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) {
      _mm512_store_si512(sums, acc[i][j]);
      out.emit(r0 + i, c0 + j * kC, sums);
    }
}

template <int W, int R = kMR>
void vnni_rows(const uint8_t* x, int64_t lda, int64_t rows, const int8_t* w, int64_t kp,
               const Out& out, int64_t r0, int64_t c0) {
  if constexpr (R > 0) {
    if (rows >= R) {
      vnni_tile<R, W>(x, lda, w, kp, out, r0, c0);
      if (rows > R) vnni_rows<W, R>(x + R * lda, lda, rows - R, w, kp, out, r0 + R, c0);
      return;
    }
    vnni_rows<W, R - 1>(x, lda, rows, w, kp, out, r0, c0);
  }
}

void vnni_item(const uint8_t* x, int64_t lda, int64_t rows, const int8_t* w, int64_t kp,
               int vectors, const Out& out) {
  if (vectors == 3) return vnni_rows<3>(x, lda, rows, w, kp, out, 0, 0);
  if (vectors == 2) return vnni_rows<2>(x, lda, rows, w, kp, out, 0, 0);
  vnni_rows<1>(x, lda, rows, w, kp, out, 0, 0);
}
#endif

#if FLOTILLA_I8_AMX
// ---- AMX int8 ---------------------------------------------------------------------------
// A unit: up to 2 row blocks (16 rows each, x padded to whole blocks) x up to 2 vectors,
// the canonical 2 x 2 tile blocking: int32 sums in tiles 0-3 (block i, vector j: 2i + j),
// the A tiles (16 rows x 64 k) of both blocks in 4 and 5, the B tiles (a vector's 16
// quads) in 6 and 7. Each tile loaded once a k-step feeds two products; reloading one A
// tile per product (the first version) made each product wait for the one before it,
// ~3x slower (64 rows x 960 x 576, 2 threads: 73 us). The configuration is amx.h's.
template <int R, int W>
void amx_unit(const int8_t* x, int64_t lda, int64_t rows, const int8_t* w, int64_t kp,
              const Out& out, int64_t r0, int64_t c0) {
  _tile_zero(0); if constexpr (W > 1) _tile_zero(1);
  if constexpr (R > 1) { _tile_zero(2); if constexpr (W > 1) _tile_zero(3); }
  const int8_t* x1 = x + 16 * lda;
  const int8_t* w1 = w + kp * kC;
  for (int64_t s = 0; s < kp; s += kKB) {
    _tile_loadd(6, w + s * kC, 64);
    if constexpr (W > 1) _tile_loadd(7, w1 + s * kC, 64);
    _tile_loadd(4, x + s, lda);
    _tile_dpbssd(0, 4, 6);
    if constexpr (W > 1) _tile_dpbssd(1, 4, 7);
    if constexpr (R > 1) {
      _tile_loadd(5, x1 + s, lda);
      _tile_dpbssd(2, 5, 6);
      if constexpr (W > 1) _tile_dpbssd(3, 5, 7);
    }
  }
  alignas(64) int32_t acc[4][16 * 16];
  _tile_stored(0, acc[0], 64);
  if constexpr (W > 1) _tile_stored(1, acc[1], 64);
  if constexpr (R > 1) {
    _tile_stored(2, acc[2], 64);
    if constexpr (W > 1) _tile_stored(3, acc[3], 64);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < W; ++j)
      out.emit(r0 + r, c0 + j * kC, acc[2 * (r / 16) + j] + (r % 16) * 16);
}

template <int W>
void amx_rows(const int8_t* x, int64_t lda, int64_t rows, const int8_t* w, int64_t kp,
              const Out& out, int64_t c0) {
  int64_t m = 0;
  for (; m + 16 < rows; m += 32)
    amx_unit<2, W>(x + m * lda, lda, std::min<int64_t>(32, rows - m), w, kp, out, m, c0);
  if (m < rows) amx_unit<1, W>(x + m * lda, lda, rows - m, w, kp, out, m, c0);
}

void amx_item(const int8_t* x, int64_t lda, int64_t rows, const int8_t* w, int64_t kp,
              int vectors, const Out& out) {
  int j = 0;
  for (; j + 2 <= vectors; j += 2) amx_rows<2>(x, lda, rows, w + j * kp * kC, kp, out, j * kC);
  if (j < vectors) amx_rows<1>(x, lda, rows, w + j * kp * kC, kp, out, j * kC);
}
#endif

#if FLOTILLA_I8_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// Rows of x quantized to int8 ([rows padded to 16, kp], zero padding), each with its
// scale: dynamic (static_scale <= 0) amax / 127, symmetric, so |q| <= 127; or the
// checkpoint's static scale, clamped to [-128, 127]. unsigned_out: q + 128 (VNNI).
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int64_t kp, double static_scale,
                   bool unsigned_out, int8_t* q, float* sx) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * k;
      float scale = float(static_scale);
      if (static_scale <= 0) {
        float amax = 0.f;
        int64_t i = 0;
#if FLOTILLA_I8_VNNI
        __m512 vmax = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(row + i)));
        amax = _mm512_reduce_max_ps(vmax);
#endif
        for (; i < k; ++i) amax = std::max(amax, std::fabs(float(row[i])));
        scale = amax > 0.f ? amax / 127.f : 1.f;
      }
      sx[r] = scale;
      const float inv = 1.f / scale;
      const int flip = unsigned_out ? 0x80 : 0;
      int8_t* qr = q + r * kp;
      int64_t i = 0;
#if FLOTILLA_I8_VNNI
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m128i vflip = _mm_set1_epi8(char(flip));
      for (; i + 16 <= k; i += 16) {  // rounded to nearest even, saturated to [-128, 127]
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + i), vinv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + i),
                         _mm_xor_si128(_mm512_cvtsepi32_epi8(v), vflip));
      }
#endif
      for (; i < k; ++i) {
        const float v = std::nearbyint(float(row[i]) * inv);
        qr[i] = int8_t(int(std::min(127.f, std::max(-128.f, v))) ^ flip);
      }
      for (int64_t i = k; i < kp; ++i) qr[i] = int8_t(flip);
    }
  });
}

}  // namespace

std::vector<torch::Tensor> int8_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8,
              "int8_pack: an int8 [out, in] weight, got ", weight.scalar_type(), " of ",
              weight.dim(), " dims");
  const torch::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), kp = pad_k(k), vectors = (n + kC - 1) / kC;
  torch::Tensor packed = torch::zeros({vectors * kC * kp}, w.options());
  torch::Tensor comp = torch::zeros({vectors * kC}, w.options().dtype(torch::kInt32));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int8_t* base = dst + (row / kC) * kC * kp;
      const int64_t c = row % kC;
      int32_t sum = 0;
      for (int64_t i = 0; i < k; ++i) {
        base[((i / 4) * kC + c) * 4 + i % 4] = src[row * k + i];
        sum += src[row * k + i];
      }
      cp[row] = 128 * sum;
    }
  });
  return {packed, comp};
}

torch::Tensor int8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor comp,
                          torch::Tensor scales, c10::optional<torch::Tensor> bias, int64_t n,
                          double input_scale, bool float_out) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "int8_linear: float32 or bfloat16 input, not ", dtype);
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && comp.scalar_type() == torch::kInt32 &&
                  scales.scalar_type() == torch::kFloat32 && scales.numel() == n,
              "int8_linear: a weight from int8_pack and ", n, " float32 scales");
  const int64_t k = input.size(-1), kp = pad_k(k), vectors = (n + kC - 1) / kC;
  TORCH_CHECK(packed.numel() == vectors * kC * kp, "int8_linear: the packed weight does not hold ",
              n, " x ", k);
  const torch::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  const bool bf16 = dtype == torch::kBFloat16;
  torch::Tensor y = torch::empty({m, n}, input.options().dtype(
                                             float_out ? torch::kFloat32 : dtype));
  if (m == 0 || n == 0) return y.reshape(shape);
  torch::Tensor bias_f;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "int8_linear: a bias of ", bias->numel(), " for ", n,
                " outputs");
    bias_f = bias->to(torch::kFloat32).contiguous();
  }
  Kind kd = kind();
  if (kd == kAuto) kd = m <= kVnniRows ? kVnni : kAmx;
  const int64_t mp = (m + 15) / 16 * 16;
  torch::Tensor q = torch::empty({mp, kp}, x.options().dtype(torch::kInt8));
  torch::Tensor sx = torch::empty({m}, x.options().dtype(torch::kFloat32));
  if (mp > m) q.narrow(0, m, mp - m).zero_();
  if (bf16) {
    quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, kp, input_scale, kd == kVnni,
                  q.data_ptr<int8_t>(), sx.data_ptr<float>());
  } else {
    quantize_rows(x.data_ptr<float>(), m, k, kp, input_scale, kd == kVnni, q.data_ptr<int8_t>(),
                  sx.data_ptr<float>());
  }
  const torch::Tensor sw = scales.contiguous();
  const float* swp = sw.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int32_t* cp = kd == kVnni ? comp.data_ptr<int32_t>() : nullptr;
  const int8_t* qp = q.data_ptr<int8_t>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  // Work items (row chunk, panel of kNR vectors), chunk-major; rows are split only when
  // there are fewer panels than threads.
  const int64_t nr = kd == kAmx ? kAmxNR : kNR;
  const int64_t panels = (vectors + nr - 1) / nr, threads = at::get_num_threads();
  int64_t chunk_rows = mp;
  if (panels < threads && mp > 16) chunk_rows = std::max<int64_t>(16, (mp / threads + 15) / 16 * 16);
  const int64_t chunks = (m + chunk_rows - 1) / chunk_rows;
  at::parallel_for(0, chunks * panels, 1, [&](int64_t begin, int64_t end) {
#if FLOTILLA_I8_AMX
    std::unique_ptr<flotilla::amx::Tiles> tiles;
    if (kd == kAmx) tiles = std::make_unique<flotilla::amx::Tiles>();
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / panels, g = item % panels;
      const int64_t r0 = chunk * chunk_rows, rows = std::min(chunk_rows, m - r0);
      const int64_t c0 = g * nr * kC;
      const int nv = int(std::min<int64_t>(nr, vectors - g * nr));
      Out out{static_cast<char*>(y.data_ptr()) + (r0 * n + c0) * (float_out ? 4 : y.element_size()),
              bf16 && !float_out, bf16 && float_out, n, std::min<int64_t>(nv * kC, n - c0),
              sx.data_ptr<float>() + r0, swp + c0, bp ? bp + c0 : nullptr, cp ? cp + c0 : nullptr};
      const int8_t* a = qp + r0 * kp;
      const int8_t* w = wp + c0 * kp;
      switch (kd) {
#if FLOTILLA_I8_AMX
        case kAmx: amx_item(a, kp, rows, w, kp, nv, out); break;
#endif
#if FLOTILLA_I8_VNNI
        case kVnni:
          vnni_item(reinterpret_cast<const uint8_t*>(a), kp, rows, w, kp, nv, out);
          break;
#endif
        default: plain_item(a, kp, rows, w, kp, nv, out);
      }
    }
  });
  return y.reshape(shape);
}

std::vector<std::string> int8_kernels() {
  std::vector<std::string> names;
  if (amx_runs()) names.push_back("amx+vnni"), names.push_back("amx");
  if (FLOTILLA_I8_VNNI) names.push_back("vnni");
  names.push_back("plain");
  return names;
}

std::string int8_kernel() {
  const Kind k = kind();
  return k == kAuto ? "amx+vnni" : k == kAmx ? "amx" : k == kVnni ? "vnni" : "plain";
}

bool set_int8_kernel(const std::string& name) {
  if (name == "amx+vnni" && amx_runs()) { g_kind.store(kAuto); return true; }
  if (name == "plain") { g_kind.store(kPlain); return true; }
  if (name == "vnni" && FLOTILLA_I8_VNNI) { g_kind.store(kVnni); return true; }
  if (name == "amx" && amx_runs()) { g_kind.store(kAmx); return true; }
  return false;
}
