// GGUF's 32-weight formats (Q4_0, Q4_1, Q8_0) regrouped at load so that one AVX-512
// register holds the same 4 weights of 16 rows, multiplied with VNNI (vpdpbusd); AVX2
// CPUs multiply the same layout a ymm half (8 rows) at a time with vpmaddubsw +
// vpmaddwd (quant_regrouped_avx2.h).
//
// Why: the file's layout keeps each row's blocks together, so a kernel reading it works
// one row at a time: a run of 32 weights costs ~15 instructions (unpack, two half-floats
// converted, a dot product, its scaling and a horizontal sum at the end), and one
// sequence's decode on the default model was bound by those, not by memory (measured
// 8 GB/s of weights on a Xeon with AMX, 2 cores, against ~25 GB/s to be had).
// Regrouped, a 32-bit lane is a row: vpdpbusd multiplies 4 weights of 16 rows with 4
// activations broadcast to every lane, the lanes end a run as 16 rows' integer sums,
// and their scales arrive as 16 contiguous halves (one vcvtph2ps). A run of 16 rows
// takes ~30 instructions: about 2 a row, where it took 15.
//
// The bytes are the file's own, regrouped; every weight keeps its bits (Q8_0's int8 is
// stored as its unsigned offset q + 128, vpdpbusd's unsigned operand, and 128 * d is
// taken back as a min). Per group of 16 rows (zero rows past N) and 32-weight run:
//   d[16] f16 | m[16] f16 (Q4_1 only) | q: words w = 0..W-1, each 16 rows x 4 bytes
// A Q4 word w holds bytes 4w..4w+3 of a row's 16 nibble bytes: low nibbles are weights
// 4w..4w+3, high ones 16+4w..16+4w+3 (W = 4). A Q8_0 word holds weights 4w..4w+3 (W = 8).
// Activations are quantized to int8 runs as in quant_linear.cpp; the dot products are
// exact, and the error against the decoded weights in float32 is the activations' only.
#include "quant_regrouped.h"
#include "quant_regrouped_avx2.h"

// linear.cpp: the float32 tile kernels and their packed layout (the AVX2 prompt path)
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                     int64_t out_features, bool float_out, bool paired, bool glu);
std::vector<int64_t> linear_f32_layout();

namespace {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Row `row`'s weights of run r, decoded from a regrouped group (scalar; lookups, and the
// dense path's decode).
void decode_run(const Shape& s, const uint8_t* grun, int64_t lane, float* out) {
  const float d = half_at(grun + 2 * lane);
  const float m = s.kind == kQ4_1 ? half_at(grun + 2 * kGroup + 2 * lane) : 0.f;
  const uint8_t* q = grun + 2 * kGroup * s.halves();
  for (int64_t w = 0; w < s.words(); ++w) {
    const uint8_t* word = q + (w * kGroup + lane) * 4;
    for (int b = 0; b < 4; ++b) {
      if (s.kind == kQ8_0) {
        out[4 * w + b] = d * float(int(word[b]) - 128);
      } else {
        const float lo = float(word[b] & 0xF), hi = float(word[b] >> 4);
        out[4 * w + b] = s.kind == kQ4_0 ? d * (lo - 8.f) : d * lo + m;
        out[16 + 4 * w + b] = s.kind == kQ4_0 ? d * (hi - 8.f) : d * hi + m;
      }
    }
  }
}

template <typename T>
void decode_rows(const Shape& s, const uint8_t* packed, const int64_t* ids, int64_t count,
                 T* out) {
  at::parallel_for(0, count, 8, [&](int64_t i0, int64_t i1) {
    float run[32];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = ids ? ids[i] : i, g = row / kGroup, lane = row % kGroup;
      for (int64_t r = 0; r < s.runs; ++r) {
        decode_run(s, s.run(packed, g, r), lane, run);
        for (int j = 0; j < 32; ++j) out[i * s.k + r * 32 + j] = flotilla::from_float<T>(run[j]);
      }
    }
  });
}

#if FLOTILLA_QR
constexpr int kMaxRows = 4;  // rows of x a pass takes: a float accumulator each

