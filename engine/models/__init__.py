"""Model implementations whose attention reads the paged KV cache."""
