"""stream_interval_s: a streamed response sends at most one event per interval, the
outputs that came meanwhile merged into it; nothing is lost, and 0 sends every output."""
import json

import httpx
import pytest

from tests.app_server import MODEL, serve_app_over_mocks

TOKENS = 60


def _stream(url: str) -> tuple[int, str, int]:
    """(content events, the text they carry, completion tokens in the usage)."""
    events, text, usage = 0, "", None
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "pace", "max_tokens": TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    events += 1
                    text += chunk["choices"][0]["text"]
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
    return events, text, usage


@pytest.mark.parametrize("interval_s", [0.0, 0.1])
def test_a_paced_stream_merges_outputs_and_loses_none(tokenizer, interval_s):
    # 10 ms a token: 60 tokens take 0.6 s, six 0.1 s intervals
    with serve_app_over_mocks(tokenizer, engines=1, itl_s=0.01,
                              stream_interval_s=interval_s) as server:
        events, text, usage = _stream(server.url)
    assert usage == TOKENS
    if interval_s:
        assert events <= TOKENS // 3, events  # merged: far fewer events than outputs
    else:
        assert events >= TOKENS // 2, events  # one per output, bar a merge or two
