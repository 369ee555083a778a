"""Tool-call parsing (whole and streamed), tool-choice schemas and the default tool prompt.

The streaming invariant is checked against many chunkings of many texts: the deltas,
folded, must give exactly what parse() gives. parse() itself is checked against
written-out expectations and, for "hermes" and "llama3_json", against reference
parsers below built on a different footing (regular expressions and the json module's
own decoder instead of the bracket scanner).
"""
from __future__ import annotations

import copy
import json
import random
import re

import jsonschema
import pytest

from deployments.apis.common.tool_calls import (
    TOOL_PARSERS,
    ContentDelta,
    NamedToolParser,
    ParsedMessage,
    RequiredToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    get_tool_parser,
)
from deployments.apis.common.tool_prompt import (
    conversation_with_tools,
    named_tool_schema,
    render_tools_system_prompt,
    required_tools_schema,
    template_supports_tools,
)

HERMES = get_tool_parser("hermes")
LLAMA3 = get_tool_parser("llama3_json")


# --- helpers --------------------------------------------------------------------------

def run_stream(parser: ToolCallParser, chunks: list[str]) -> list[list]:
    """The deltas each feed() returned, then finish()'s."""
    streamer = parser.streamer()
    return [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]


def fold(deltas: list) -> ParsedMessage:
    """Deltas as a message, asserting the ordering rules of the stream on the way."""
    content = ""
    names: list[str] = []
    args: list[str] = []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content += d.text
            continue
        assert isinstance(d, ToolCallDelta)
        if d.index == len(names):  # a new call: its first delta names it
            assert d.name is not None, d
            names.append(d.name)
            args.append(d.arguments)
        else:  # continues the latest call only, unnamed
            assert d.index == len(names) - 1 and d.name is None, d
            args[d.index] += d.arguments
    calls = [ToolCall(n, a) for n, a in zip(names, args)]
    return ParsedMessage(content or None, calls)


def chunkings(text: str, rng: random.Random, count: int) -> list[list[str]]:
    """The whole text, 1-character chunks, and random cuts (some empty chunks)."""
    out = [[text], list(text)]
    for _ in range(count):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 12)))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def assert_stream_matches_parse(parser: ToolCallParser, text: str, rng: random.Random,
                                count: int = 6) -> None:
    expected = parser.parse(text)
    for chunks in chunkings(text, rng, count):
        got = fold([d for batch in run_stream(parser, chunks) for d in batch])
        assert got.content == (expected.content or None), (text, chunks)
        assert got.tool_calls == expected.tool_calls, (text, chunks)


# --- reference parsers ----------------------------------------------------------------

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def ref_call(text: str) -> ToolCall | None:
    """A call object's text as a call, with the json module locating the arguments."""
    text = text.strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return ToolCall(obj["name"], "{}")
    if not isinstance(obj[key], dict):
        return None
    spans, i = {}, 1
    while True:  # walk the members with the stdlib decoder
        i = _WS.match(text, i).end()
        if text[i] == "}":
            break
        if text[i] == ",":
            i += 1
            continue
        member, i = _DECODER.raw_decode(text, i)
        start = _WS.match(text, _WS.match(text, i).end() + 1).end()
        _, i = _DECODER.raw_decode(text, start)
        spans[member] = text[start:i]
    return ToolCall(obj["name"], spans[key])


def ref_hermes(text: str) -> ParsedMessage:
    pieces: list[str | ToolCall] = []
    pos = 0
    for m in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, re.DOTALL):
        call = ref_call(m.group(1))
        if call is not None:
            pieces += [text[pos:m.start()], call]
            pos = m.end()
    pieces.append(text[pos:])
    content = ""
    for k, piece in enumerate(pieces):
        if isinstance(piece, str):
            if k > 0:
                piece = piece.lstrip()
            if k + 1 < len(pieces):
                piece = piece.rstrip()
            content += piece
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    content = content.strip()
    return ParsedMessage(None if calls and not content else content, calls)


def ref_llama3(text: str) -> ParsedMessage:
    as_content = ParsedMessage(text.strip(), [])
    body = re.sub(r"^\s*(<\|python_tag\|>)?\s*", "", text)
    if not body.startswith("{"):
        return as_content
    calls, i = [], 0
    while True:
        try:
            _, end = _DECODER.raw_decode(body, i)
        except ValueError:
            return as_content
        call = ref_call(body[i:end])
        if call is None:
            return as_content
        calls.append(call)
        if not body[end:].strip():
            return ParsedMessage(None, calls)
        sep = re.compile(r"\s*;\s*(?=\{)").match(body, end)
        if sep is None:
            return as_content
        i = sep.end()


