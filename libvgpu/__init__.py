"""libvgpu: the CUDA shim (C, LD_PRELOAD) and its Python side (region reader, node agent).

The shim itself is ``libvgpu.so`` plus two tiny proxies, ``libvgpu-cuda.so`` and
``libvgpu-nvml.so``, built into this package directory when the package is installed. Install
all three side by side wherever the shim is mounted (they find each other by directory).
:mod:`libvgpu.regions` reads the shared-memory regions the shim writes.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["LIBRARY", "PROXIES", "ShimNotBuilt", "library_files", "library_path"]

_HERE = Path(__file__).resolve().parent
LIBRARY = "libvgpu.so"
PROXIES = ("libvgpu-cuda.so", "libvgpu-nvml.so")


class ShimNotBuilt(FileNotFoundError):
    """libvgpu.so is not in the package directory (the package was installed without gcc?)."""


def _require(name: str) -> Path:
    path = _HERE / name
    if not path.is_file():
        raise ShimNotBuilt(
            f"{name} is not built (looked for {path}). It is compiled with gcc when the package "
            "is installed: reinstall with `pip install -e '.[test]'` on a machine with gcc, or "
            "run `make -C libvgpu`."
        )
    return path


def library_path() -> str:
    """Absolute path of the built ``libvgpu.so`` (for LD_PRELOAD or /etc/ld.so.preload).

    Raises :class:`ShimNotBuilt` (a FileNotFoundError) with what to do when it is missing.
    """
    return str(_require(LIBRARY))


def library_files() -> list[str]:
    """The shim and its two dlopen proxies: copy all of them into one directory when deploying.

    Without the proxies beside it, programs that ``dlopen("libcuda.so.1")`` (the CUDA runtime,
    PyTorch) would not be limited; the shim says so on stderr once.
    """
    return [str(_require(name)) for name in (LIBRARY, *PROXIES)]
