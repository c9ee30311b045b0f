// Launcher of the selective-scan forward kernel for float, half and bfloat16 inputs.
#include <cuda_runtime.h>

#include "scan_kernels.cuh"

namespace hybridlm_scan {

const char* scan_forward(const ScanForward& params, DType dtype, void* stream) {
  if (params.args.batch == 0 || params.args.dim == 0) return nullptr;
  with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const dim3 grid(params.args.dim, params.args.batch);
    scan_forward_kernel<T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
  });
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace hybridlm_scan