# --- corpora --------------------------------------------------------------------------

CALL_JSONS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name":"f","arguments":{}}',
    '{\n  "name": "search",\n  "arguments": {\n    "q": "naïve café — 東京 🚀"\n  }\n}',
    '{"name": "esc", "arguments": {"s": "a \\"quoted\\" } { ] [ brace", "b": "\\\\"}}',
    '{"name": "tags", "arguments": {"html": "<tool_call> not a tag"}}',
    '{"arguments": {"x": [1, 2, {"y": null}]}, "name": "args_first"}',
    '{"name": "no_args"}',
    '{"name": "uni\\u00e9", "arguments": {"k\\"ey": "v\\u00e9"}, "extra": true}',
    '{"name": "params", "parameters": {"n": -1.5e3, "ok": false}}',
]
BAD_JSONS = [
    '{"name": "f", "arguments": {"a": 1}',  # unclosed
    '{"arguments": {}}',  # no name
    '{"name": 3, "arguments": {}}',  # name not a string
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',  # arguments not an object
    "not json at all",
    '{"name": "f", "arguments": {}} trailing',
    "",
]
WORDS = ["Hello", "world", "  ", "\n", "\n\n", " ", "\t", "Let me check.", "ünï 🚀", "<",
         "<tool", "</tool_call>", "<tool_call>", "a < b", "{", "}", "x"]


def hermes_texts(rng: random.Random, count: int) -> list[str]:
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.35:
                parts.append(rng.choice(WORDS))
            else:
                body = rng.choice(CALL_JSONS if kind < 0.8 else BAD_JSONS)
                ws = rng.choice(["", "\n", " \n "])
                close = "" if rng.random() < 0.1 else "</tool_call>"
                parts.append(f"<tool_call>{ws}{body}{ws}{close}")
        text = rng.choice(["", " ", "\n"]).join(parts)
        if rng.random() < 0.2:  # truncated generation
            text = text[:rng.randint(0, len(text))]
        texts.append(text)
    return texts


def llama3_texts(rng: random.Random, count: int) -> list[str]:
    texts = []
    for _ in range(count):
        calls = [rng.choice(CALL_JSONS + BAD_JSONS[:2] if rng.random() < 0.2 else CALL_JSONS)
                 for _ in range(rng.randint(1, 3))]
        text = rng.choice(["", " ", "\n", "<|python_tag|>", " <|python_tag|> "])
        text += rng.choice([";", "; ", " ;\n", " ", ","]).join(calls)
        if rng.random() < 0.3:
            text = text[:rng.randint(0, len(text))]
        elif rng.random() < 0.2:
            text = rng.choice(["The answer is 4.", "  <|python_tag|>print(1)", "<|pyth",
                               "< x", "{oops"]) + text
        texts.append(text)
    return texts


def required_texts(rng: random.Random, count: int) -> list[str]:
    texts = []
    for _ in range(count):
        elements = []
        for _ in range(rng.randint(1, 3)):
            args = rng.choice(['{"city": "Paris"}', "{}", '{"s": "} ] \\" {", "n": [1, {}]}',
                               '{"t": "東京 🚀"}'])
            name = rng.choice(['"get_weather"', '"f"', '"\\u00e9t\\"e"'])
            ws = rng.choice(["", " ", "\n  "])
            members = [f'"name":{ws}{name}', f'"arguments":{ws}{args}']
            if rng.random() < 0.2:
                members.reverse()
            if rng.random() < 0.1:
                members = members[:1]
            elements.append("{" + ws + ("," + ws).join(members) + ws + "}")
        text = rng.choice(["", " ", "\n"]) + "[" + ", ".join(elements) + "]"
        if rng.random() < 0.3:
            text = text[:rng.randint(0, len(text))]
        texts.append(text)
    return texts


