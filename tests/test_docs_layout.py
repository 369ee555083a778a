"""The docs describe the tree that exists: README's layout names every module, the
architecture doc every engine folder, and nothing cites a file outside the repository."""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out]


def test_readme_layout_names_every_module():
    readme = (REPO / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    for path in _tracked("engine/*.py") + _tracked("deployments/*.py"):
        if path.name == "__init__.py" or "kernels" in path.parts or "layers" in path.parts:
            continue  # packages of one job: the folder is named (kernels/, layers/)
        assert path.name in layout or path.stem in layout, path.relative_to(REPO)


def test_architecture_doc_names_every_engine_folder():
    doc = (REPO / "docs" / "architecture.md").read_text()
    for folder in sorted(p for p in (REPO / "engine").iterdir()
                         if p.is_dir() and (p / "__init__.py").exists()):
        assert f"engine/{folder.name}/" in doc, folder.name


def test_nothing_cites_files_outside_the_repository():
    sources = _tracked("*.py") + _tracked("*.md") + _tracked("*.yaml") + _tracked("*.cpp")
    # ../shared exists beside the developers' checkout only, never beside a user's clone
    outside = re.compile(r"\bARCHITECTURE\.md\b|\.\./shared/|\bshared/STYLE|"
                         r"parents?(\[\d\])? / \"shared\"")
    offenders = [str(p.relative_to(REPO)) for p in sources
                 if p.exists() and outside.search(p.read_text(errors="replace"))]
    assert offenders == []
