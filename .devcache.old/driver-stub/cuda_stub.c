/* tvmflash: stand-in for the CUDA driver at build time; every call fails */
#define STUB(name) int name(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }
STUB(cuDeviceGetName) STUB(cuFuncSetAttribute) STUB(cuGetErrorName) STUB(cuGetErrorString)
STUB(cuLaunchKernelEx) STUB(cuModuleGetFunction) STUB(cuModuleLoadData) STUB(cuModuleUnload)
STUB(cuTensorMapEncodeTiled)
