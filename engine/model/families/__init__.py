"""One module per model family; engine.model.registry maps architectures to them."""
