"""OpenAI API request bodies (pydantic) and their translation to SamplingParams.

Field names and defaults follow the OpenAI API and vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, include_stop_str_in_output, bad_words,
allowed_token_ids, structured_outputs and the older guided_* names), so the official
`openai` client and vLLM users' payloads work unchanged.

Every model forbids fields it does not declare: an unknown field is a 400 naming it,
never a value silently dropped. Fields OpenAI defines that Flotilla does not implement
are declared too, so that setting one gets a 400 saying it is not supported
(unsupported_param); docs/api.md lists both kinds.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.apis.common.sampling import build_sampling_params, documented_range
from deployments.apis.errors import ParamError, first_unsupported
from engine.errors import InvalidRequestError
from engine.generation_defaults import SAMPLING_KEYS
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.structured.params import StructuredOutputsParams


def _one_or_many(value: str | list) -> list[str | list[int]]:
    """A prompt field as a list of prompts: a string or token ids is one prompt; a list
    of strings or of token-id lists is many."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return list(value)
    return [value]


# Integers reach the engines as 64-bit ints (msgspec): a larger one is a 400 naming its
# field here, not an OverflowError later. (Fields with bounds of their own state them in
# their Field: pydantic would let this alias's bounds override them.)
Int64 = Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _check(self) -> "StreamOptions":
        if self.continuous_usage_stats:
            raise ValueError("continuous_usage_stats is not supported")
        return self


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` request extension."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# Fields of the OpenAI API that Flotilla does not implement: setting one to anything
# but its "off" value is refused (the value here is what is accepted).
_UNSUPPORTED_COMMON: dict[str, Any] = {"service_tier": None, "store": (None, False),
                                       "metadata": None}
_UNSUPPORTED_CHAT: dict[str, Any] = {
    "audio": None, "modalities": (None, ["text"]), "prediction": None,
    "web_search_options": None, "functions": None, "function_call": None,
    "reasoning_effort": None}
_UNSUPPORTED_COMPLETION: dict[str, Any] = {"suffix": None}
MAX_PROMPTS = 256  # prompts in one /v1/completions request


class _SchedulingFields(_Strict):
    """When a request runs and how long it may take (Flotilla / vLLM extensions)."""

    # vLLM's extension: lower runs first; needs the engines' scheduling_policy "priority"
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)
    # seconds from arrival after which the request is aborted and answered with 408 (a
    # final error event when streaming), with the usage so far; none: the server's
    # request_timeout_s
    timeout: float | None = Field(None, gt=0)


class _SamplingFields(_SchedulingFields):
    # documented_range: SamplingParams checks that range (a 400 naming the field); a
    # constraint given as a keyword is the API's own and is checked here
    model: str | None = None
    n: int = documented_range(1, minimum=1, le=128)
    temperature: float | None = documented_range(None, minimum=0.0, le=2.0)
    top_p: float | None = documented_range(None, exclusive_minimum=0.0, maximum=1.0)
    top_k: Int64 | None = None
    min_p: float | None = documented_range(None, minimum=0.0, maximum=1.0)
    presence_penalty: float | None = documented_range(None, minimum=-2.0, maximum=2.0)
    frequency_penalty: float | None = documented_range(None, minimum=-2.0, maximum=2.0)
    repetition_penalty: float | None = documented_range(None, exclusive_minimum=0.0)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: int = documented_range(0, minimum=0, lt=1 << 63)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and not used (as vLLM): OpenAI's abuse tracking
    # vLLM's extension
    prompt_logprobs: int | None = documented_range(None, minimum=0, maximum=MAX_LOGPROBS)
    logit_bias: dict[Int64, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Flotilla's extension: false keeps this request out of speculative decoding
    speculative_decoding: bool = True
    # declared only to be refused with a clear message when set (see unsupported_param)
    service_tier: Any = None
    store: Any = None
    metadata: Any = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = _UNSUPPORTED_COMMON
    # this API's name of a SamplingParams field where it differs (for a refusal's param)
    ENGINE_NAMES: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available with stream=true")
        return self

    def unsupported_param(self) -> ParamError | None:
        """The first field set to something Flotilla does not implement, as a ParamError."""
        return first_unsupported(self, self.UNSUPPORTED)

    def structured_outputs_params(self, forced: StructuredOutputsParams | None = None,
                                  forced_by: str = "") -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (response_format,
        structured_outputs or a guided_* field; `forced` is what tool_choice requires)."""
        specs: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            specs.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            specs.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            specs.append(("structured_outputs", {
                k: v for k, v in (("json", so.json_), ("json_object", so.json_object),
                                  ("regex", so.regex), ("choice", so.choice),
                                  ("grammar", so.grammar)) if v not in (None, False)}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                specs.append((name, {key: getattr(self, name)}))
        if forced is not None:
            if specs:
                raise ParamError(specs[0][0], f"{specs[0][0]} cannot be combined with "
                                 f"{forced_by} (it constrains the output itself)")
            return forced
        if len(specs) > 1:
            raise ParamError(specs[1][0], "give one output constraint: "
                             + " and ".join(name for name, _ in specs) + " were both set")
        if not specs:
            return None
        name, fields = specs[0]
        try:
            return StructuredOutputsParams(**fields)
        except InvalidRequestError as exc:
            raise ParamError(name, str(exc)) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None,
                        defaults: dict[str, int | float] | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """defaults: the model's sampling defaults (engine.generation_defaults) for the
        fields this request leaves unset; prompt_logprobs: what the engine computes
        (echo with logprobs needs them even when the request does not ask)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return build_sampling_params(
            defaults, {name: getattr(self, name) for name in SAMPLING_KEYS}, n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias or None, allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []), structured_outputs=structured,
            speculative_decoding=self.speculative_decoding, names=self.ENGINE_NAMES)


class CompletionRequest(_SamplingFields):
    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    max_tokens: int | None = Field(16, ge=1, lt=1 << 63)
    logprobs: int | None = documented_range(None, minimum=0, maximum=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, lt=1 << 63)
    echo: bool | None = False
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_COMPLETION}

    @model_validator(mode="after")
    def _prompts(self) -> "CompletionRequest":
        count = len(self.prompts())
        if not 1 <= count <= MAX_PROMPTS:
            raise ValueError(f"prompt: give 1 to {MAX_PROMPTS} prompts, got {count}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine computes: those asked, and with echo + logprobs
        the prompt's part of the logprobs object. A negative one is passed on, for
        SamplingParams to refuse (the larger of the two would hide it)."""
        asked = [k for k in (self.prompt_logprobs,
                             self.logprobs if self.echo else None) if k is not None]
        if not asked:
            return None
        return min(asked) if min(asked) < 0 else max(asked)

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: a string, token ids, or a list of either."""
        return _one_or_many(self.prompt)


class FunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # an assistant message sent back as it came (with a reasoning parser): its thinking
    # is left out of the prompt, as chat templates drop earlier reasoning
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are always schema-exact when they are enforced


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs may not set apply_chat_template's own arguments (a clash is
    a TypeError, or a template that returns ids: a 500 otherwise)."""
    reserved = sorted(set(kwargs or ()) & _TEMPLATE_CALL_ARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(map(repr, reserved))} "
                         "cannot be set there (the server sets it, or the request's own "
                         "field does)")


# apply_chat_template's own arguments: as chat_template_kwargs they clashed with the
# server's (a TypeError, served as a 500)
_TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=1 << 63)
    max_completion_tokens: int | None = Field(None, ge=1, lt=1 << 63)
    logprobs: bool | None = False
    top_logprobs: int | None = documented_range(None, minimum=0, maximum=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None

    UNSUPPORTED: ClassVar[dict[str, Any]] = {**_UNSUPPORTED_COMMON, **_UNSUPPORTED_CHAT}
    ENGINE_NAMES: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    @model_validator(mode="after")
    def _template_kwargs(self) -> "ChatCompletionRequest":
        check_template_kwargs(self.chat_template_kwargs)
        return self

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.parallel_tool_calls is not None and not self.tools:
            raise ValueError("parallel_tool_calls needs tools")
        if self.effective_tool_choice == "auto" and any(t.function.strict for t in self.tools):
            raise ValueError("strict functions are enforced with tool_choice required or a "
                             "named function; with auto the model's calls are parsed, not "
                             "constrained")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto when tools are given, else none."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def conversation(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(part.get("type") == "text" and isinstance(part.get("text"), str)
                           for part in content):
                    raise ParamError(f"messages.{i}.content",
                                     "only text content parts are supported")
                content = "".join(part["text"] for part in content)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ParamError("top_logprobs", "top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0


class EmbeddingRequest(_SchedulingFields):
    """POST /v1/embeddings: one embedding per input, in order."""

    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, lt=1 << 63)
    user: str | None = None  # accepted and not used, as on the other endpoints

    @model_validator(mode="after")
    def _inputs(self) -> "EmbeddingRequest":
        count = len(self.inputs())
        if not 1 <= count <= MAX_PROMPTS:
            raise ValueError(f"input: give 1 to {MAX_PROMPTS} inputs, got {count}")
        return self

    def inputs(self) -> list[str | list[int]]:
        return _one_or_many(self.input)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int64]


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter folder on the engines' hosts."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter: requests already running with it finish."""

    lora_name: str = Field(min_length=1)
