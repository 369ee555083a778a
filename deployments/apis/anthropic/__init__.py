"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

protocol.py validates request bodies and translates them to the neutral chat input
(deployments.apis.common.chat_prep) and SamplingParams; render.py shapes the neutral
generation events (deployments.apis.events) as a Message object or its SSE stream, and
errors in Anthropic's shape; routes.py wires both to the shared ApiContext. So the
official `anthropic` SDK (and tools built on it) can talk to a Flotilla server.
"""
