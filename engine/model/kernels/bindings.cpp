// Python bindings of the CPU kernels (one extension module, engine.model.kernels.cpu_kernels()).
#include <torch/extension.h>

#include "vec.h"

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                              torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start, double scale, double k_scale,
                              double v_scale, int64_t window,
                              c10::optional<torch::Tensor> sinks);
std::string attention_bf16_kernel();
bool set_attention_bf16_kernel(const std::string& name);
std::string attention_prefill_kernel();
bool set_attention_prefill_kernel(const std::string& name);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor x);
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor inv_temp, torch::Tensor u);
std::vector<std::string> linear_dtypes();
std::vector<std::string> linear_bf16_kernels();
std::string linear_bf16_kernel();
bool set_linear_bf16_kernel(const std::string& name);
torch::Tensor pack_linear(torch::Tensor weight, bool paired);
torch::Tensor grouped_linear(torch::Tensor x, std::vector<torch::Tensor> weights,
                             std::vector<int64_t> ends, int64_t out_features, bool paired,
                             bool glu);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                     int64_t out_features, bool float_out, bool paired, bool glu);
torch::Tensor gguf_dequantize(torch::Tensor raw, const std::string& format, int64_t columns,
                              torch::ScalarType dtype);
torch::Tensor gguf_linear(torch::Tensor input, torch::Tensor raw, const std::string& format,
                          c10::optional<torch::Tensor> bias, bool float_out, int64_t dense_rows);
std::string gguf_dot_kernel();
bool gguf_regroups();
torch::Tensor gguf_regroup(torch::Tensor raw, const std::string& format, int64_t k);
torch::Tensor gguf_regrouped_rows(torch::Tensor packed, const std::string& format, int64_t n,
                                  int64_t k, torch::Tensor ids, torch::ScalarType dtype);
torch::Tensor gguf_regrouped_linear(torch::Tensor input, torch::Tensor packed,
                                    const std::string& format, int64_t n,
                                    c10::optional<torch::Tensor> bias, bool float_out,
                                    int64_t dense_rows);
std::vector<torch::Tensor> int8_pack(torch::Tensor weight);
torch::Tensor int8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor comp,
                          torch::Tensor scales, c10::optional<torch::Tensor> bias, int64_t n,
                          double input_scale, bool float_out);
std::vector<std::string> int8_kernels();
std::string int8_kernel();
bool set_int8_kernel(const std::string& name);
torch::Tensor fp8_pack(torch::Tensor weight);
torch::Tensor fp8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor scales,
                         c10::optional<torch::Tensor> bias, int64_t n, bool float_out,
                         c10::optional<torch::Tensor> block_scales, int64_t block_k);
