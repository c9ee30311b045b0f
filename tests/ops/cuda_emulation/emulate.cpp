// The selective-scan launchers of selective_scan.h, running the real kernels under the CPU emulation.
#include "cuda_emulation.h"
#include "scan_kernels.cuh"

namespace hybridlm_scan {

const char* scan_forward(const ScanForward& params, DType dtype, void*) {
  with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    emulation::launch(params.args.dim, params.args.batch, kThreads, [&] { scan_forward_kernel<T>(params); });
  });
  return nullptr;
}

const char* scan_backward(const ScanBackward& params, DType dtype, void*) {
  with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    emulation::launch(params.args.dim, params.args.batch, kThreads, [&] { scan_backward_kernel<T>(params); });
  });
  return nullptr;
}

}  // namespace hybridlm_scan
