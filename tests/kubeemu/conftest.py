from tests.kubeemu.fixtures import kube_emulator, kube_namespace  # noqa: F401
