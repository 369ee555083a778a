"""Model side: the Llama-family model (llama), its layers and native CPU kernels, the
checkpoint loader (safetensors, GGUF, the shipped default model) and huge-page backing
for weights and the KV cache. See docs/architecture.md."""
