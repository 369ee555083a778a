"""The `flotilla` command line, run as a user would."""
import asyncio
import signal
import socket
import subprocess
import sys

from engine import SamplingParams
from engine.model.loader import load_tokenizer
from engine.wire.core_client import EngineClient

CLI = [sys.executable, "-m", "engine.cli"]


def test_generate_prints_a_completion(tiny_llama):
    out = subprocess.run(CLI + ["generate", "--model", str(tiny_llama), "--dtype", "float32",
                                "--max-tokens", "5", "Hello there"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "### Hello there" in out.stdout and "tokens=5" in out.stdout


def test_generate_names_a_missing_model():
    out = subprocess.run(CLI + ["generate", "--model", "/no/such/model", "x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "/no/such/model" in out.stderr


def test_serve_engine_answers_a_client(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen(CLI + ["serve-engine", "--model", str(tiny_llama), "--dtype",
                                   "float32", "--address", address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async def main():
            client = await EngineClient.connect([address], load_tokenizer(tiny_llama),
                                                handshake_timeout_s=120)
            tokens = []
            async for out in client.generate("c", [5, 6, 7], SamplingParams(
                    max_tokens=6, ignore_eos=True, temperature=0.0)):
                tokens += out.outputs[0].token_ids
            await client.shutdown()
            return tokens

        assert len(asyncio.run(main())) == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
