"""The tokenizer a Serve replica uses for the app's model (the mock borrows the default's)."""
from __future__ import annotations

import functools

from deployments.config import AppArgs
from engine.model.loader import load_tokenizer, resolve_model


@functools.cache
def _load(model: str):
    return load_tokenizer(resolve_model(model))


def tokenizer_for(args: AppArgs):
    return _load("default" if args.is_mock else args.engine.model)
