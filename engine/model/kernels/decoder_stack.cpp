// A Llama-family decoder's layers run in one call, on the kernels of the other files.
//
// Why: a decode step of one sequence is ~15 small operations a layer, each a Python
// module call and a dispatch of its own. On the default model (30 layers) that came to
// ~3 ms a token on a Xeon with AMX (2 cores), as much as its weights' GGUF products took,
// so one sequence decoded at ~100 tokens/s where its weights allow ~250. Here the same
// operations, in the same order and with the same kernels (so the same values), are
// called from C++: the stack is the model's forward for the paths it holds (the native
// CPU attention, linears packed for the native kernels or held as GGUF blocks, no LoRA,
// no tensor parallelism, no q/k norm), and Python runs it otherwise.
#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                              torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, double scale, double k_scale,
                              double v_scale, int64_t window,
                              c10::optional<torch::Tensor> sinks);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_rotated_heads, int64_t head_dim);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                     int64_t out_features, bool float_out, bool paired, bool glu);
torch::Tensor gguf_linear(torch::Tensor input, torch::Tensor raw, const std::string& format,
                          c10::optional<torch::Tensor> bias, bool float_out, int64_t dense_rows);
torch::Tensor gguf_regrouped_linear(torch::Tensor input, torch::Tensor packed,
                                    const std::string& format, int64_t n,
                                    c10::optional<torch::Tensor> bias, bool float_out,
                                    int64_t dense_rows);
torch::Tensor int8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor comp,
                          torch::Tensor scales, c10::optional<torch::Tensor> bias, int64_t n,
                          double input_scale, bool float_out);
torch::Tensor fp8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor scales,
                         c10::optional<torch::Tensor> bias, int64_t n, bool float_out,
                         c10::optional<torch::Tensor> block_scales, int64_t block_k);

namespace {

// One linear as the layer holds it: packed for linear.cpp ("native", paired: gate|up
// side by side), GGUF blocks in the file's layout ("gguf") or regrouped
// ("gguf_regrouped"), in row segments of one format each (a fused q/k/v may mix them), or
// int8 W8A8 ("int8": extras are int8_linear's comp and scales, input_scale its own), or
// fp8 weights ("fp8": extras are fp8_linear's scales, then for block-wise weights its
// block scales and a one-element int64 tensor holding block_k, read once here).
struct Segment {
  std::string kind, format;
  torch::Tensor weight;
  int64_t rows;
  std::vector<torch::Tensor> extras;
  double input_scale;
  int64_t block_k = 0;
};

struct LinearSpec {
  std::vector<Segment> segments;
  c10::optional<torch::Tensor> bias;
  bool paired;

  static torch::Tensor product(const Segment& s, const torch::Tensor& x,
                               const c10::optional<torch::Tensor>& bias, bool paired,
                               int64_t dense_rows) {
    if (s.kind == "native") return linear(x, s.weight, bias, s.rows, false, paired, false);
    if (s.kind == "gguf") return gguf_linear(x, s.weight, s.format, bias, false, dense_rows);
    if (s.kind == "int8")
      return int8_linear(x, s.weight, s.extras[0], s.extras[1], bias, s.rows, s.input_scale, false);
    if (s.kind == "fp8") {
      c10::optional<torch::Tensor> blocks;
      if (s.block_k) blocks = s.extras[1];
      return fp8_linear(x, s.weight, s.extras[0], bias, s.rows, false, blocks, s.block_k);
    }
    return gguf_regrouped_linear(x, s.weight, s.format, s.rows, bias, false, dense_rows);
  }

