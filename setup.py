"""Build hook: compile the libvgpu CUDA shim with gcc whenever the package is built.

Everything else about the package is in pyproject.toml. ``pip install -e '.[test]'`` builds
the shim into ``libvgpu/`` (the source tree), a wheel build into the wheel's ``libvgpu/``.
A missing compiler or a warning (-Wall -Wextra -Werror) fails the install with the reason.
"""

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _shim_builder():
    spec = importlib.util.spec_from_file_location("libvgpu_build", HERE / "libvgpu" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithShim(build_py):
    """build_py that also compiles libvgpu.so and its proxies into the libvgpu package."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            out = HERE / "libvgpu"
        else:
            out = Path(self.build_lib) / "libvgpu"
        builder = _shim_builder()
        try:
            built = builder.build(out)
        except builder.BuildError as exc:
            raise SystemExit(str(exc)) from None
        for path in built.values():
            self.announce(f"built {path}", level=2)


try:  # setuptools >= 70.1 carries bdist_wheel; older builds have the wheel package's
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover
    from wheel.bdist_wheel import bdist_wheel


class PlatformWheel(bdist_wheel):
    """Tag the wheel py3-none-<platform>: libvgpu.so is loaded by the CUDA programs (LD_PRELOAD),
    never imported by Python, so one wheel serves every Python 3 on that platform (the hub image's,
    the node agent's and the kernel image's)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithShim, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
