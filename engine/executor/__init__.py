"""Executor side: the model runner that turns a scheduled step into one forward pass and
sampled tokens (model_runner, sampler), and tensor parallelism across ranks (parallel,
tp_executor, tp_worker). See docs/architecture.md."""
