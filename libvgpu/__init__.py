"""libvgpu: the CUDA shim (C, LD_PRELOAD) and its Python side (region reader, node agent)."""
