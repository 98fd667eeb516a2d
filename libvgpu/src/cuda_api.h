/*
 * The slice of the CUDA driver API and NVML that libvgpu touches, declared here so the shim
 * builds without a CUDA toolkit. Layouts follow cuda.h / nvml.h of CUDA 12.x (64-bit Linux);
 * only the types and functions the shim (and its test double) need are declared.
 */
#ifndef VGPU_CUDA_API_H
#define VGPU_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

/* ---- CUDA driver ------------------------------------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUfunc_st *CUfunction;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUstream_st *CUstream;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUkern_st *CUkernel;
typedef struct CUevent_st *CUevent;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901

/* Stream capture (CUstreamCaptureMode / CUstreamCaptureStatus). */
#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_STREAM_CAPTURE_STATUS_INVALIDATED 2

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef enum CUarray_format_enum {
    CU_AD_FORMAT_UNSIGNED_INT8 = 0x01,
    CU_AD_FORMAT_UNSIGNED_INT16 = 0x02,
    CU_AD_FORMAT_UNSIGNED_INT32 = 0x03,
    CU_AD_FORMAT_SIGNED_INT8 = 0x08,
    CU_AD_FORMAT_SIGNED_INT16 = 0x09,
    CU_AD_FORMAT_SIGNED_INT32 = 0x0a,
    CU_AD_FORMAT_HALF = 0x10,
    CU_AD_FORMAT_FLOAT = 0x20,
} CUarray_format;

typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

#define CUDA_ARRAY3D_LAYERED 0x01
#define CUDA_ARRAY3D_CUBEMAP 0x04

typedef struct CUDA_ARRAY_MEMORY_REQUIREMENTS_st {
    size_t size;
    size_t alignment;
    unsigned int reserved[4];
} CUDA_ARRAY_MEMORY_REQUIREMENTS;

typedef enum CUmemLocationType_enum {
    CU_MEM_LOCATION_TYPE_INVALID = 0x0,
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
    CU_MEM_LOCATION_TYPE_HOST = 0x2,
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 0x3,
    CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 0x4,
} CUmemLocationType;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUlaunchAttribute_st {
    int id;
    char pad[4];
    char value[64];
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct CUctxCreateParams_st CUctxCreateParams;
typedef struct CUexecAffinityParam_st CUexecAffinityParam;

/* CUDA_KERNEL_NODE_PARAMS_v2 (cuGraphAddKernelNode_v2), used by the tests' double only. */
typedef struct CUDA_KERNEL_NODE_PARAMS_v2_st {
    CUfunction func;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    void **kernelParams;
    void **extra;
    CUkernel kern;
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS_v2;

/* CUDA_MEM_ALLOC_NODE_PARAMS_v1 (cuGraphAddMemAllocNode), used by the tests' double only. */
typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_v1_st {
    unsigned char poolProps[88]; /* CUmemPoolProps */
    const void *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr; /* out */
} CUDA_MEM_ALLOC_NODE_PARAMS;

#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2

#define CU_GET_PROC_ADDRESS_DEFAULT 0x0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM 0x1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 0x2

typedef enum CUdriverProcAddressQueryResult_enum {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2,
} CUdriverProcAddressQueryResult;

/* Function types, named <symbol>_fn. */
typedef CUresult (*cuInit_fn)(unsigned int);
typedef CUresult (*cuGetProcAddress_fn)(const char *, void **, int, cuuint64_t);
typedef CUresult (*cuGetProcAddress_v2_fn)(const char *, void **, int, cuuint64_t,
                                           CUdriverProcAddressQueryResult *);
typedef CUresult (*cuDeviceGetCount_fn)(int *);
typedef CUresult (*cuDeviceGetUuid_fn)(CUuuid *, CUdevice);
typedef CUresult (*cuCtxGetDevice_fn)(CUdevice *);
typedef CUresult (*cuCtxGetCurrent_fn)(CUcontext *);
typedef CUresult (*cuCtxPushCurrent_v2_fn)(CUcontext);
typedef CUresult (*cuDeviceGetMemPool_fn)(CUmemoryPool *, CUdevice);
typedef CUresult (*cuMemPoolGetAttribute_fn)(CUmemoryPool, int, void *);
typedef CUresult (*cuMemPoolTrimTo_fn)(CUmemoryPool, size_t);
typedef CUresult (*cuDeviceGetGraphMemAttribute_fn)(CUdevice, int, void *);
typedef CUresult (*cuDeviceGraphMemTrim_fn)(CUdevice);
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
typedef CUresult (*cuCtxPopCurrent_v2_fn)(CUcontext *);
typedef CUresult (*cuMemAlloc_v2_fn)(CUdeviceptr *, size_t);
typedef CUresult (*cuMemAllocPitch_v2_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*cuMemAllocManaged_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*cuMemAllocAsync_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*cuMemAllocFromPoolAsync_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*cuMemFree_v2_fn)(CUdeviceptr);
typedef CUresult (*cuMemFreeAsync_fn)(CUdeviceptr, CUstream);
typedef CUresult (*cuMemCreate_fn)(CUmemGenericAllocationHandle *, size_t,
                                   const CUmemAllocationProp *, unsigned long long);
typedef CUresult (*cuMemRelease_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*cuMemMap_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                unsigned long long);
typedef CUresult (*cuMemUnmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*cuArrayCreate_v2_fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
typedef CUresult (*cuArray3DCreate_v2_fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
typedef CUresult (*cuMipmappedArrayCreate_fn)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *,
                                              unsigned int);
typedef CUresult (*cuArrayDestroy_fn)(CUarray);
typedef CUresult (*cuMipmappedArrayDestroy_fn)(CUmipmappedArray);
typedef CUresult (*cuArrayGetMemoryRequirements_fn)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUarray,
                                                    CUdevice);
typedef CUresult (*cuMipmappedArrayGetMemoryRequirements_fn)(CUDA_ARRAY_MEMORY_REQUIREMENTS *,
                                                             CUmipmappedArray, CUdevice);
typedef CUresult (*cuMemGetInfo_v2_fn)(size_t *, size_t *);
typedef CUresult (*cuDeviceTotalMem_v2_fn)(size_t *, CUdevice);
typedef CUresult (*cuCtxCreate_v2_fn)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*cuCtxCreate_v3_fn)(CUcontext *, CUexecAffinityParam *, int, unsigned int,
                                      CUdevice);
typedef CUresult (*cuCtxCreate_v4_fn)(CUcontext *, CUctxCreateParams *, unsigned int, CUdevice);
typedef CUresult (*cuCtxDestroy_v2_fn)(CUcontext);
typedef CUresult (*cuDevicePrimaryCtxRetain_fn)(CUcontext *, CUdevice);
typedef CUresult (*cuDevicePrimaryCtxRelease_v2_fn)(CUdevice);
typedef CUresult (*cuDevicePrimaryCtxReset_v2_fn)(CUdevice);
typedef CUresult (*cuModuleLoad_fn)(CUmodule *, const char *);
typedef CUresult (*cuModuleLoadData_fn)(CUmodule *, const void *);
typedef CUresult (*cuModuleLoadDataEx_fn)(CUmodule *, const void *, unsigned int, int *, void **);
typedef CUresult (*cuModuleLoadFatBinary_fn)(CUmodule *, const void *);
typedef CUresult (*cuModuleUnload_fn)(CUmodule);
typedef CUresult (*cuLibraryLoadData_fn)(CUlibrary *, const void *, int *, void **, unsigned int,
                                         int *, void **, unsigned int);
typedef CUresult (*cuLibraryLoadFromFile_fn)(CUlibrary *, const char *, int *, void **,
                                             unsigned int, int *, void **, unsigned int);
typedef CUresult (*cuLibraryUnload_fn)(CUlibrary);
typedef CUresult (*cuLaunchKernel_fn)(CUfunction, unsigned int, unsigned int, unsigned int,
                                      unsigned int, unsigned int, unsigned int, unsigned int,
                                      CUstream, void **, void **);
typedef CUresult (*cuLaunchKernelEx_fn)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*cuLaunchCooperativeKernel_fn)(CUfunction, unsigned int, unsigned int,
                                                 unsigned int, unsigned int, unsigned int,
                                                 unsigned int, unsigned int, CUstream, void **);