# --- hermes ---------------------------------------------------------------------------

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("text,content,calls", [
    ("Just text.", "Just text.", []),
    ("  padded \n", "padded", []),
    (f"<tool_call>\n{W}\n</tool_call>", None, [("get_weather", '{"city": "Paris"}')]),
    (f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Paris"}')]),
    (f"<tool_call>{W}</tool_call>\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    (f"a <tool_call>{W}</tool_call> b", "ab", [("get_weather", '{"city": "Paris"}')]),
    (f"<tool_call>{W}</tool_call>\n<tool_call>"
     '{"name": "time", "arguments": {"tz": "UTC"}}</tool_call>', None,
     [("get_weather", '{"city": "Paris"}'), ("time", '{"tz": "UTC"}')]),
    # malformed blocks stay text, verbatim, tags and their whitespace included
    ('<tool_call>{"name": broken}</tool_call>', '<tool_call>{"name": broken}</tool_call>', []),
    (f'x <tool_call>{{"arguments": {{}}}}</tool_call> <tool_call>{W}</tool_call>',
     'x <tool_call>{"arguments": {}}</tool_call>', [("get_weather", '{"city": "Paris"}')]),
    # unterminated final block: a call if its JSON is complete, else text
    (f"Sure.\n<tool_call>\n{W}\n", "Sure.", [("get_weather", '{"city": "Paris"}')]),
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci',
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', []),
    ("text <tool_ca", "text <tool_ca", []),
    # strings with quotes, braces and unicode in the arguments, exactly as written
    ('<tool_call>{"name": "say", "arguments": {"s": "he said \\"}{\\" — 東京"}}</tool_call>',
     None, [("say", '{"s": "he said \\"}{\\" — 東京"}')]),
    ('<tool_call>{"arguments": {"q": "x"}, "name": "late"}</tool_call>', None,
     [("late", '{"q": "x"}')]),
    ('<tool_call>{"name": "bare"}</tool_call>', None, [("bare", "{}")]),
    # the first </tool_call> ends a block, even inside a JSON string
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>', []),
])
def test_hermes_parse(text, content, calls):
    parsed = HERMES.parse(text)
    assert parsed == ParsedMessage(content, [ToolCall(n, a) for n, a in calls])
    assert parsed == ref_hermes(text)


def test_hermes_matches_reference_on_random_texts():
    for text in hermes_texts(random.Random(1), 400):
        assert HERMES.parse(text) == ref_hermes(text), text


def test_hermes_streams_content_early_and_holds_possible_tags():
    streamer = HERMES.streamer()
    assert streamer.feed("Hello ") == [ContentDelta("Hello")]  # the space waits
    assert streamer.feed("there <tool") == [ContentDelta(" there")]
    assert streamer.feed("box>") == [ContentDelta(" <toolbox>")]  # not a tag after all
    assert streamer.feed("\n<tool_call>\n" + W[:20]) == []
    call = streamer.feed(W[20:] + "\n</tool_call>")  # decided at the closing tag
    assert call == [ToolCallDelta(0, "get_weather", '{"city": "Paris"}')]
    assert streamer.feed("\n") == []
    assert streamer.finish() == []


def test_hermes_holds_a_block_until_it_is_decided():
    streamer = HERMES.streamer()
    assert streamer.feed("<tool_call>{not json}") == []
    assert streamer.feed("</tool_call>") == [ContentDelta("<tool_call>{not json}</tool_call>")]
    unterminated = HERMES.streamer()
    assert unterminated.feed(f"<tool_call>{W}") == []
    assert unterminated.finish() == [ToolCallDelta(0, "get_weather", '{"city": "Paris"}')]


# --- llama3_json ----------------------------------------------------------------------

@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ('\n <|python_tag|> {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "}"}}',
     None, [("f", "{}"), ("g", '{"b": "}"}')]),
    ('{"parameters": {"x": "é \\" ;"}, "name": "late"}', None, [("late", '{"x": "é \\" ;"}')]),
    ('{"name": "bare"}', None, [("bare", "{}")]),
    ("The answer is 4.", "The answer is 4.", []),
    ("  <|python_tag|>print('hi')", "<|python_tag|>print('hi')", []),
    ('{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}', []),
    ('{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
    ('{"name": "f", "parameters": {}};', '{"name": "f", "parameters": {}};', []),
    ('{"name": "f"} {"name": "g"}', '{"name": "f"} {"name": "g"}', []),  # no `;`
    ('{"name": "f"},{"name": "g"}', '{"name": "f"},{"name": "g"}', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ("", "", []),
])
def test_llama3_parse(text, content, calls):
    parsed = LLAMA3.parse(text)
    assert parsed == ParsedMessage(content, [ToolCall(n, a) for n, a in calls])
    assert parsed == ref_llama3(text)


def test_llama3_matches_reference_on_random_texts():
    for text in llama3_texts(random.Random(2), 400):
        assert LLAMA3.parse(text) == ref_llama3(text), text


def test_llama3_streams_plain_content_and_holds_json():
    streamer = LLAMA3.streamer()
    assert streamer.feed(" <|pyth") == []  # could still be the tag
    assert streamer.feed("on") == []
    assert streamer.feed("3 is ") == [ContentDelta("<|python3 is")]
    assert streamer.feed("great ") == [ContentDelta(" great")]
    assert streamer.finish() == []
    calls = LLAMA3.streamer()
    assert calls.feed('{"name": "f", "parameters": {"a": 1}}') == []  # `;` may follow
    assert calls.finish() == [ToolCallDelta(0, "f", '{"a": 1}')]


# --- schema-forced parsers ------------------------------------------------------------

def test_named_parser():
    parser = NamedToolParser("get_weather")
    assert parser.parse(' {"city": "Paris"}\n') == ParsedMessage(
        None, [ToolCall("get_weather", '{"city": "Paris"}')])
    assert parser.parse("") == ParsedMessage("", [])
    assert parser.parse('{"city": "Pa') == ParsedMessage("", [])  # cut short: no call
    assert parser.parse('"Paris"') == ParsedMessage("", [])  # not an arguments object


def test_named_parser_sends_the_call_when_its_arguments_close():
    streamer = NamedToolParser("f").streamer()
    assert streamer.feed(" ") == []
    assert streamer.feed('{"a"') == []
    assert streamer.feed(": {}}\n") == [ToolCallDelta(0, "f", '{"a": {}}')]
    assert streamer.feed("more") == []
    assert streamer.finish() == []


@pytest.mark.parametrize("text,calls", [
    ('[{"name": "f", "arguments": {"a": 1}}]', [("f", '{"a": 1}')]),
    ('\n[ {"name":"f","arguments":{"s":"] } \\" ["}} ,\n{"name": "g", "arguments": {}} ]',
     [("f", '{"s":"] } \\" ["}'), ("g", "{}")]),
    ('[{"arguments": {"b": [2]}, "name": "late"}]', [("late", '{"b": [2]}')]),
    ('[{"name": "caf\\u00e9"}]', [("café", "{}")]),
    ('[{"name": "f", "arguments": {"a": "東', []),  # cut short: dropped
    ('[{"name": "f", "arguments": {"a": 1}}, {"name": "g', [("f", '{"a": 1}')]),
    ('[{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a":',
     [("f", '{"a": 1}')]),
    ('[{"name": "f", "arguments": {"a": 1}', [("f", '{"a": 1}')]),  # complete call
    ('[{"name": "f"', []),  # arguments may still follow: no call yet
    ('[{"arguments": {"a": 1}, "na', []),
    ('[{"name": "f", "arguments": [1]}, {"name": "g"}]', []),  # off the schema: stop
    ('[{"name": "f", "arguments": {}}] trailing', [("f", "{}")]),
    ("", []),
])
def test_required_parser(text, calls):
    parsed = RequiredToolParser().parse(text)
    assert parsed == ParsedMessage(None if calls else "", [ToolCall(n, a) for n, a in calls])


def test_required_parser_sends_each_call_whole():
    streamer = RequiredToolParser().streamer()
    assert streamer.feed('[{"name": "f') == []
    assert streamer.feed('", "arguments": {"a"') == []
    assert streamer.feed(": 1}") == [ToolCallDelta(0, "f", '{"a": 1}')]
    assert streamer.feed('}, {"arguments": {"b": 2}') == []  # held: no name yet
    assert streamer.feed(', "name": "g"}]') == [ToolCallDelta(1, "g", '{"b": 2}')]
    assert streamer.finish() == []


def test_forced_calls_cut_by_max_tokens_are_never_broken_json():
    """The default model repeated a forced call until max_tokens; the last came back as
    `{"guests": 4, "time":`. At every cut of such a reply, each call sent is JSON."""
    call = '{"name": "book", "arguments": {"guests": 4, "time": "19:00"}}'
    reply = "[" + ", ".join([call] * 4) + "]"
    for cut in range(len(reply) + 1):
        for parser in (RequiredToolParser(), NamedToolParser("book")):
            text = reply[:cut] if isinstance(parser, RequiredToolParser) else call[:cut]
            for tool_call in parser.parse(text).tool_calls:
                assert isinstance(json.loads(tool_call.arguments), dict), (cut, text)


# --- the streaming invariant ----------------------------------------------------------

FIXED_TEXTS = [W, f"<tool_call>{W}</tool_call>", "", " ", "<", "<tool_call>", "{", "[",
               '{"name": "f"}', '[{"name": "f"}]', "  <|python_tag|>", "a\n\n<tool_call>"]


@pytest.mark.parametrize("parser,texts", [
    (HERMES, lambda rng: hermes_texts(rng, 250)),
    (LLAMA3, lambda rng: llama3_texts(rng, 250)),
    (RequiredToolParser(), lambda rng: required_texts(rng, 250)),
    (NamedToolParser("f"), lambda rng: required_texts(rng, 60) + hermes_texts(rng, 60)),
], ids=["hermes", "llama3_json", "required", "named"])
def test_stream_equals_parse_for_any_chunking(parser, texts):
    rng = random.Random(3)
    for text in FIXED_TEXTS + texts(rng):
        assert_stream_matches_parse(parser, text, rng)


def test_fold_rejects_a_call_without_its_name_first():  # the checker itself can fail
    with pytest.raises(AssertionError):
        fold([ToolCallDelta(0, None, "{}")])
    with pytest.raises(AssertionError):
        fold([ToolCallDelta(1, "f", "{}")])


# --- registry -------------------------------------------------------------------------

def test_get_tool_parser():
    assert TOOL_PARSERS == ("hermes", "llama3_json")
    assert all(isinstance(get_tool_parser(name), ToolCallParser) for name in TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_tool_parser("mistral")


# --- schemas --------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def valid(schema, instance) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_named_tool_schema():
    schema = named_tool_schema(WEATHER)
    assert schema == WEATHER["function"]["parameters"]
    assert valid(schema, {"city": "Paris"})
    assert not valid(schema, {"town": "Paris"})
    assert named_tool_schema(NOW) == {"type": "object"}
    assert valid(named_tool_schema(NOW), {}) and not valid(named_tool_schema(NOW), [])


def test_required_tools_schema():
    schema = required_tools_schema([WEATHER, NOW], parallel=True)
    assert list(schema["items"]["anyOf"][0]["properties"]) == ["name", "arguments"]
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}},
            {"name": "now", "arguments": {}}]
    assert valid(schema, good)
    for bad in ([], [{"name": "get_weather", "arguments": {}}],  # city missing
                [{"name": "other", "arguments": {}}], [{"name": "now"}],
                [{"name": "now", "arguments": {}, "extra": 1}], {"name": "now"}):
        assert not valid(schema, bad), bad
    single = required_tools_schema([WEATHER, NOW], parallel=False)
    assert valid(single, good[:1]) and not valid(single, good)
    with pytest.raises(ValueError):
        required_tools_schema([], parallel=True)


