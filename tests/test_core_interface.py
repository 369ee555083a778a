"""Both engine cores implement EngineCoreLike (engine/core/interface.py), and the
interface is exactly what the engine-core server uses: a member that drifts in one core,
or a call the server adds, fails here rather than on a served request."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from engine.core.engine_core import EngineCore
from engine.core.interface import EngineCoreLike
from engine.mock.core import MockEngineCore
from engine.wire import core_server
from engine.wire.core_server import UTILITY_METHODS

# utilities vLLM's frontends send that a core may lack (the server answers a failure)
OPTIONAL_UTILITIES = {"profile", "execute_dummy_batch"}


def _members() -> list[str]:
    return sorted(name for name, value in vars(EngineCoreLike).items()
                  if inspect.isfunction(value) and not name.startswith("_"))


def _shape(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    """Parameters by name, kind and default (annotations aside: the mock's are looser)."""
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("core", [EngineCore, MockEngineCore], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", _members())
def test_the_core_has_the_member_with_its_signature(core, name):
    member = inspect.getattr_static(core, name, None)
    assert member is not None, f"{core.__name__} lacks {name}"
    assert inspect.isfunction(member), f"{core.__name__}.{name} is not a plain method"
    assert _shape(member) == _shape(getattr(EngineCoreLike, name)), (
        f"{core.__name__}.{name}{inspect.signature(member)} differs from "
        f"EngineCoreLike.{name}{inspect.signature(getattr(EngineCoreLike, name))}")


def _server_calls() -> set[str]:
    """The attributes core_server.py reads off its core: `self.core.x` and `core.x`."""
    tree = ast.parse(Path(core_server.__file__).read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and (
        (isinstance(node.value, ast.Name) and node.value.id == "core")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "core"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"))}


def test_the_interface_is_what_the_server_uses():
    used = _server_calls() | (UTILITY_METHODS - OPTIONAL_UTILITIES)
    assert set(_members()) == used


def test_the_optional_utilities_are_utilities():
    assert OPTIONAL_UTILITIES <= UTILITY_METHODS
