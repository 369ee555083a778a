"""Structured outputs: constrain generation to a JSON schema, a regex, a choice or a grammar.

params: what a request asks for (travels inside SamplingParams over the wire).
grammar: turns it into an xgrammar Grammar (the frontend's validation) and compiles it
  against the tokenizer (the engine, cached, off the step loop).
manager: the engine core's per-request matchers and the step's token bitmask.

xgrammar was picked over llguidance on measured cost with this tokenizer (SmolLM2,
49,152 tokens, Zen 3): mask fill + accept 9-11 us a token against 35-41 us, and the
mask applied to 32 rows in 0.1 ms; llguidance's torch helper took 0.9 s for the same
32 rows on CPU. docs/benchmarks.md has the figures.
"""
