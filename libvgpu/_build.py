"""Build libvgpu.so and its two dlopen proxies with gcc.

One place that knows how the shim is compiled: ``setup.py`` calls :func:`build` during
``pip install`` (editable or wheel), the Makefile runs this file, and the tests build their ASan
variant with it. Standard library only: it runs inside pip's isolated build environment.

    python libvgpu/_build.py [--out DIR] [--asan] [--cc gcc]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC_DIR = Path(__file__).resolve().parent / "src"
SOURCES = (
    "hooks.c", "dlsym.c", "config.c", "region.c", "memory.c", "alloc.c", "pools.c", "context.c",
    "compute.c", "priority.c", "elastic.c", "nvml.c",
)
LIBRARY = "libvgpu.so"
PROXIES = {"libvgpu-cuda.so": "libcuda.so.1", "libvgpu-nvml.so": "libnvidia-ml.so.1"}
WARNINGS = ("-Wall", "-Wextra", "-Werror")
CFLAGS = ("-std=gnu11", "-g", "-fPIC", "-fvisibility=hidden", "-pthread", *WARNINGS)


class BuildError(RuntimeError):
    """The shim could not be compiled; the message says why and what to do."""


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"building libvgpu failed: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}".rstrip()
        )


def build(
    out_dir: str | os.PathLike[str],
    *,
    cc: str | None = None,
    asan: bool = False,
    defines: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Compile the shim and its proxies into ``out_dir``; return {file name: path}.

    ``asan`` builds with AddressSanitizer (the process must preload libasan first).
    ``defines`` adds -D macros (the tests move the default limits-file path with it).
    Files are replaced atomically, so running processes keep their mapped copy.
    """
    cc = cc or os.environ.get("CC") or "gcc"
    if shutil.which(cc) is None:
        raise BuildError(
            f"libvgpu needs a C compiler to build the CUDA shim, and '{cc}' was not found on "
            "PATH. Install gcc (e.g. 'apt-get install gcc') and reinstall the package."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    opt = ["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"] if asan else ["-O2"]
    macros = [f"-D{k}={v}" for k, v in (defines or {}).items()]
    built: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="libvgpu-build-") as tmp_name:
        tmp = Path(tmp_name)
        lib = tmp / LIBRARY
        _run(
            [cc, *CFLAGS, *opt, *macros, "-shared", "-o", str(lib)]
            + [str(SRC_DIR / s) for s in SOURCES]
            + [f"-Wl,-soname,{LIBRARY}", "-ldl"]
        )
        for proxy, real in PROXIES.items():
            # an empty stand-in for the real library, only so the linker records its soname
            stub = tmp / "stub" / real
            stub.parent.mkdir(exist_ok=True)
            _run([cc, "-shared", "-fPIC", "-o", str(stub), str(SRC_DIR / "proxy.c"),
                  f"-Wl,-soname,{real}"])
            _run(
                [cc, *CFLAGS, "-O2", "-shared", "-o", str(tmp / proxy), str(SRC_DIR / "proxy.c"),
                 f"-Wl,-soname,{proxy}", "-Wl,--no-as-needed", str(lib), str(stub),
                 "-Wl,-rpath,$ORIGIN"]
            )
            stub.unlink()
        for name in (LIBRARY, *PROXIES):
            target = out / name
            staged = out / f".{name}.tmp{os.getpid()}"
            shutil.copyfile(tmp / name, staged)
            os.chmod(staged, 0o755)
            os.replace(staged, target)
            built[name] = target
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build libvgpu.so and its proxies.")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent),
                        help="output directory (default: the libvgpu package directory)")
    parser.add_argument("--asan", action="store_true", help="build with AddressSanitizer")
    parser.add_argument("--cc", default=None, help="C compiler (default: $CC or gcc)")
    args = parser.parse_args(argv)
    try:
        built = build(args.out, cc=args.cc, asan=args.asan)
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    for path in built.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
