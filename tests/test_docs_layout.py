"""The docs describe the tree that exists: docs/layout.md names every module, the
architecture doc every engine folder, and nothing cites a file outside the repository."""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out]


def test_layout_doc_names_every_module():
    layout = (REPO / "docs" / "layout.md").read_text()
    tree = layout.split("```", 2)[1]  # the tree itself, not the prose around it
    assert "engine/" in tree and "deployments/" in tree
    for path in _tracked("engine/*.py") + _tracked("deployments/*.py"):
        if path.name == "__init__.py" or "kernels" in path.parts or "layers" in path.parts:
            continue  # packages of one job: the folder is named (kernels/, layers/)
        assert path.name in tree or path.stem in tree, path.relative_to(REPO)


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


def _headings(text: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (code blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("#")}


def test_relative_links_in_the_docs_resolve():
    """README's sections moved into docs/: every relative link in README.md and docs/*.md
    reaches a file that exists, and a #fragment into a Markdown file one of its headings."""
    broken = []
    for doc in [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue  # http:, https:, mailto:
            path, _, fragment = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(REPO)}: {link} (no such file)")
            elif fragment and target.suffix == ".md" and \
                    fragment not in _headings(target.read_text()):
                broken.append(f"{doc.relative_to(REPO)}: {link} (no such heading)")
    assert broken == []


def test_the_first_pages_stay_short():
    """Issue 63: the README is a first page and benchmarks.md today's figures; the rest
    lives in docs/ and in the measurement log."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 120
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 600
