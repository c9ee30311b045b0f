// The selective-scan launchers of selective_scan.h, running the real kernels under the CPU emulation.
//
// Every buffer the kernels must write in full is first filled with NaN, so that an element they miss fails the
// tests (the accumulated gradients dA, dB, dC, dD, ddelta_bias are zero-filled by the binding, as on the GPU).
#include <cmath>

#include "cuda_emulation.h"
#include "scan_kernels.cuh"

namespace hybridlm_scan {
namespace {

template <typename T>
void poison(void* data, int64_t count) {
  if (data == nullptr) return;
  T* values = static_cast<T*>(data);
  for (int64_t i = 0; i < count; ++i) values[i] = from_float<T>(NAN);
}

}  // namespace

const char* scan_forward(const ScanForward& params, DType dtype, void*) {
  const ScanArgs& a = params.args;
  const int64_t rows = int64_t(a.batch) * a.dim;
  with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    poison<T>(params.out, rows * a.seqlen);
    poison<float>(params.final_state, rows * a.dstate);
    poison<float>(params.chunk_states, rows * num_chunks(a.seqlen) * a.dstate);
    emulation::launch(a.dim, a.batch, kThreads, [&] { scan_forward_kernel<T>(params); });
  });
  return nullptr;
}

const char* scan_backward(const ScanBackward& params, DType dtype, void*) {
  const ScanArgs& a = params.args;
  const int64_t rows = int64_t(a.batch) * a.dim;
  with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    for (void* gradient : {params.du, params.ddelta, params.dz}) poison<T>(gradient, rows * a.seqlen);
    poison<float>(params.dinitial_state, rows * a.dstate);
    emulation::launch(a.dim, a.batch, kThreads, [&] { scan_backward_kernel<T>(params); });
  });
  return nullptr;
}

}  // namespace hybridlm_scan
