"""Fixtures of the tests of the built images (tests/helm/test_images_run.py, test_z2jh_e2e.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], object]:
    """The filesystems of the images `./dev images` built, each unpacked once for every test of
    the run that runs pods of it in the Kubernetes emulator: ``unpacked(name) -> Image`` (name as
    in ``ELASTIC_GPU_IMAGES``: hub, agent, kernel, notebook, hub-jupyterhub6). The emulator's
    containers mount an image's filesystem read-only, under a writable layer of their own.

    Under ``ELASTIC_GPU_UNPACK_DIR`` where `./dev images` gives one (a directory in memory, which
    it removes: on a disk that discards what a file held as it is deleted, removing the unpacked
    images took minutes), else under the run's temporary directory."""
    from tests.helm.images_stack import DOCKER, IMAGES
    from tests.kubeemu.images import from_engine

    given = os.environ.get("ELASTIC_GPU_UNPACK_DIR")
    root, done = Path(given) if given else tmp_path_factory.mktemp("images"), {}

    def get(name: str) -> object:
        if name not in done:
            done[name] = from_engine(IMAGES[name], root / name, DOCKER)
        return done[name]

    return get
