// PyTorch operators of the Mamba-1 selective scan: torch.ops.<library>.forward / .backward.
//
// The Python wrapper (hybridlm/ops/cuda.py) validates shapes and brings every tensor to the layout the kernels
// expect; the checks here only guard memory safety. The CUDA stream comes from Python as an integer, so this file
// needs no CUDA header and compiles with a host compiler against a CPU-only torch as well.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "selective_scan.h"

// The emulated build (tests only) runs the kernels on the CPU under another library name.
#ifndef HYBRIDLM_SCAN_LIBRARY
#define HYBRIDLM_SCAN_LIBRARY hybridlm_selective_scan
#endif
#ifdef HYBRIDLM_SCAN_EMULATED
constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
#else
constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
#endif

namespace hybridlm_scan {
namespace {

using OptionalTensor = std::optional<at::Tensor>;

DType dtype_of(const at::Tensor& u) {
  switch (u.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "selective scan: u must be float32, float16 or bfloat16, got ", u.scalar_type());
  }
}

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape, const at::Tensor& u) {
  TORCH_CHECK(t.device() == u.device(), "selective scan: ", name, " is on ", t.device(), ", u on ", u.device());
  TORCH_CHECK(t.scalar_type() == dtype, "selective scan: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "selective scan: ", name, " must be ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "selective scan: ", name, " must be contiguous");
}

const void* optional_data(const OptionalTensor& t) { return t.has_value() ? t->data_ptr() : nullptr; }
const float* optional_floats(const OptionalTensor& t) {
  return t.has_value() ? static_cast<const float*>(t->data_ptr()) : nullptr;
}

// Checks the inputs and describes them for the kernels.
ScanArgs scan_args(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A, const at::Tensor& B,
                   const at::Tensor& C, const OptionalTensor& D, const OptionalTensor& z,
                   const OptionalTensor& delta_bias, bool softplus) {
  TORCH_CHECK(u.device().type() == kDevice, "selective scan: tensors must be on ", kDevice, ", got ", u.device());
  TORCH_CHECK(u.dim() == 3 && A.dim() == 2 && B.dim() == 4, "selective scan: u, A, B must be 3-, 2-, 4-dimensional");
  const int64_t batch = u.size(0), dim = u.size(1), seqlen = u.size(2), dstate = A.size(1), groups = B.size(1);
  TORCH_CHECK(dstate >= 1 && dstate <= kMaxState, "selective scan: dstate must be in [1, ", kMaxState, "]");
  TORCH_CHECK(groups >= 1 && dim % groups == 0, "selective scan: groups must divide dim");
  TORCH_CHECK(batch <= 65535 && dim <= INT32_MAX && seqlen <= INT32_MAX, "selective scan: tensors too large");
  const at::ScalarType dtype = u.scalar_type();
  check(u, "u", dtype, {batch, dim, seqlen}, u);
  check(delta, "delta", dtype, {batch, dim, seqlen}, u);
  check(A, "A", at::kFloat, {dim, dstate}, u);
  check(B, "B", dtype, {batch, groups, dstate, seqlen}, u);
  check(C, "C", dtype, {batch, groups, dstate, seqlen}, u);
  if (D.has_value()) check(*D, "D", at::kFloat, {dim}, u);
  if (z.has_value()) check(*z, "z", dtype, {batch, dim, seqlen}, u);
  if (delta_bias.has_value()) check(*delta_bias, "delta_bias", at::kFloat, {dim}, u);
  ScanArgs args{};
  args.batch = static_cast<int>(batch);
  args.dim = static_cast<int>(dim);
  args.seqlen = static_cast<int>(seqlen);
  args.dstate = static_cast<int>(dstate);
  args.groups = static_cast<int>(groups);
  args.softplus = softplus;
  args.u = u.data_ptr();
  args.delta = delta.data_ptr();
  args.z = optional_data(z);
  args.B = B.data_ptr();
  args.C = C.data_ptr();
  args.A = static_cast<const float*>(A.data_ptr());
  args.D = optional_floats(D);
  args.delta_bias = optional_floats(delta_bias);
  return args;
}

