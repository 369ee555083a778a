"""Speculative decoding: cheap proposers guess a request's next tokens, and one forward
pass of the model scores them all.

config.py holds the options (vLLM's speculative_config), registry.py the proposer
classes by method name (which the config checks a method against), proposers/ the
proposer family, token_index.py the suffix matching they share, verify.py the rows each
draft adds to the sampler and the accept rule, stats.py the acceptance counters behind
the vllm:spec_decode_* metrics.
"""