// y[i0 .. i0+MT, 16 rows of group g]: float sums of the group's 16 lanes per x row.
// A run's integer sums go to C independent accumulators per x row (vpdpbusd's latency
// is 5 cycles: one chain of 8 left a row at a dot product every 5 of them), then the
// scaled sum and the min term go into one float accumulator, as block_tile's.
template <int K, int MT>
void group_tile(const Shape& s, const uint8_t* packed, int64_t g, const Activations& a,
                int64_t i0, __m512 (&acc)[kMaxRows]) {
  constexpr int C = MT == 1 ? 4 : 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
  const int8_t* xq[MT];
  for (int t = 0; t < MT; ++t) xq[t] = a.q.data() + (i0 + t) * s.k;
  const int64_t rb = s.run_bytes();
  for (int64_t r = 0; r < s.runs; ++r) {
    const uint8_t* grun = s.run(packed, g, r);
    // the weights kAhead runs on (this group's or the next one's: they are contiguous),
    // requested now, so the stream from memory runs ahead of the products
    for (int64_t l = 0; l < rb; l += 64) _mm_prefetch(reinterpret_cast<const char*>(grun + kAhead * rb + l), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grun)));
    __m512 m;
    if constexpr (K == kQ4_1) {
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grun + 32)));
    } else if constexpr (K == kQ4_0) {
      m = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
    } else {
      m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    }
    const uint8_t* q = grun + 2 * kGroup * (K == kQ4_1 ? 2 : 1);
    __m512i dot[MT][C];
    for (int t = 0; t < MT; ++t)
      for (int c = 0; c < C; ++c) dot[t][c] = _mm512_setzero_si512();
    if constexpr (K == kQ8_0) {
      for (int w = 0; w < 8; ++w) {
        const __m512i ws = _mm512_loadu_si512(q + w * 64);
        for (int t = 0; t < MT; ++t) {
          int32_t xw;
          std::memcpy(&xw, xq[t] + r * 32 + 4 * w, 4);
          dot[t][w % C] = _mm512_dpbusd_epi32(dot[t][w % C], ws, _mm512_set1_epi32(xw));
        }
      }
    } else {
      for (int w = 0; w < 4; ++w) {
        const __m512i bytes = _mm512_loadu_si512(q + w * 64);
        const __m512i lo = _mm512_and_si512(bytes, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        for (int t = 0; t < MT; ++t) {
          int32_t xl, xh;
          std::memcpy(&xl, xq[t] + r * 32 + 4 * w, 4);
          std::memcpy(&xh, xq[t] + r * 32 + 16 + 4 * w, 4);
          dot[t][w % C] = _mm512_dpbusd_epi32(dot[t][w % C], lo, _mm512_set1_epi32(xl));
          dot[t][(w + C / 2) % C] =
              _mm512_dpbusd_epi32(dot[t][(w + C / 2) % C], hi, _mm512_set1_epi32(xh));
        }
      }
    }
    for (int t = 0; t < MT; ++t) {
      __m512i sum = dot[t][0];
      for (int c = 1; c < C; ++c) sum = _mm512_add_epi32(sum, dot[t][c]);
      const int64_t at = (i0 + t) * s.runs + r;
      // the same two fused steps, in the same order, as block_tile: a row's result does
      // not depend on how many rows shared its call (the int8 sums are exact)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                               _mm512_mul_ps(d, _mm512_set1_ps(a.d[at])), acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[at]), acc[t]);
    }
  }
}

// The weight decoded to W^T [k, n] (n padded to whole groups): a group's 16 lanes are 16
// consecutive columns of a row of W^T, so each 4-weight word decodes to 4 (Q8_0) or 8
// (Q4) stores of 16 values. For the dense path, which multiplies x @ W^T with oneDNN.
template <int K, typename T>
void decode_transposed(const Shape& s, const uint8_t* packed, int64_t first, int64_t last,
                       T* out, int64_t ld) {
  at::parallel_for(first, last, 1, [&](int64_t g0, int64_t g1) {
    const __m512i low = _mm512_set1_epi32(K == kQ8_0 ? 0xFF : 0x0F);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < s.runs; ++r) {
        const uint8_t* grun = s.run(packed, g, r);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grun)));
        __m512 m;
        if constexpr (K == kQ4_1) {
          m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grun + 32)));
        } else {
          m = _mm512_mul_ps(d, _mm512_set1_ps(K == kQ4_0 ? -8.f : -128.f));
        }
        const uint8_t* q = grun + 2 * kGroup * (K == kQ4_1 ? 2 : 1);
        T* col = out + r * 32 * ld + (g - first) * kGroup;
        auto put = [&](int64_t kk, __m512i v) {
          const __m512 w = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(v), m);
          if constexpr (std::is_same_v<T, float>) {
            _mm512_storeu_ps(col + kk * ld, w);
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + kk * ld),
                                flotilla::to_bf16_bits(w));
          }
        };
        for (int64_t w = 0; w < s.words(); ++w) {
          const __m512i word = _mm512_loadu_si512(q + w * 64);
          for (int b = 0; b < 4; ++b) {
            const __m512i byte = _mm512_srli_epi32(word, 8 * b);
            if constexpr (K == kQ8_0) {
              put(4 * w + b, _mm512_and_si512(byte, low));
            } else {
              put(4 * w + b, _mm512_and_si512(byte, low));
              put(16 + 4 * w + b, _mm512_and_si512(_mm512_srli_epi32(byte, 4), low));
            }
          }
        }
      }
  });
}

