"""Attention backends: how a layer's queries attend to the paged KV cache.

One interface (base.AttentionBackend) that the runner, the step inputs, the KV budget
and the model layers ask (what a backend refuses, its cache layout, its step and CUDA
graph metadata, its forward over the cache), one module per backend with its own
metadata type (native, torch_sdpa, flex, triton), and a registry (registry.py) that
the attention_backend option and its `auto` choice consult. names.py lists the names
without torch, for the configuration.

Every step first writes the new keys and values of all scheduled tokens into their
cache slots, then attends. Because the writes of a layer precede its reads, a request
may read blocks that another request fills in the same step (prefix-cache hits on
blocks scheduled in the same batch stay correct).

Sliding windows (a layer's `window` > 0): a query at position p sees keys
p - window + 1 .. p. Blocks wholly before every window may have been freed by the KV
cache manager: their table entries then name its null block, which is never read (the
kernels) or only read masked (the torch path: the null block holds zeros, never NaN).

Attention sinks (gpt-oss; a float32 logit per query head): each softmax's denominator
gains exp(sink) as if from a key with no value.

kv_cache_dtype fp8: the cache holds keys / k_scale and values / v_scale in e4m3 (the
layer's scales); every backend that reads it widens them to the activation dtype, with
the scales applied to the scores and the output.

This file imports nothing, so that names.py stays torch-free.
"""
