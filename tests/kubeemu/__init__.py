"""A Kubernetes API emulator for tests: official clients talk to it through a kubeconfig.

    from tests.kubeemu import KubeEmulator, NodeSpec

    with KubeEmulator(nodes=[NodeSpec("gpu-1", allocatable={"nvidia.com/gpu": "2"})]) as emu:
        os.environ["KUBECONFIG"] = emu.kubeconfig_path
        ...

See README.md in this folder for what is emulated and how pods map onto local processes.
"""

from .emulator import KubeEmulator, NodeSpec
from .errors import ApiError

__all__ = ["ApiError", "KubeEmulator", "NodeSpec"]
