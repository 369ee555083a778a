"""Building blocks of the models: norms, rotary embedding, paged attention."""
