/*
 * proxy.c: the whole of libvgpu-cuda.so and libvgpu-nvml.so. They define nothing; what
 * matters is their dependency list, [libvgpu.so, the real libcuda.so.1 or libnvidia-ml.so.1],
 * set at link time. dlopen("libcuda.so.1") under the shim returns a proxy, and dlsym on it
 * searches libvgpu.so first (our hooks), then the real library (everything else).
 */
typedef int vgpu_proxy_has_no_symbols;
