"""Put the shim on the host: ``<host dir>/lib/*.so``, ``<host dir>/ld.so.preload``, ``<host dir>/regions``.

GPU pods mount ``<host dir>/lib`` read-only at the container path (``/usr/local/lib/elastic-gpu``
by default), get a copy of ``<host dir>/ld.so.preload`` at ``/etc/ld.so.preload`` (their init
container waits for it) and mount ``<host dir>/regions`` as the shim's ``node_region_dir``. The
preload file therefore names the library by its path *inside the pods*. ``regions/`` is the
agent's (0755) with one node region per card made here (0666): containers write their entries
but cannot remove or replace a card's region.

Every file is written under a temporary name and renamed into place, so a process starting
meanwhile maps either the old or the new library, never half of one; running processes keep the
file they mapped. Files already identical are left alone (no new inode, nothing to remount).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import libvgpu
from libvgpu.regions import RegionError, prepare_node_regions


@dataclass(frozen=True)
class Installed:
    """What :func:`install_shim` left on the host."""

    lib_dir: Path
    libraries: tuple[Path, ...]
    preload: Path
    regions: Path
    changed: tuple[str, ...]  # names of files (re)written this time
    region_problems: tuple[str, ...] = ()  # node regions that could not be made, and why


def _atomic_write(target: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def install_shim(host_dir: str | os.PathLike[str], container_lib_dir: str = "/usr/local/lib/elastic-gpu",
                 sources: list[str] | None = None, gpus: Sequence[str] = ()) -> Installed:
    """Install libvgpu (``libvgpu.library_files()``) under ``host_dir``, and the node region of
    each card of ``gpus`` (uuids) in ``regions/``.

    Raises :class:`libvgpu.ShimNotBuilt` when the package has no built shim, OSError naming the
    path when the host directory is not writable. A node region that cannot be made (a file that
    is not one in its place) is named in ``region_problems``.
    """
    root = Path(host_dir)
    lib_dir = root / "lib"
    regions = root / "regions"
    files = [Path(p) for p in (sources if sources is not None else libvgpu.library_files())]
    changed: list[str] = []
    lib_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lib_dir, 0o755)
    installed: list[Path] = []
    for src in files:
        dst = lib_dir / src.name
        if not (dst.is_file() and filecmp.cmp(src, dst, shallow=False)):
            tmp_fd, tmp = tempfile.mkstemp(dir=lib_dir, prefix=f".{src.name}.")
            os.close(tmp_fd)
            try:
                shutil.copyfile(src, tmp)
                os.chmod(tmp, 0o755)
                os.replace(tmp, dst)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            changed.append(src.name)
        installed.append(dst)
    preload = root / "ld.so.preload"
    text = f"{container_lib_dir.rstrip('/')}/{libvgpu.LIBRARY}\n".encode()
    if preload.is_dir() and not preload.is_symlink():
        # a GPU pod that started before this file existed: the kubelet made its subPath a
        # directory. Empty, it is the kubelet's and gives way; with content, it is someone's.
        try:
            preload.rmdir()
        except OSError as e:
            raise OSError(
                f"{preload} is a directory with files in it, where the shim's ld.so.preload goes: "
                "remove it, then restart the node agent"
            ) from e
    if not (preload.is_file() and preload.read_bytes() == text):
        _atomic_write(preload, text, 0o644)
        changed.append(preload.name)
    regions.mkdir(parents=True, exist_ok=True)
    # the agent's: GPU containers map the regions made here (0666), but can neither unlink,
    # rename nor replace one, nor plant a file (a region of their own would split the node)
    os.chmod(regions, 0o755)
    problems = []
    for uuid in gpus:
        try:
            prepare_node_regions(regions, [uuid])
        except RegionError as e:
            problems.append(str(e))
    return Installed(lib_dir=lib_dir, libraries=tuple(installed), preload=preload, regions=regions,
                     changed=tuple(changed), region_problems=tuple(problems))


def remove_shim(host_dir: str | os.PathLike[str]) -> list[str]:
    """Remove what :func:`install_shim` left under ``host_dir`` (lib/, ld.so.preload, regions/) and
    the directory itself when nothing else is in it; the names of what was removed.

    Only when no GPU pod runs on the node: a new process of a running pod would otherwise start
    without the shim (ld.so skips a preload it cannot open), unlimited."""
    root = Path(host_dir)
    removed = []
    for name in ("ld.so.preload", "lib", "regions"):
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    try:
        root.rmdir()
    except OSError:
        pass  # not empty (someone else's files) or already gone
    return removed
