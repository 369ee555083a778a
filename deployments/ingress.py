"""OpenAIIngress: Serve replicas running the OpenAI app; they stream from the engines
directly over ZMQ (EngineClient), not through DeploymentHandle streaming, and send
control calls to the coordinator.
"""
from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from deployments.config import AppArgs
from deployments.openai_app import IngressOptions, build_openai_app
from deployments.tokenizers import tokenizer_for
from engine.core_client import EngineClient
from engine.errors import NoEnginesError

logger = logging.getLogger(__name__)
ENGINE_WAIT_S = 300.0


class CoordinatorControl:
    """Control endpoints answered by the coordinator (it owns the aggregation rules)."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator

    async def is_sleeping(self) -> bool:
        return await self.coordinator.is_sleeping.remote()

    async def sleep(self, level: int) -> None:
        await self.coordinator.call.remote("sleep", level)

    async def wake_up(self, tags: list[str] | None) -> None:
        await self.coordinator.call.remote("wake_up", tags)

    async def reset_prefix_cache(self, reset_running_requests: bool, reset_external: bool) -> bool:
        return await self.coordinator.reset_prefix_cache.remote(reset_running_requests,
                                                                reset_external)


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, args: dict, coordinator, engines) -> None:
        self.args = AppArgs.model_validate(args)
        self.coordinator = coordinator
        self._engines = engines  # bound so that Serve deploys the engine replicas
        self._client: EngineClient | None = None
        self._addresses: list[str] = []
        self._lock = asyncio.Lock()

    async def get_client(self) -> EngineClient:
        """The client for the current engines; (re)connects when they change or die."""
        if self._client is not None and self._client.healthy:
            return self._client
        async with self._lock:
            if self._client is not None and self._client.healthy:
                return self._client
            deadline = time.monotonic() + ENGINE_WAIT_S
            addresses = await self.coordinator.engines.remote()
            while not addresses:
                if time.monotonic() > deadline:
                    raise NoEnginesError("the engines did not register in time")
                await asyncio.sleep(0.5)
                addresses = await self.coordinator.engines.remote()
            if self._client is not None:
                await self._client.shutdown()
            self._client = await EngineClient.connect(addresses, tokenizer_for(self.args))
            self._addresses = addresses
            return self._client

    def __serve_build_asgi_app__(self):
        a = self.args
        api_key, admin_key = a.keys()  # read here, in the replica, not at build time
        options = IngressOptions(a.model_name, api_key=api_key, admin_key=admin_key,
                                 dev_mode=a.dev_mode, max_body_bytes=a.max_body_bytes)
        return build_openai_app(self.get_client, options, CoordinatorControl(self.coordinator))

    async def check_health(self) -> None:
        if self._client is not None and not self._client.healthy:
            raise RuntimeError(f"engine connection unhealthy: {self._client.dead_error}")
