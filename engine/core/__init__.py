"""Engine core: the step loop (engine_core), the continuous-batching scheduler, the
paged KV cache manager with its prefix cache, and the per-request state they share.
Runs in the engine process; knows token ids only. See docs/architecture.md."""
