"""Typed exceptions of the engine: callers catch these, never bare ValueErrors."""


class FlotillaError(Exception):
    """Base class for every error the engine raises on purpose."""


class ModelNotFoundError(FlotillaError):
    """The named model is neither a local checkpoint nor a model this install ships."""


class UnsupportedModelError(FlotillaError):
    """The checkpoint exists but its architecture or options are not implemented."""


class UnsupportedQuantizationError(UnsupportedModelError):
    """A checkpoint quantized in a format (or a variant of one) Flotilla does not read."""


class InvalidRequestError(FlotillaError, ValueError):
    """A request the engine cannot take: bad sampling params, prompt too long, ...

    param: the request field at fault, when one is (SamplingParams names its own
    fields), so that the HTTP APIs, which leave those ranges to SamplingParams, still
    answer with a 400 naming the field. Kept in the instance's __dict__, so it survives
    pickling (Ray) with the message."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit max_model_len."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already running in this engine."""


class EngineDrainingError(FlotillaError):
    """The engine is shutting down: it finishes what it has and takes nothing new."""


class EngineDeadError(FlotillaError):
    """The engine core stopped; in-flight requests cannot finish."""


class EngineSleepingError(FlotillaError):
    """The engine is asleep (sleep mode); wake it up first."""


class EngineOverloadedError(FlotillaError):
    """The engine's waiting queue is full (max_waiting_requests): try again shortly.
    Served as 429 with Retry-After."""


class EngineRequestError(FlotillaError):
    """The engine refused or failed one request (its message says why)."""


class RequestAbortedError(FlotillaError):
    """The engine stopped a request before it finished, on its own account (draining
    for a downscale, put to sleep, its running requests reset), not because the client
    asked: served as a 503 (an error event once streaming), never as a finished answer,
    since "abort" is no finish_reason an OpenAI client knows."""


class UtilityCallError(FlotillaError):
    """A utility call failed on one or more engines; the message names them."""


class NoEnginesError(FlotillaError):
    """No engine answered (none connected, or none left alive)."""


class InconsistentUtilityResults(FlotillaError):
    """Engines that must agree on a utility result did not."""

    def __init__(self, method: str, values: list) -> None:
        super().__init__(f"engines disagree on {method}: {values}")
        self.method = method
        self.values = values

    def __reduce__(self):  # picklable with its fields, so it survives Ray calls
        return type(self), (self.method, self.values)


class RequestTimeoutError(FlotillaError):
    """A request passed its deadline: it was aborted at its engine (KV freed). Carries
    what a caller needs to report partial usage: the request and its prompt's length."""

    def __init__(self, message: str, request_id: str = "", prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens

    def __reduce__(self):
        return type(self), (str(self), self.request_id, self.prompt_tokens)