  torch::Tensor operator()(const torch::Tensor& x, int64_t dense_rows) const {
    if (segments.size() == 1) return product(segments[0], x, bias, paired, dense_rows);
    std::vector<torch::Tensor> outs;
    int64_t at = 0;
    for (const Segment& s : segments) {
      c10::optional<torch::Tensor> b;
      if (bias) b = bias->narrow(0, at, s.rows);
      outs.push_back(product(s, x, b, false, dense_rows));
      at += s.rows;
    }
    return torch::cat(outs, -1);
  }
  // silu(gate) * up of a [gate | up] layer: in the product's own pass where it is paired
  torch::Tensor glu(const torch::Tensor& x, int64_t dense_rows) const {
    if (segments.size() == 1 && segments[0].kind == "native" && paired)
      return linear(x, segments[0].weight, bias, segments[0].rows, false, true, true);
    return silu_and_mul((*this)(x, dense_rows));
  }
};

using SegmentArgs = std::vector<std::tuple<std::string, torch::Tensor, std::string, int64_t,
                                           std::vector<torch::Tensor>, double>>;
using LinearArgs = std::tuple<SegmentArgs, c10::optional<torch::Tensor>, bool>;

LinearSpec spec_of(const LinearArgs& args) {
  const auto& [segments, bias, paired] = args;
  TORCH_CHECK(!segments.empty(), "DecoderStack: a linear without segments");
  LinearSpec spec{{}, bias, paired};
  for (const auto& [kind, weight, format, rows, extras, input_scale] : segments) {
    TORCH_CHECK(kind == "native" || kind == "gguf" || kind == "gguf_regrouped" ||
                    (kind == "int8" && extras.size() == 2) ||
                    (kind == "fp8" && (extras.size() == 1 || extras.size() == 3)),
                "DecoderStack: no linear of kind ", kind);
    const int64_t block_k = kind == "fp8" && extras.size() == 3 ? extras[2].item<int64_t>() : 0;
    spec.segments.push_back(Segment{kind, format, weight, rows, extras, input_scale, block_k});
  }
  return spec;
}

struct Layer {
  torch::Tensor input_norm, post_norm;
  LinearSpec qkv, o, gate_up, down;
  double k_scale, v_scale;  // an fp8 cache's (1 otherwise)
};

}  // namespace

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale, torch::Tensor final_norm)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        scale_(scale), final_norm_(final_norm) {}

  // Linears qkv, o, gate_up, down, each ([(kind, weight, format, rows, extras,
  // input_scale), ...], bias or None, paired); k_scale, v_scale: an fp8 cache's.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm,
                 const std::vector<LinearArgs>& linears, double k_scale, double v_scale) {
    TORCH_CHECK(linears.size() == 4, "DecoderStack.add_layer: qkv, o, gate_up and down");
    layers_.push_back(Layer{input_norm, post_norm, spec_of(linears[0]), spec_of(linears[1]),
                            spec_of(linears[2]), spec_of(linears[3]), k_scale, v_scale});
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // The final norm's output for embedded tokens x [T, hidden]; keys / values: each
  // layer's cache views (engine.model.attention.block_major.cache_views).
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_table,
                        torch::Tensor sin_table, const std::vector<torch::Tensor>& keys,
                        const std::vector<torch::Tensor>& values, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor seq_lens,
                        torch::Tensor query_start, int64_t dense_rows) const {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(),
                "DecoderStack.forward: one cache per layer");
    const int64_t t = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    torch::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (!residual.defined()) {  // the first layer: norm(x), as RMSNorm._norm computes it
        residual = x;
        x = norm(x, l.input_norm);
      } else {
        fused_add_rms_norm(x, residual, l.input_norm, eps_);
      }
      torch::Tensor qkv = l.qkv(x, dense_rows);
      rotary_inplace(qkv, positions, cos_table, sin_table, heads_ + kv_heads_, head_dim_);
      auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      torch::Tensor attn = paged_attention(
          parts[0].view({t, heads_, head_dim_}), parts[1].view({t, kv_heads_, head_dim_}),
          parts[2].view({t, kv_heads_, head_dim_}), keys[i], values[i], slots, block_tables,
          seq_lens, query_start, scale_, l.k_scale, l.v_scale, 0, c10::nullopt);
      x = l.o(attn.reshape({t, q_size}), dense_rows);
      fused_add_rms_norm(x, residual, l.post_norm, eps_);
      x = l.down(l.gate_up.glu(x, dense_rows), dense_rows);
    }
    fused_add_rms_norm(x, residual, final_norm_, eps_);
    return x;
  }

 private:
  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& weight) const {
    const int64_t h = x.size(-1);
    if (x.scalar_type() == torch::kFloat32) return at::rms_norm(x, {h}, weight, eps_);
    return weight * at::rms_norm(x.to(torch::kFloat32), {h}, c10::nullopt, eps_).to(x.scalar_type());
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};

void bind_decoder_stack(pybind11::module& m) {
  // module_local: each kernel build (native, AVX2, SSE2) is its own module in one process
  pybind11::class_<DecoderStack>(m, "DecoderStack", pybind11::module_local(),
                                 "a Llama-family decoder's layers run in one call "
                                 "(engine.model.stack)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor>(),
           pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("final_norm"))
      .def("add_layer", &DecoderStack::add_layer, pybind11::arg("input_norm"),
           pybind11::arg("post_norm"), pybind11::arg("linears"), pybind11::arg("k_scale") = 1.0,
           pybind11::arg("v_scale") = 1.0)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward);
}