void* stream_pointer(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

// Returns (out, final_state, chunk_states); chunk_states is empty unless keep_chunk_states.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& u, const at::Tensor& delta,
                                                       const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                                                       const OptionalTensor& D, const OptionalTensor& z,
                                                       const OptionalTensor& delta_bias, bool softplus,
                                                       const OptionalTensor& initial_state, bool keep_chunk_states,
                                                       int64_t stream) {
  const c10::DeviceGuard guard(u.device());
  ScanForward params{};
  params.args = scan_args(u, delta, A, B, C, D, z, delta_bias, softplus);
  const ScanArgs& args = params.args;
  const at::TensorOptions floats = u.options().dtype(at::kFloat);
  if (initial_state.has_value()) check(*initial_state, "initial_state", at::kFloat, {args.batch, args.dim, args.dstate}, u);
  at::Tensor out = at::empty_like(u);
  at::Tensor final_state = at::empty({args.batch, args.dim, args.dstate}, floats);
  at::Tensor chunk_states =
      at::empty({keep_chunk_states ? args.batch : 0, args.dim, num_chunks(args.seqlen), args.dstate}, floats);
  params.initial_state = optional_floats(initial_state);
  params.out = out.data_ptr();
  params.final_state = static_cast<float*>(final_state.data_ptr());
  params.chunk_states = keep_chunk_states ? static_cast<float*>(chunk_states.data_ptr()) : nullptr;
  const char* error = scan_forward(params, dtype_of(u), stream_pointer(stream));
  TORCH_CHECK(error == nullptr, "selective scan forward: ", error);
  return {out, final_state, chunk_states};
}

// Returns (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); an entry is empty where its input is absent
// (or, for dinitial_state, not wanted). dB and dC are float32.
std::vector<at::Tensor> backward(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                 const at::Tensor& B, const at::Tensor& C, const OptionalTensor& D,
                                 const OptionalTensor& z, const OptionalTensor& delta_bias, bool softplus,
                                 const at::Tensor& chunk_states, const at::Tensor& dout,
                                 const OptionalTensor& dfinal_state, bool want_dinitial_state, int64_t stream) {
  const c10::DeviceGuard guard(u.device());
  ScanBackward params{};
  params.args = scan_args(u, delta, A, B, C, D, z, delta_bias, softplus);
  const ScanArgs& args = params.args;
  const at::TensorOptions floats = u.options().dtype(at::kFloat);
  check(chunk_states, "chunk_states", at::kFloat, {args.batch, args.dim, num_chunks(args.seqlen), args.dstate}, u);
  check(dout, "dout", u.scalar_type(), u.sizes(), u);
  if (dfinal_state.has_value()) check(*dfinal_state, "dfinal_state", at::kFloat, {args.batch, args.dim, args.dstate}, u);
  auto zeros_if = [&](bool present, at::IntArrayRef shape) { return at::zeros(present ? shape : at::IntArrayRef{0}, floats); };
  at::Tensor du = at::empty_like(u), ddelta = at::empty_like(u);
  at::Tensor dz = z.has_value() ? at::empty_like(u) : at::empty({0}, u.options());
  at::Tensor dA = at::zeros({args.dim, args.dstate}, floats);
  at::Tensor dB = at::zeros(B.sizes(), floats), dC = at::zeros(C.sizes(), floats);
  at::Tensor dD = zeros_if(D.has_value(), {args.dim});
  at::Tensor ddelta_bias = zeros_if(delta_bias.has_value(), {args.dim});
  at::Tensor dinitial_state = want_dinitial_state ? at::empty({args.batch, args.dim, args.dstate}, floats)
                                                  : at::empty({0}, floats);
  params.chunk_states = static_cast<const float*>(chunk_states.data_ptr());
  params.dout = dout.data_ptr();
  params.dfinal_state = optional_floats(dfinal_state);
  params.du = du.data_ptr();
  params.ddelta = ddelta.data_ptr();
  params.dz = z.has_value() ? dz.data_ptr() : nullptr;
  params.dA = static_cast<float*>(dA.data_ptr());
  params.dB = static_cast<float*>(dB.data_ptr());
  params.dC = static_cast<float*>(dC.data_ptr());
  params.dD = D.has_value() ? static_cast<float*>(dD.data_ptr()) : nullptr;
  params.ddelta_bias = delta_bias.has_value() ? static_cast<float*>(ddelta_bias.data_ptr()) : nullptr;
  params.dinitial_state = want_dinitial_state ? static_cast<float*>(dinitial_state.data_ptr()) : nullptr;
  const char* error = scan_backward(params, dtype_of(u), stream_pointer(stream));
  TORCH_CHECK(error == nullptr, "selective scan backward: ", error);
  return {du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state};
}

}  // namespace
}  // namespace hybridlm_scan

TORCH_LIBRARY(HYBRIDLM_SCAN_LIBRARY, m) {
  m.def(
      "forward(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? delta_bias, "
      "bool softplus, Tensor? initial_state, bool keep_chunk_states, int stream) -> (Tensor, Tensor, Tensor)",
      &hybridlm_scan::forward);
  m.def(
      "backward(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? delta_bias, "
      "bool softplus, Tensor chunk_states, Tensor dout, Tensor? dfinal_state, bool want_dinitial_state, int stream) "
      "-> Tensor[]",
      &hybridlm_scan::backward);
}
