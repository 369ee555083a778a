"""The native kernels' build cache does not depend on where the checkout lives, and a
start that has to compile them says so (issue 41, item 3)."""
import logging
import os
import shutil
import types

import engine.model.kernels as kernels


def _checkout_copy(tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(kernels._DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return ([folder / p.name for p in kernels._SOURCES],
            [folder / p.name for p in kernels._HEADERS])


def test_two_checkouts_stage_the_same_source_paths_without_rewriting(tmp_path, monkeypatch):
    build = tmp_path / "cache" / "kernels" / "tag"
    staged = {}
    for checkout in ("dev-tree", "ci-clone"):
        sources, headers = _checkout_copy(tmp_path, checkout)
        monkeypatch.setattr(kernels, "_SOURCES", sources)
        monkeypatch.setattr(kernels, "_HEADERS", headers)
        staged[checkout] = kernels.staged_sources(build)
        if checkout == "dev-tree":
            mtimes = {p: p.stat().st_mtime_ns for p in (build / "src").iterdir()}
    assert staged["dev-tree"] == staged["ci-clone"]
    assert all(str(p).startswith(str(build)) for p in staged["ci-clone"])
    assert {p: p.stat().st_mtime_ns for p in (build / "src").iterdir()} == mtimes
    # headers travel with the sources: their #include "vec.h" resolves in the copy
    assert {p.name for p in (build / "src").iterdir()} >= {"vec.h", "simd.h", "amx.h"}
    # a changed source is rewritten (and its build key changes with it)
    sources[0].write_text(sources[0].read_text() + "\n// changed\n")
    kernels.staged_sources(build)
    assert (build / "src" / sources[0].name).read_text().endswith("// changed\n")


def test_a_start_compiles_once_logs_it_and_later_starts_import_the_library(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path))
    loads, imports = [], []

    def fake_load(name, sources, build_directory, **_):  # ninja: write only when stale
        loads.append(sources)
        library = tmp_path / build_directory / f"{name}.so"
        library.write_bytes(b"%d" % len(loads))
        os.utime(library, ns=(len(loads) * 10 ** 9, len(loads) * 10 ** 9))
        return types.SimpleNamespace(isa="avx512")

    def fake_import(name, library):  # what another checkout or virtualenv does
        imports.append(library)
        return types.SimpleNamespace(isa="avx512")

    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(kernels, "import_library", fake_import)
    build = kernels._build.__wrapped__  # past the per-process cache
    with caplog.at_level(logging.WARNING, logger="engine.model.kernels"):
        assert build("x86-64-test").isa == "avx512"
        assert build("x86-64-test").isa == "avx512"  # built: imported, no ninja, no line
        (ready,) = tmp_path.glob("kernels/*/*.ready")
        ready.unlink()  # a build cut short leaves no marker: the next start builds
        build("x86-64-test")
    lines = [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]
    assert len(lines) == 2 and "-march=x86-64-test" in lines[0] and " s; cached in " in lines[0]
    assert len(loads) == 2 and all(str(tmp_path) in s for s in loads[0])
    assert imports == [ready.with_suffix(".so")]
