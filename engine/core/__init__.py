"""Engine core: the step loop (engine_core), the interface every engine core implements
(interface), the stop rule it shares with the mock engine (stop_rule), the
continuous-batching scheduler, the paged KV cache manager with its prefix cache, and the
per-request state they share. Runs in the engine process; knows token ids only. See
docs/architecture.md."""