#endif

#if FLOTILLA_QR_PRODUCTS
// x @ W^T for many rows of x: the weight decoded a panel of kPanelGroups groups at a time
// into W^T's columns (a buffer that stays in cache; decoding all of a 49152-row LM head
// at once wrote 56 MB at a stride of 98 KB and took 28 ms), each panel multiplied by
// oneDNN into its columns of y.
constexpr int64_t kPanelGroups = 64;

torch::Tensor dense_product(const Shape& s, const torch::Tensor& x, const torch::Tensor& packed,
                            torch::ScalarType dtype) {
  const int64_t m = x.size(0);
  torch::Tensor y = torch::empty({m, s.n}, x.options().dtype(dtype));
  torch::Tensor panel = torch::empty({s.k, kPanelGroups * kGroup}, x.options().dtype(dtype));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  for (int64_t g0 = 0; g0 < s.groups; g0 += kPanelGroups) {
    const int64_t g1 = std::min(s.groups, g0 + kPanelGroups), ld = panel.size(1);
    auto run = [&](auto* o) {
      switch (s.kind) {
        case kQ4_0: return decode_transposed<kQ4_0>(s, p, g0, g1, o, ld);
        case kQ4_1: return decode_transposed<kQ4_1>(s, p, g0, g1, o, ld);
        case kQ8_0: return decode_transposed<kQ8_0>(s, p, g0, g1, o, ld);
      }
    };
    if (dtype == torch::kFloat32) {
      run(panel.data_ptr<float>());
    } else {
      run(panel.data_ptr<c10::BFloat16>());
    }
    const int64_t c0 = g0 * kGroup, cols = std::min(s.n, g1 * kGroup) - c0;
    y.narrow(1, c0, cols).copy_(at::matmul(x, panel.narrow(1, 0, cols)));
  }
  return y;
}
#endif

#if FLOTILLA_QR_AVX2
// x @ W^T in float32 on AVX2 for a step with prompt tokens: the weight decoded, kChunkGroups
// groups at a time, straight into linear.cpp's packed float32 panels (column vectors of
// 8, 3 to a panel, each panel [k][its columns]) and multiplied by its tile kernels, which
// run a step's float32 linears about 1.2x faster than oneDNN on an unpacked W^T (Zen 4
// held to x86-64-v3, a layer at 512 rows: 18.2 against 21.3 ms; dense_product's
// decode, matmul and copy: 25.9). The chunk is a whole number of panels and groups.
constexpr int64_t kChunkGroups = 48;  // 768 columns: 32 panels of 24

torch::Tensor native_product(const Shape& s, const torch::Tensor& x, const torch::Tensor& packed) {
  const std::vector<int64_t> layout = linear_f32_layout();
  const int64_t vw = layout[0], nr = layout[1];
  TORCH_CHECK(vw == kHalf && (kChunkGroups * kGroup) % (vw * nr) == 0,
              "gguf regrouped kernels: linear's float32 layout (", vw, " x ", nr,
              ") is not the one they decode into");
  const int64_t m = x.size(0), k = s.k;
  torch::Tensor buf = torch::empty({kChunkGroups * kGroup * k}, x.options());
  float* out = buf.data_ptr<float>();
  const uint8_t* p = packed.data_ptr<uint8_t>();
  torch::Tensor y;
  for (int64_t g0 = 0; g0 < s.groups; g0 += kChunkGroups) {
    const int64_t g1 = std::min(s.groups, g0 + kChunkGroups);
    const int64_t c0 = g0 * kGroup, cols = std::min(s.n, g1 * kGroup) - c0;
    const int64_t vectors = (cols + vw - 1) / vw, panel = nr * vw * k;
    auto where = [&](int64_t g, int h) {
      const int64_t v = (g - g0) * 2 + h;  // this half's column vector in the chunk
      if (v >= vectors) return std::pair<float*, int64_t>(nullptr, 0);
      const int64_t width = std::min<int64_t>(nr, vectors - v / nr * nr) * vw;
      return std::pair<float*, int64_t>(out + v / nr * panel + v % nr * vw, width);
    };
    switch (s.kind) {
      case kQ4_0: decode_columns<kQ4_0, float>(s, p, g0, g1, where); break;
      case kQ4_1: decode_columns<kQ4_1, float>(s, p, g0, g1, where); break;
      case kQ8_0: decode_columns<kQ8_0, float>(s, p, g0, g1, where); break;
    }
    torch::Tensor part = linear(x, buf.narrow(0, 0, vectors * vw * k), c10::nullopt, cols,
                                false, false, false);
    if (g0 == 0 && g1 == s.groups) return part;
    if (!y.defined()) y = torch::empty({m, s.n}, x.options());
    y.narrow(1, c0, cols).copy_(part);
  }
  return y;
}
#endif

