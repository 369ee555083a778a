"""An ingress replica's engine set follows the coordinator (deployments/ingress.py),
driven here without Ray: the replica's class over in-process mock engines and a stand-in
coordinator that answers `membership`."""
from __future__ import annotations

import asyncio

import deployments.ingress as ingress
from tests.test_openai_app import engines, tokenizer  # noqa: F401 - fixtures


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Coordinator:
    """membership -> (version, addresses, keys), fixed: engines in the clear."""

    def __init__(self, addresses: list[str]) -> None:
        async def membership():
            return 1, list(addresses), {}
        self.membership = _Remote(membership)


def _replica(addresses: list[str]):
    cls = ingress.OpenAIIngress.func_or_class.__mro__[1]  # the class under Serve's wrapper
    return cls({"model": "mock"}, _Coordinator(addresses), None)


def test_an_engine_left_out_as_dead_is_tried_again_without_a_membership_change(
        engines, monkeypatch):  # noqa: F811
    """After a blip the replica served from the other engines under the same membership
    version and, polling only for version changes, never used the blipped engine again
    (issue 40, finding 1). Now it tries the engines it left out every ENGINE_RETRY_S."""
    monkeypatch.setattr(ingress, "MEMBERSHIP_POLL_S", 0.05)
    monkeypatch.setattr(ingress, "ENGINE_RETRY_S", 0.2)
    engines.add()
    engines.add()

    async def main():
        replica = _replica(engines.addresses)
        client = await replica.get_client()
        assert [e.address for e in client.engines] == engines.addresses
        client._mark_dead(client.engines[1], "silent for 10.0s (a blip)")
        narrowed = await replica.get_client()  # serves from the live engine meanwhile
        assert [e.address for e in narrowed.engines] == engines.addresses[:1]
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(replica._client.engines) == 2:
                break
        whole = replica._client
        found = [e.address for e in whole.engines], whole.healthy
        replica._follower.cancel()
        for c in {client, narrowed, whole}:
            await c.shutdown()
        return found

    addresses, healthy = asyncio.run(main())
    assert addresses == engines.addresses and healthy
