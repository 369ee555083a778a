"""Smaller ingress defects from the serving-path review (issue 40, findings 8 and 9):
a chunked body is refused while it is read, chat_template_kwargs cannot override the
server's own template arguments, adapter ids cannot be made to collide."""
from __future__ import annotations

import zlib

from engine.lora.request import adapter_id
from tests.test_openai_app import MODEL, engines, serve, tokenizer  # noqa: F401 - fixtures


def test_a_chunked_body_is_refused_once_it_passes_the_limit(engines):  # noqa: F811
    """No content-length: the app stops reading at the limit (it read the whole upload
    first, then checked)."""
    engines.add()
    sent = []

    async def body():
        for i in range(64):  # 64 x 64 KiB = 4 MiB against a 1 MiB limit
            sent.append(i)
            yield b"x" * (64 << 10)

    async def test(http, oai):
        r = await http.post("/v1/completions", content=body(),
                            headers={"content-type": "application/json"})
        ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                      "max_tokens": 2})
        return r, ok

    r, ok = serve(engines, test)
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"
    assert len(sent) <= 17  # 16 chunks fill the megabyte, the 17th passes it
    assert ok.status_code == 200


def test_chat_template_kwargs_cannot_set_the_servers_arguments(engines):  # noqa: F811
    engines.add()

    async def test(http, oai):
        out = []
        for kwargs in ({"tokenize": True}, {"add_generation_prompt": False},
                       {"return_dict": True, "enable_thinking": False}):
            r = await http.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2, "chat_template_kwargs": kwargs,
                "messages": [{"role": "user", "content": "hi"}]})
            out.append((r.status_code, r.json()))
        fine = await http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": "hi"}]})
        return out, fine.status_code

    out, fine = serve(engines, test)
    for (status, body), key in zip(out, ("tokenize", "add_generation_prompt", "return_dict")):
        assert status == 400 and key in body["error"]["message"], body
    assert fine == 200


def test_adapter_ids_of_a_crc32_collision_differ():
    """CRC32 collisions are made at will ("plumless" and "buckeroo" are a known pair);
    the ids come from BLAKE2b now, 63 bits, positive."""
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")
    assert adapter_id("plumless") != adapter_id("buckeroo")
    ids = {adapter_id(f"adapter-{i}") for i in range(10_000)}
    assert len(ids) == 10_000 and all(0 < i < 2**63 for i in ids)
    assert adapter_id("smol") == adapter_id("smol")


def test_metrics_can_be_put_behind_the_api_key(engines):  # noqa: F811
    engines.add()

    async def test(http, oai):
        bare = await http.get("/metrics")
        keyed = await http.get("/metrics", headers={"authorization": "Bearer k"})
        return bare.status_code, keyed.status_code

    assert serve(engines, test, api_key="k", metrics_need_api_key=True) == (401, 200)
    assert serve(engines, test, api_key="k") == (200, 200)  # the default: open to scrapers