#if FLOTILLA_QR
template <int K, int MT = kMaxRows>
void group_any(int mt, const Shape& s, const uint8_t* packed, int64_t g, const Activations& a,
               int64_t i0, __m512 (&acc)[kMaxRows]) {
  if constexpr (MT > 0) {
    if (mt == MT) return group_tile<K, MT>(s, packed, g, a, i0, acc);
    group_any<K, MT - 1>(mt, s, packed, g, a, i0, acc);
  }
}

template <int K, typename T, typename O>
void matmul(const Shape& s, const T* x, int64_t m, const uint8_t* packed, const float* bias,
            O* y) {
  const Activations a = quantize(x, m, s.k);
  if (m >= kManyRows) return matmul_rows<K, T>(s, a, m, packed, bias, y);
  at::parallel_for(0, s.groups, 2, [&](int64_t g0, int64_t g1) {
    __m512 acc[kMaxRows];
    alignas(64) float lanes[kGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j0 = g * kGroup, cols = std::min<int64_t>(kGroup, s.n - j0);
      for (int64_t i0 = 0; i0 < m; i0 += kMaxRows) {
        const int mt = int(std::min<int64_t>(kMaxRows, m - i0));
        group_any<K>(mt, s, packed, g, a, i0, acc);
        for (int t = 0; t < mt; ++t) {
          _mm512_store_ps(lanes, acc[t]);
          O* dst = y + (i0 + t) * s.n + j0;
          for (int64_t j = 0; j < cols; ++j) {
            const float v = lanes[j] + (bias ? bias[j0 + j] : 0.f);
            if constexpr (std::is_same_v<O, float> && !std::is_same_v<T, float>) {
              dst[j] = flotilla::round_to<T>(v);  // logits: x's dtype, widened
            } else {
              dst[j] = flotilla::from_float<O>(v);
            }
          }
        }
      }
    }
  });
}
#endif

#if FLOTILLA_QR_PRODUCTS
template <typename T, typename O>
void dispatch(const Shape& s, const T* x, int64_t m, const uint8_t* packed, const float* bias,
              O* y) {
  switch (s.kind) {
    case kQ4_0: return matmul<kQ4_0>(s, x, m, packed, bias, y);
    case kQ4_1: return matmul<kQ4_1>(s, x, m, packed, bias, y);
    case kQ8_0: return matmul<kQ8_0>(s, x, m, packed, bias, y);
  }
}
#endif

torch::Tensor decoded(const Shape& s, const torch::Tensor& packed, const int64_t* ids,
                      int64_t count, torch::ScalarType dtype) {
  torch::Tensor out = torch::empty({count, s.k}, packed.options().dtype(dtype));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  if (dtype == torch::kFloat32) {
    decode_rows(s, p, ids, count, out.data_ptr<float>());
  } else if (dtype == torch::kBFloat16) {
    decode_rows(s, p, ids, count, out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "gguf regrouped kernels: float32 or bfloat16 output, not ", dtype);
  }
  return out;
}

Shape checked(const torch::Tensor& packed, const std::string& format, int64_t n, int64_t k) {
  const Shape s = shape_of(parse_kind(format), n, k);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.numel() == s.numel(),
              "gguf regrouped kernels: the weight is not ", n, " x ", k, " ", format,
              " regrouped by gguf_regroup");
  return s;
}

}  // namespace

