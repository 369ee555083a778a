"""A frontend's CPU-heavy request preparation runs off its event loop (issue 40,
finding 6): a long prompt's tokenization, a long conversation's chat template or a
grammar check no longer stalls the other streams of the replica."""
import asyncio
import threading

from engine.sampling_params import SamplingParams
from tests.test_core_client import engines, tokenizer  # noqa: F401 - fixtures

LONG = "hello " * 500  # 3,000 characters: past prep_offload.INLINE_CHARS


def test_a_long_prompt_is_tokenized_on_a_thread_while_other_streams_go_on(engines):  # noqa: F811
    engines.add(itl_s=0.001)
    held, release = threading.Event(), threading.Event()
    threads: dict[str, str] = {}

    async def main():
        client = await engines.client()
        real_tokenize = client.processor.tokenize

        def tokenize(prompt):
            text = prompt if isinstance(prompt, str) else ""
            threads[text[:5]] = threading.current_thread().name
            if text == LONG:
                held.set()
                assert release.wait(10), "the short request never finished"
            return real_tokenize(prompt)
        client.processor.tokenize = tokenize
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        try:
            async def collect(rid, prompt):
                return [o async for o in client.generate(rid, prompt, params)][-1]
            long_one = asyncio.ensure_future(collect("long", LONG))
            await asyncio.get_running_loop().run_in_executor(None, held.wait, 10)
            short = await collect("short", "Hi there")  # served while the long one waits
            release.set()
            assert short.finished and (await long_one).finished
        finally:
            release.set()
            await client.shutdown()

    asyncio.run(main())
    assert threads["hello"].startswith("prepare")
    assert threads["Hi th"] == "MainThread"  # small ones stay inline: a hop costs more


def test_a_long_conversation_is_rendered_on_a_thread(engines, monkeypatch):  # noqa: F811
    """The chat template and the tokenization of a long conversation go to the
    prepare threads; a short chat stays on the event loop."""
    from tests.test_openai_app import MODEL, serve
    engines.add(itl_s=0.001)
    rendered_on: list[str] = []

    async def test(http, oai):
        for content in ("Hi", LONG):
            reply = await oai.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}])
            assert reply.choices[0].finish_reason in ("length", "stop")

    import deployments.apis.common.chat_prep as app_module
    real = app_module.render_chat_prompt

    def spy(*args, **kwargs):
        rendered_on.append(threading.current_thread().name)
        return real(*args, **kwargs)
    monkeypatch.setattr(app_module, "render_chat_prompt", spy)
    serve(engines, test)
    assert rendered_on[0] == "MainThread" and rendered_on[1].startswith("prepare")


def test_a_large_tokenize_or_detokenize_runs_on_a_thread(engines, monkeypatch):  # noqa: F811
    """/tokenize renders and tokenizes, /detokenize decodes, off the event loop when the
    body is large, as the generation routes do; small bodies stay inline."""
    from tests.test_openai_app import MODEL, serve
    engines.add(itl_s=0.001)
    ran_on: dict[str, list[str]] = {"encode": [], "decode": []}

    async def test(http, oai):
        out = []
        for prompt in ("Hi", LONG):
            out.append(await http.post("/tokenize", json={"model": MODEL, "prompt": prompt}))
        out.append(await http.post("/tokenize", json={
            "model": MODEL, "messages": [{"role": "user", "content": LONG}]}))
        ids = out[1].json()["tokens"]
        for tokens in (ids[:3], ids):
            out.append(await http.post("/detokenize", json={"model": MODEL, "tokens": tokens}))
        return out

    from transformers import PreTrainedTokenizerBase
    real_encode, real_decode = PreTrainedTokenizerBase.encode, PreTrainedTokenizerBase.decode

    def encode(self, *args, **kwargs):
        ran_on["encode"].append(threading.current_thread().name)
        return real_encode(self, *args, **kwargs)

    def decode(self, *args, **kwargs):
        ran_on["decode"].append(threading.current_thread().name)
        return real_decode(self, *args, **kwargs)
    monkeypatch.setattr(PreTrainedTokenizerBase, "encode", encode)
    monkeypatch.setattr(PreTrainedTokenizerBase, "decode", decode)
    responses = serve(engines, test)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert responses[4].json()["prompt"] == LONG
    assert ran_on["encode"][0] == "MainThread"
    assert all(name.startswith("prepare") for name in ran_on["encode"][1:3]), ran_on
    assert ran_on["decode"][-2] == "MainThread" and ran_on["decode"][-1].startswith("prepare")
