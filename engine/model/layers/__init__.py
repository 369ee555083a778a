"""Building blocks of the models: norms, rotary embedding, the token embedding, linears, experts, Mamba
mixers, and the lower levels of the FlexAttention and Triton attention backends
(flex_paged, triton_paged; the backends themselves are engine/model/attention)."""
