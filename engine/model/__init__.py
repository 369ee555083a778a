"""Model side: the networks, one module per family under families/ (registry.py maps HF
architectures to them), their layers and native CPU kernels, the checkpoint loader
(safetensors, GGUF, the shipped default model) and huge-page backing for weights and
the KV cache. See docs/architecture.md."""
