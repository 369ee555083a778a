"""Typed exceptions of the engine: callers catch these, never bare ValueErrors."""


class FlotillaError(Exception):
    """Base class for every error the engine raises on purpose."""


class ModelNotFoundError(FlotillaError):
    """The named model is neither a local checkpoint nor a model this install ships."""


class UnsupportedModelError(FlotillaError):
    """The checkpoint exists but its architecture or options are not implemented."""


class InvalidRequestError(FlotillaError, ValueError):
    """A request the engine cannot take: bad sampling params, prompt too long, ..."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit max_model_len."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already running in this engine."""


class EngineDeadError(FlotillaError):
    """The engine core stopped; in-flight requests cannot finish."""
