/*
 * hooktable.h: the hook table, one row per symbol: X(symbol, cuGetProcAddress base name,
 * CUDA version that introduced this variant, library (CUDA/NVML), per-thread-stream variant,
 * hook or NULL). The row is the whole of a hook's registration: vgpu.h makes the ids from it,
 * hooks.c the table (struct vgpu_hook) the dlopen proxies, dlsym and cuGetProcAddress answer
 * from. A NULL hook: resolved for the shim's own use only.
 */
#ifndef VGPU_HOOKTABLE_H
#define VGPU_HOOKTABLE_H

#define VGPU_HOOK_TABLE(X) \
    X(cuInit, "cuInit", 2000, CUDA, 0, cuInit) \
    X(cuGetProcAddress, "cuGetProcAddress", 11030, CUDA, 0, cuGetProcAddress) \
    X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, CUDA, 0, cuGetProcAddress_v2) \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, CUDA, 0, cuMemAlloc_v2) \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, CUDA, 0, cuMemAllocPitch_v2) \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, CUDA, 0, cuMemAllocManaged) \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, CUDA, 0, cuMemAllocAsync) \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, CUDA, 1, cuMemAllocAsync_ptsz) \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, CUDA, 0, cuMemAllocFromPoolAsync) \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, CUDA, 1, cuMemAllocFromPoolAsync_ptsz) \
    X(cuMemFree_v2, "cuMemFree", 3020, CUDA, 0, cuMemFree_v2) \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, CUDA, 0, cuMemFreeAsync) \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, CUDA, 1, cuMemFreeAsync_ptsz) \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, CUDA, 0, cuMemPoolTrimTo) \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 11040, CUDA, 0, cuDeviceGraphMemTrim) \
    X(cuMemCreate, "cuMemCreate", 10020, CUDA, 0, cuMemCreate) \
    X(cuMemRelease, "cuMemRelease", 10020, CUDA, 0, cuMemRelease) \
    X(cuMemMap, "cuMemMap", 10020, CUDA, 0, cuMemMap) \
    X(cuMemUnmap, "cuMemUnmap", 10020, CUDA, 0, cuMemUnmap) \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, CUDA, 0, cuArrayCreate_v2) \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 3020, CUDA, 0, cuArray3DCreate_v2) \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, CUDA, 0, cuMipmappedArrayCreate) \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, CUDA, 0, cuArrayDestroy) \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, CUDA, 0, cuMipmappedArrayDestroy) \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, CUDA, 0, cuMemGetInfo_v2) \
    X(cuMemAlloc, "cuMemAlloc", 2000, CUDA, 0, cuMemAlloc) \
    X(cuMemAllocPitch, "cuMemAllocPitch", 2000, CUDA, 0, cuMemAllocPitch) \
    X(cuArrayCreate, "cuArrayCreate", 2000, CUDA, 0, cuArrayCreate) \
    X(cuArray3DCreate, "cuArray3DCreate", 2000, CUDA, 0, cuArray3DCreate) \
    X(cuCtxCreate, "cuCtxCreate", 2000, CUDA, 0, cuCtxCreate) \
    X(cuMemGetInfo, "cuMemGetInfo", 2000, CUDA, 0, cuMemGetInfo) \
    X(cuDeviceTotalMem, "cuDeviceTotalMem", 2000, CUDA, 0, cuDeviceTotalMem) \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, CUDA, 0, cuDeviceTotalMem_v2) \
    X(cuCtxCreate_v2, "cuCtxCreate", 3020, CUDA, 0, cuCtxCreate_v2) \
    X(cuCtxCreate_v3, "cuCtxCreate", 11040, CUDA, 0, cuCtxCreate_v3) \
    X(cuCtxCreate_v4, "cuCtxCreate", 12050, CUDA, 0, cuCtxCreate_v4) \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 4000, CUDA, 0, cuCtxDestroy_v2) \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 7000, CUDA, 0, cuDevicePrimaryCtxRetain) \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, CUDA, 0, cuDevicePrimaryCtxRelease_v2) \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, CUDA, 0, cuDevicePrimaryCtxReset_v2) \
    X(cuModuleLoad, "cuModuleLoad", 2000, CUDA, 0, cuModuleLoad) \
    X(cuModuleLoadData, "cuModuleLoadData", 2000, CUDA, 0, cuModuleLoadData) \
    X(cuModuleLoadDataEx, "cuModuleLoadDataEx", 2010, CUDA, 0, cuModuleLoadDataEx) \
    X(cuModuleLoadFatBinary, "cuModuleLoadFatBinary", 2000, CUDA, 0, cuModuleLoadFatBinary) \
    X(cuModuleUnload, "cuModuleUnload", 2000, CUDA, 0, cuModuleUnload) \
    X(cuLibraryLoadData, "cuLibraryLoadData", 12000, CUDA, 0, cuLibraryLoadData) \
    X(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 12000, CUDA, 0, cuLibraryLoadFromFile) \
    X(cuLibraryUnload, "cuLibraryUnload", 12000, CUDA, 0, cuLibraryUnload) \
    X(cuLaunchKernel, "cuLaunchKernel", 4000, CUDA, 0, cuLaunchKernel) \
    X(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, CUDA, 1, cuLaunchKernel_ptsz) \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, CUDA, 0, cuLaunchKernelEx) \
    X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, CUDA, 1, cuLaunchKernelEx_ptsz) \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, CUDA, 0, cuLaunchCooperativeKernel) \
    X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, CUDA, 1, cuLaunchCooperativeKernel_ptsz) \
    X(cuGraphLaunch, "cuGraphLaunch", 10000, CUDA, 0, cuGraphLaunch) \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, CUDA, 1, cuGraphLaunch_ptsz) \
    X(cuLaunch, "cuLaunch", 2000, CUDA, 0, cuLaunch) \
    X(cuLaunchGrid, "cuLaunchGrid", 2000, CUDA, 0, cuLaunchGrid) \
    X(cuLaunchGridAsync, "cuLaunchGridAsync", 2000, CUDA, 0, cuLaunchGridAsync) \
    X(cuDeviceGetCount, NULL, 0, CUDA, 0, NULL) \
    X(cuDeviceGetUuid, NULL, 0, CUDA, 0, NULL) \
    X(cuCtxGetDevice, NULL, 0, CUDA, 0, NULL) \
    X(cuCtxGetCurrent, NULL, 0, CUDA, 0, NULL) \
    X(cuCtxPushCurrent_v2, NULL, 0, CUDA, 0, NULL) \
    X(cuCtxPopCurrent_v2, NULL, 0, CUDA, 0, NULL) \
    X(cuDeviceGetMemPool, NULL, 0, CUDA, 0, NULL) \
    X(cuMemPoolGetAttribute, NULL, 0, CUDA, 0, NULL) \
    X(cuDeviceGetGraphMemAttribute, NULL, 0, CUDA, 0, NULL) \
    X(cuEventCreate, NULL, 0, CUDA, 0, NULL) \
    X(cuEventRecord, NULL, 0, CUDA, 0, NULL) \
    X(cuEventSynchronize, NULL, 0, CUDA, 0, NULL) \
    X(cuEventElapsedTime, NULL, 0, CUDA, 0, NULL) \
    X(cuEventDestroy_v2, NULL, 0, CUDA, 0, NULL) \
    X(cuStreamIsCapturing, NULL, 0, CUDA, 0, NULL) \
    X(cuThreadExchangeStreamCaptureMode, NULL, 0, CUDA, 0, NULL) \
    X(cuArrayGetMemoryRequirements, NULL, 0, CUDA, 0, NULL) \
    X(cuMipmappedArrayGetMemoryRequirements, NULL, 0, CUDA, 0, NULL) \
    X(nvmlDeviceGetMemoryInfo, NULL, 0, NVML, 0, nvmlDeviceGetMemoryInfo) \
    X(nvmlDeviceGetMemoryInfo_v2, NULL, 0, NVML, 0, nvmlDeviceGetMemoryInfo_v2) \
    X(nvmlInit_v2, NULL, 0, NVML, 0, NULL) \
    X(nvmlDeviceGetHandleByUUID, NULL, 0, NVML, 0, NULL) \
    X(nvmlDeviceGetIndex, NULL, 0, NVML, 0, NULL) \
    X(nvmlDeviceGetUUID, NULL, 0, NVML, 0, NULL) \
    X(nvmlDeviceGetUtilizationRates, NULL, 0, NVML, 0, nvmlDeviceGetUtilizationRates) \
    X(nvmlDeviceGetProcessUtilization, NULL, 0, NVML, 0, nvmlDeviceGetProcessUtilization) \
    X(nvmlDeviceGetComputeRunningProcesses_v2, NULL, 0, NVML, 0, nvmlDeviceGetComputeRunningProcesses_v2) \
    X(nvmlDeviceGetComputeRunningProcesses, NULL, 0, NVML, 0, nvmlDeviceGetComputeRunningProcesses) \
    X(nvmlDeviceGetComputeRunningProcesses_v3, NULL, 0, NVML, 0, nvmlDeviceGetComputeRunningProcesses_v3) \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, NULL, 0, NVML, 0, nvmlDeviceGetGraphicsRunningProcesses_v2) \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, NULL, 0, NVML, 0, nvmlDeviceGetGraphicsRunningProcesses_v3)

#endif /* VGPU_HOOKTABLE_H */
