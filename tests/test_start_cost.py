"""What a start costs in imports (issue 41, item 3: a second start under 25 s on two cores).

Every Ray process of a server pays its imports again, all at once on the same cores:
the CLI and the coordinator configure engines but never run a model, so they must not
load torch or transformers (~3 s each); the engine builds its model on the meta device,
where a random init or an arange went through torch's Python references and imported
torch._dynamo and inductor (1.7 s) for nothing. Each check runs in a fresh interpreter.
"""
import subprocess
import sys

import pytest


def _fresh_python(code: str) -> str:
    """What `code` prints in a fresh interpreter (it must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _heavy(modules: set[str]) -> set[str]:
    return {m for m in ("torch", "transformers", "torch._dynamo") if m in modules}


@pytest.mark.parametrize("module", ["deployments.cli", "deployments.app",
                                    "deployments.serve.coordinator"])
def test_the_processes_that_only_configure_engines_load_neither_torch_nor_transformers(module):
    code = f"import {module}"
    if module == "deployments.cli":  # and parse a command line, as `flotilla serve` does
        code += ("\nfrom deployments.cli import parse_command_line"
                 "\nparse_command_line(['serve', '--model', 'mock'])")
    modules = set(subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(*sys.modules)"],
        capture_output=True, text=True, timeout=300, check=True).stdout.split())
    assert module in modules and _heavy(modules) == set()


def test_building_and_running_an_engine_does_not_import_torch_dynamo(tiny_llama):
    code = (f"from engine import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny_llama)!r}, dtype='float32')\n"
            f"llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)\n"
            f"import sys\nprint(*sys.modules)")
    modules = set(_fresh_python(code).split())
    assert "torch" in modules and "engine.model.families.llama" in modules
    assert "torch._dynamo" not in modules


def test_the_structured_outputs_import_is_over_before_the_engine_reports_ready(tiny_llama):
    """xgrammar's import (seconds of CPU, holding the GIL) runs beside the model's load
    and ends before LLM() returns: left on its thread it ran beside the first requests,
    a fresh engine's first decode at 0.80-0.88 of its second."""
    code = (f"import sys, threading\n"
            f"from engine import LLM\n"
            f"llm = LLM({str(tiny_llama)!r}, dtype='float32')\n"
            f"print('xgrammar' in sys.modules,\n"
            f"      any(t.name == 'xgrammar-import' for t in threading.enumerate()))")
    assert _fresh_python(code).split()[-2:] == ["True", "False"]
