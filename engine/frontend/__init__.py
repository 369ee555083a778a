"""Frontend: what runs in the API process. Requests are validated and tokenized
(processor), outputs are detokenized and checked for stop strings (output_processor),
and the offline LLM drives an in-process engine core (llm, llm_engine).
See docs/architecture.md."""