def test_schema_output_parses_with_the_forced_parsers():
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    parsed = RequiredToolParser().parse(json.dumps(good))
    assert parsed.tool_calls == [ToolCall("get_weather", '{"city": "Paris"}')]


# --- prompt ---------------------------------------------------------------------------

QWEN_LIKE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for tool in tools %}
{{- tool | tojson }}{%- endfor %}{%- endif %}
{%- for message in messages %}{{ message.content }}{%- endfor %}"""
PLAIN = """{# tools are not supported #}{%- for message in messages %}
{{- '<|im_start|>' + message.role + ' tools\\n' + message.content }}
{%- if message.tools %}{%- endif %}{%- endfor %}"""


def test_template_supports_tools():
    assert template_supports_tools(QWEN_LIKE)
    assert template_supports_tools("{% set tools = custom_tools %}{{ x }}")
    assert not template_supports_tools(PLAIN)  # comment, string literal, attribute only
    assert not template_supports_tools(None)
    assert not template_supports_tools("")


def test_render_tools_system_prompt():
    prompt = render_tools_system_prompt([WEATHER, NOW])
    inside = prompt.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in inside.splitlines()] == [WEATHER["function"],
                                                                   NOW["function"]]
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>") in prompt


def test_conversation_with_tools():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "now", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 °C."},
    ]
    before = copy.deepcopy(messages)
    out = conversation_with_tools(messages, [WEATHER, NOW])
    assert messages == before
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant"]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in out)
    assert out[0]["content"] == render_tools_system_prompt([WEATHER, NOW]) + "\n\nBe brief."
    assert out[1]["content"] == "Weather in Paris?"
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    now = '<tool_call>\n{"name": "now", "arguments": "not json"}\n</tool_call>'
    assert out[2]["content"] == weather + "\n" + now
    # read back by the hermes parser: the call, and the block whose arguments were no JSON
    assert HERMES.parse(out[2]["content"]) == ParsedMessage(
        now, [ToolCall("get_weather", '{"city": "Paris"}')])
    assert out[3] == {"role": "tool", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    assert out[4] == {"role": "assistant", "content": "It is 21 °C."}


def test_conversation_with_tools_adds_a_system_message_or_none():
    messages = [{"role": "user", "content": "hi"}]
    out = conversation_with_tools(messages, [NOW])
    assert out == [{"role": "system", "content": render_tools_system_prompt([NOW])},
                   {"role": "user", "content": "hi"}]
    assert conversation_with_tools(messages, None) == messages
    said = [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]
    assert conversation_with_tools(said, []) == [{"role": "assistant", "content":
        'Checking.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'}]
    assert conversation_with_tools(messages, None) is not messages
