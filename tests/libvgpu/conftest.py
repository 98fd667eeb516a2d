"""Fixtures for the shim's tests: one build per session, one simulated node per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .harness import Build, Node, _build, build_all, pid_namespaces_unavailable


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The shim (built from libvgpu/src like the package install does), doubles and programs."""
    return build_all(tmp_path_factory.mktemp("libvgpu-build"))


@pytest.fixture
def make_node(build: Build, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """make_node(**double_env) -> a fresh simulated node; its processes die with the test."""
    nodes: list[Node] = []

    def make(**double_env: str | int) -> Node:
        node = Node(build, tmp_path / f"node{len(nodes)}", **double_env)
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.cleanup()


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    """A node with one 4 GiB simulated GPU whose contexts take no memory."""
    return make_node()


@pytest.fixture(scope="session")
def default_path_build(build: Build, tmp_path_factory: pytest.TempPathFactory) -> Build:
    """A shim whose built-in limits-file path (normally /etc/libvgpu/limits.conf) is in a
    temporary directory, so the tests can see what the default path does."""
    root = tmp_path_factory.mktemp("libvgpu-default-path")
    default = root / "etc" / "limits.conf"
    _build.build(root / "shim", defines={"VGPU_DEFAULT_CONFIG": f'"{default}"'})
    return Build(root, root / "shim", build.lib_dir, build.bin_dir)


@pytest.fixture(scope="session")
def pidns() -> bool:
    """Skips the test where no pid namespace can be made; else True (pass it as pidns=)."""
    why = pid_namespaces_unavailable()
    if why:
        pytest.skip(why)
    return True


@pytest.fixture(scope="session")
def hooks_build(build: Build, tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The shim built with its test hooks (-DVGPU_TEST_HOOKS, e.g. LIBVGPU_TEST_SLEEP_IN_LOCK_MS),
    which the shipped build leaves out."""
    root = tmp_path_factory.mktemp("libvgpu-hooks")
    _build.build(root / "shim", defines={"VGPU_TEST_HOOKS": "1"})
    return Build(root, root / "shim", build.lib_dir, build.bin_dir)


@pytest.fixture
def hooks_node(hooks_build: Build, tmp_path: Path) -> Iterator[Node]:
    """A node whose processes run the shim built with its test hooks."""
    node = Node(hooks_build, tmp_path / "hooks-node")
    yield node
    node.cleanup()