typedef CUresult (*cuGraphLaunch_fn)(CUgraphExec, CUstream);
typedef CUresult (*cuLaunch_fn)(CUfunction);
typedef CUresult (*cuEventCreate_fn)(CUevent *, unsigned int);
typedef CUresult (*cuEventRecord_fn)(CUevent, CUstream);
typedef CUresult (*cuEventSynchronize_fn)(CUevent);
typedef CUresult (*cuEventElapsedTime_fn)(float *, CUevent, CUevent);
typedef CUresult (*cuEventDestroy_v2_fn)(CUevent);
typedef CUresult (*cuStreamIsCapturing_fn)(CUstream, int *);
typedef CUresult (*cuThreadExchangeStreamCaptureMode_fn)(int *);
typedef CUresult (*cuLaunchGrid_fn)(CUfunction, int, int);
typedef CUresult (*cuLaunchGridAsync_fn)(CUfunction, int, int, CUstream);
/* per-thread default stream variants have the same signatures */
typedef cuMemAllocAsync_fn cuMemAllocAsync_ptsz_fn;
typedef cuMemAllocFromPoolAsync_fn cuMemAllocFromPoolAsync_ptsz_fn;
typedef cuMemFreeAsync_fn cuMemFreeAsync_ptsz_fn;
typedef cuLaunchKernel_fn cuLaunchKernel_ptsz_fn;
typedef cuLaunchKernelEx_fn cuLaunchKernelEx_ptsz_fn;
typedef cuLaunchCooperativeKernel_fn cuLaunchCooperativeKernel_ptsz_fn;
typedef cuGraphLaunch_fn cuGraphLaunch_ptsz_fn;

/* ---- NVML ------------------------------------------------------------------------------- */

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct nvmlUtilization_st {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp; /* microseconds since the epoch */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96

typedef nvmlReturn_t (*nvmlInit_v2_fn)(void);
typedef nvmlReturn_t (*nvmlDeviceGetHandleByUUID_fn)(const char *, nvmlDevice_t *);
typedef nvmlReturn_t (*nvmlDeviceGetIndex_fn)(nvmlDevice_t, unsigned int *);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_fn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*nvmlDeviceGetMemoryInfo_v2_fn)(nvmlDevice_t, nvmlMemory_v2_t *);
typedef nvmlReturn_t (*nvmlDeviceGetUtilizationRates_fn)(nvmlDevice_t, nvmlUtilization_t *);
typedef nvmlReturn_t (*nvmlDeviceGetProcessUtilization_fn)(nvmlDevice_t,
                                                           nvmlProcessUtilizationSample_t *,
                                                           unsigned int *, unsigned long long);
typedef nvmlReturn_t (*nvmlDeviceGetComputeRunningProcesses_v2_fn)(nvmlDevice_t, unsigned int *,
                                                                   nvmlProcessInfo_v2_t *);
/* v1 (nvmlProcessInfo_v1_t: pid, usedGpuMemory), v2 and v3 (nvmlProcessInfo_v2_t) */
typedef nvmlReturn_t (*nvml_process_list_fn)(nvmlDevice_t, unsigned int *, void *);

#endif /* VGPU_CUDA_API_H */