std::vector<std::string> fp8_kernels();
std::string fp8_kernel();
bool set_fp8_kernel(const std::string& name);
int64_t set_fp8_dense_rows(int64_t rows);
void bind_decoder_stack(pybind11::module& m);
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t num_rotated_heads, int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "write the step's keys/values to the paged KV cache, then attend causally (CPU); "
        "float8_e4m3fn caches hold x / k_scale and x / v_scale", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start"),
        py::arg("scale"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
        py::arg("window") = 0, py::arg("sinks") = py::none());
  m.def("attention_bf16_kernel", &attention_bf16_kernel,
        "the bf16 attention kernel in use: dpbf16, fma (both measured, the faster) or vec");
  m.def("set_attention_bf16_kernel", &set_attention_bf16_kernel,
        "force dpbf16 or fma for bf16 attention (False where the build has no dpbf16)");
  m.def("attention_prefill_kernel", &attention_prefill_kernel,
        "how bf16 prefill chunks are attended: amx (tile products) or rows (the per-row kernels)");
  m.def("set_attention_prefill_kernel", &set_attention_prefill_kernel,
        "force amx or rows for bf16 prefill chunks (False where AMX cannot run)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm, in place");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation");
  m.def("rotary_inplace", &rotary_inplace, "neox RoPE on q and k, in place");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (float32)");
  m.def("sample_rows", &sample_rows, "one draw per row from softmax(x / T) at a given uniform");
  m.def("linear_dtypes", &linear_dtypes, "the weight dtypes pack_linear and linear take here");
  m.def("linear_bf16_kernels", &linear_bf16_kernels,
        "the bf16 linear kernels this build, CPU and kernel can run, the default first");
  m.def("linear_bf16_kernel", &linear_bf16_kernel,
        "the bf16 linear kernel in use: amx (where the CPU and Linux allow it) or dpbf16; "
        "empty where the build has no bf16 linear");
  m.def("set_linear_bf16_kernel", &set_linear_bf16_kernel,
        "force amx or dpbf16 for bf16 linears (False where the build cannot run it); both "
        "read one packed layout");
  m.def("pack_linear", &pack_linear, "a linear's [out, in] weight in the layout linear reads; "
        "paired: the rows' two halves (gate, up) side by side, for glu",
        py::arg("weight"), py::arg("paired") = false);
  m.def("linear", &linear, "x @ W.T (+ bias) on a weight from pack_linear; float_out: "
        "float32 output holding the values rounded to x's dtype (logits); paired: the weight "
        "was packed paired; glu: write silu(first half) * second half (SwiGLU)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("float_out") = false, py::arg("paired") = false, py::arg("glu") = false);
  m.def("grouped_linear", &grouped_linear, "rows [ends[e-1], ends[e]) of x @ weights[e].T "
        "for every e (weights from pack_linear, one shape; a mixture of experts' experts) in "
        "one call; paired / glu as linear's",
        py::arg("x"), py::arg("weights"), py::arg("ends"), py::arg("out_features"),
        py::arg("paired") = false, py::arg("glu") = false);
  m.def("gguf_dequantize", &gguf_dequantize, "rows of GGUF blocks ([rows, bytes] uint8) "
        "decoded to float32 or bfloat16 [rows, columns]",
        py::arg("raw"), py::arg("format"), py::arg("columns"), py::arg("dtype"));
  m.def("gguf_linear", &gguf_linear, "x @ W.T (+ bias) with W as GGUF blocks: int8 dot "
        "products on the blocks up to dense_rows rows of x, a decoded weight and oneDNN past "
        "them; float_out: float32 output holding x-dtype-rounded values (logits)",
        py::arg("x"), py::arg("raw"), py::arg("format"), py::arg("bias"),
        py::arg("float_out") = false, py::arg("dense_rows") = 16);
  m.def("gguf_dot_kernel", &gguf_dot_kernel,
        "the integer dot product the GGUF kernels use here: vnni, avx2 or scalar");
  m.def("gguf_regroups", &gguf_regroups,
        "whether this build has the regrouped GGUF kernels (AVX-512 VNNI, or AVX2 + FMA + "
        "F16C): Q4_0, Q4_1 and Q8_0 weights regrouped 16 rows to a register");
  m.def("gguf_regroup", &gguf_regroup, "a [rows, bytes] Q4_0 / Q4_1 / Q8_0 weight of k "
        "columns regrouped for gguf_regrouped_linear", py::arg("raw"), py::arg("format"),
        py::arg("k"));
  m.def("gguf_regrouped_rows", &gguf_regrouped_rows, "rows ids of a regrouped weight decoded "
        "to float32 or bfloat16 (an embedding lookup)", py::arg("packed"), py::arg("format"),
        py::arg("n"), py::arg("k"), py::arg("ids"), py::arg("dtype"));
  m.def("gguf_regrouped_linear", &gguf_regrouped_linear, "x @ W.T (+ bias) on a regrouped "
        "weight of n rows: int8 dot products up to dense_rows rows of x, a decoded weight and "
        "oneDNN past them", py::arg("x"), py::arg("packed"), py::arg("format"), py::arg("n"),
        py::arg("bias"), py::arg("float_out") = false, py::arg("dense_rows") = 16);
  m.def("int8_pack", &int8_pack, "an int8 [out, in] weight in the layout int8_linear reads, "
        "and 128 x each column's weight sum (int32): [packed, comp]", py::arg("weight"));
  m.def("int8_linear", &int8_linear, "x @ W.T * scales (+ bias) on an int8 weight from "
        "int8_pack, x quantized to int8 per row (input_scale <= 0: dynamic amax / 127, else "
        "that static scale); float_out: float32 output holding x-dtype-rounded values",
        py::arg("x"), py::arg("packed"), py::arg("comp"), py::arg("scales"), py::arg("bias"),
        py::arg("n"), py::arg("input_scale") = 0.0, py::arg("float_out") = false);
  m.def("int8_kernels", &int8_kernels, "the int8 linear kernels this build, CPU and kernel "
        "can run, the default first: amx+vnni (AMX, VNNI for up to 4 rows), amx, vnni, plain");
  m.def("int8_kernel", &int8_kernel, "the int8 linear kernel in use");
  m.def("set_int8_kernel", &set_int8_kernel, "force amx+vnni, amx, vnni or plain for int8 linears "
        "(False where it cannot run); all read one packed layout and give the same sums");
  m.def("fp8_pack", &fp8_pack, "an e4m3 [out, in] weight (float8_e4m3fn or its bytes) in "
        "the layout fp8_linear reads", py::arg("weight"));
  m.def("fp8_linear", &fp8_linear, "x @ W.T * scales (+ bias) on an e4m3 weight from fp8_pack, "
        "widened in registers (x is not rounded to fp8); float_out: float32 output holding "
        "x-dtype-rounded values; block_scales [16-column vectors, K / block_k runs]: "
        "block-wise weights' scales", py::arg("x"), py::arg("packed"), py::arg("scales"),
        py::arg("bias"), py::arg("n"), py::arg("float_out") = false,
        py::arg("block_scales") = py::none(), py::arg("block_k") = 0);
  m.def("fp8_kernels", &fp8_kernels, "the fp8 linear kernels this build runs, the default "
        "first: avx512, plain");
  m.def("fp8_kernel", &fp8_kernel, "the fp8 linear kernel in use");
  m.def("set_fp8_kernel", &set_fp8_kernel, "force avx512 or plain for fp8 linears (False "
        "where it cannot run)");
  m.def("set_fp8_dense_rows", &set_fp8_dense_rows, "rows of x past which fp8 products decode "
        "the weight a panel at a time (w x scale in x's dtype) for at::matmul; returns the "
        "previous value", py::arg("rows"));
  bind_decoder_stack(m);
  m.attr("isa") = flotilla::vec::kIsa;  // the vector path built: avx512, avx2, neon, sse2
  m.attr("lanes") = flotilla::vec::L;
}
