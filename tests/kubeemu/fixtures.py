"""Pytest fixtures for the Kubernetes emulator.

Import them into a conftest.py::

    from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401

``kube_emulator`` is session-scoped (one API server for the whole run; KubeSpawner caches
its client configuration per process, so one emulator per session is also what it expects)
and exports ``KUBECONFIG`` for the session. ``kube_namespace`` gives each test a fresh
namespace, deleted afterwards (its pods are stopped).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from .emulator import KubeEmulator


@pytest.fixture(scope="session")
def kube_emulator() -> Iterator[KubeEmulator]:
    """A started emulator for the whole session, with KUBECONFIG pointing at it."""
    emu = KubeEmulator(nodes=[], restart_backoff_seconds=1.0, bookmark_interval=1.0)
    emu.start()
    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = emu.kubeconfig_path
    try:
        yield emu
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        emu.stop()


@pytest.fixture
def kube_namespace(kube_emulator: KubeEmulator) -> Iterator[str]:
    """A fresh namespace (with its default service account) for one test."""
    name = "t-" + uuid.uuid4().hex[:10]
    kube_emulator.create({"metadata": {"name": name}}, "namespaces")
    try:
        yield name
    finally:
        try:
            kube_emulator.delete("namespaces", name, None)
        except Exception:
            pass
