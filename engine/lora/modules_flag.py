"""`--lora-modules` in every form vLLM documents, as {name: path}.

vLLM's `vllm serve --lora-modules` takes one or more values, each `name=path` or a
JSON object `{"name": ..., "path": ..., "base_model_name": ...}`; Flotilla's config
(and its chart) holds the adapters as one JSON object `{"name": "path", ...}`, which
the flag also takes. vLLM users type vLLM's values, and "not valid JSON" was all they
got back.
"""
from __future__ import annotations

import json

_VLLM_KEYS = {"name", "path", "base_model_name"}


def parse_lora_modules(values: list[str]) -> dict[str, str]:
    """{name: path} from the flag's values; ValueError saying which value is wrong."""
    modules: dict[str, str] = {}
    for value in values:
        text = value.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{value!r} is not valid JSON: {exc.msg}") from None
            if not isinstance(obj, dict) or not all(isinstance(v, str) for v in obj.values()):
                raise ValueError(f"{value!r}: give {{\"name\": \"path\"}} or vLLM's "
                                 '{"name": ..., "path": ...}')
            if {"name", "path"} <= set(obj) <= _VLLM_KEYS:  # vLLM's form: one adapter
                obj = {obj["name"]: obj["path"]}
            pairs = obj.items()
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{value!r}: give name=path (or JSON)")
            pairs = [(name, path)]
        for name, path in pairs:
            if name in modules and modules[name] != path:
                raise ValueError(f"adapter {name!r} given twice, with two paths")
            modules[name] = path
    return modules
