"""The tokenizer loads without torch when its config names transformers' generic class
(engine/model/loader.py): every ingress replica loads one, and AutoTokenizer imported
torch for it (3 s of CPU, ~150 MB), which slowed a replica's start during a storm."""
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from engine.model.loader import load_tokenizer


def test_the_default_model_s_tokenizer_loads_without_torch(default_model_dir):
    code = ("import sys; from engine.model.loader import load_tokenizer; "
            f"t = load_tokenizer(__import__('pathlib').Path({str(default_model_dir)!r})); "
            "print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["TokenizersBackend", "False"]


def test_it_tokenizes_and_templates_as_autotokenizer_does(default_model_dir):
    ours, auto = load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(
        str(default_model_dir))
    assert type(ours) is type(auto)
    for text in ["Hello world", " <|im_start|>user\nx<|im_end|>", "émoji 🎉\n\n  spaces"]:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)


@pytest.mark.parametrize("tokenizer_class, model_type", [
    ("GPT2Tokenizer", "llama"),  # a specific class named
    ("TokenizersBackend", "qwen2"),  # a model type whose own class AutoTokenizer prefers
])
def test_elsewhere_it_loads_what_autotokenizer_loads(default_model_dir, tmp_path,
                                                     tokenizer_class, model_type):
    for name in ("tokenizer.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    for name, key, value in [("tokenizer_config.json", "tokenizer_class", tokenizer_class),
                             ("config.json", "model_type", model_type)]:
        data = json.loads((default_model_dir / name).read_text())
        data[key] = value
        (tmp_path / name).write_text(json.dumps(data))
    auto = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    assert type(ours) is type(auto)
    assert ours.encode("Hello world") == auto.encode("Hello world")
