"""The wheel that `pip install .` builds (cluster.yaml, the Helm image) carries what the
engine needs at run time: the CPU kernel sources it compiles on first use."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_the_cpu_kernel_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)], check=True)
    wheel, = tmp_path.glob("flotilla-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    from engine.model.kernels import _HEADERS, _SOURCES
    for path in _SOURCES + _HEADERS:
        assert f"engine/model/kernels/{path.name}" in names, path.name