bool gguf_regroups() { return FLOTILLA_QR_PRODUCTS; }

torch::Tensor gguf_regroup(torch::Tensor raw, const std::string& format, int64_t k) {
  const Shape s = shape_of(parse_kind(format), raw.size(0), k);
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous() &&
                  raw.size(1) == s.runs * s.file_block(),
              "gguf_regroup: ", format, " rows of ", k, " weights take ", s.runs * s.file_block(),
              " bytes");
  torch::Tensor out = torch::zeros({s.numel()}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, s.groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < s.runs; ++r) {
        uint8_t* grun = dst + (g * s.runs + r) * s.run_bytes();
        for (int64_t lane = 0; lane < kGroup && g * kGroup + lane < s.n; ++lane) {
          const uint8_t* block = src + (g * kGroup + lane) * raw.size(1) + r * s.file_block();
          std::memcpy(grun + 2 * lane, block, 2);  // d
          if (s.kind == kQ4_1) std::memcpy(grun + 2 * kGroup + 2 * lane, block + 2, 2);  // m
          uint8_t* q = grun + 2 * kGroup * s.halves();
          for (int64_t w = 0; w < s.words(); ++w)
            for (int b = 0; b < 4; ++b) {
              const uint8_t v = block[s.qs_at() + 4 * w + b];
              q[(w * kGroup + lane) * 4 + b] = s.kind == kQ8_0 ? uint8_t(v ^ 0x80) : v;
            }
        }
      }
  });
  return out;
}

torch::Tensor gguf_regrouped_rows(torch::Tensor packed, const std::string& format, int64_t n,
                                  int64_t k, torch::Tensor ids, torch::ScalarType dtype) {
  const Shape s = checked(packed, format, n, k);
  torch::Tensor flat = ids.reshape({-1}).to(torch::kInt64).contiguous();
  const int64_t* p = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < n, "gguf_regrouped_rows: row ", p[i], " of ", n);
  return decoded(s, packed, p, flat.numel(), dtype);
}

torch::Tensor gguf_regrouped_linear(torch::Tensor input, torch::Tensor packed,
                                    const std::string& format, int64_t n,
                                    c10::optional<torch::Tensor> bias, bool float_out,
                                    int64_t dense_rows) {
  const int64_t k = input.size(-1);
  const Shape s = checked(packed, format, n, k);
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
              "gguf_regrouped_linear: float32 or bfloat16 input, not ", dtype);
  torch::Tensor x = input.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  const bool has_bias = bias && bias->defined();
  if (m > dense_rows || !FLOTILLA_QR_PRODUCTS) {  // compute-bound: decode once, oneDNN multiplies
#if FLOTILLA_QR_PRODUCTS
#if FLOTILLA_QR_AVX2
    torch::Tensor y = dtype == torch::kFloat32 ? native_product(s, x, packed)
                                               : dense_product(s, x, packed, dtype);
#else
    torch::Tensor y = dense_product(s, x, packed, dtype);
#endif
    if (has_bias) y.add_(bias->to(dtype));
#else
    torch::Tensor w = decoded(s, packed, nullptr, n, dtype);
    torch::Tensor y = at::linear(x, w, has_bias ? c10::optional<torch::Tensor>(bias->to(dtype))
                                                : c10::nullopt);
#endif
    return (float_out ? y.to(torch::kFloat32) : y).reshape(shape);
  }
#if FLOTILLA_QR_PRODUCTS
  torch::Tensor bf;
  if (has_bias) {
    TORCH_CHECK(bias->numel() == n, "gguf_regrouped_linear: a bias of ", bias->numel(), " for ",
                n, " rows");
    bf = bias->to(dtype).to(torch::kFloat32).contiguous();  // held in x's dtype
  }
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  torch::Tensor y = torch::empty({m, n}, x.options().dtype(float_out ? torch::kFloat32 : dtype));
  if (m == 0 || n == 0) return y.reshape(shape);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (dtype == torch::kFloat32) {
    dispatch(s, x.data_ptr<float>(), m, w, bp, y.data_ptr<float>());
  } else if (float_out) {
    dispatch(s, x.data_ptr<c10::BFloat16>(), m, w, bp, y.data_ptr<float>());
  } else {
    dispatch(s, x.data_ptr<c10::BFloat16>(), m, w, bp, y.data_ptr<c10::BFloat16>());
  }
  return y.reshape(shape);
#else
  TORCH_CHECK(false, "unreachable: this build decodes every regrouped product");
#endif
}
