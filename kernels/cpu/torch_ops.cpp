// The CPU kernels of the dispatcher ops hybridlm::cpu_linear, cpu_packed_linear, cpu_int8_linear and cpu_attention
// (their schemas and fake kernels are defined in hybridlm/ops/cpu_kernels.py): linear_rows and linear_rows_packed
// (linear.cpp), int8_linear_rows (integer_linear.cpp) and grouped_attention_bf16 (attention.cpp) behind torch's C++
// dispatcher.
// Built against torch's headers by hybridlm/ops/cpu_kernels.py, separately from the plain C library of the scans,
// because a call out of a compiled graph into a kernel written in Python costs ~25 us and one into C++ ~7 (a 64 x
// 64 product on an AVX2 EPYC), and a decode step makes hundreds of such calls.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

extern "C" void grouped_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, const uint8_t* mask,
                                       float* out, int64_t batch, int64_t heads, int64_t group, int64_t q_len,
                                       int64_t slots, int64_t dim, int64_t dim_v, const int64_t* strides,
                                       float scale, int64_t threads);
extern "C" int linear_rows(const void* x, int64_t x_kind, const void* w, int64_t w_kind, const float* scale,
                           const int8_t* zero, const float* bias, void* y, int64_t rows, int64_t in, int64_t out,
                           int64_t threads);
extern "C" int linear_rows_packed(const void* x, int64_t x_kind, const void* packed, int64_t w_kind,
                                  const float* scale, const int8_t* zero, const float* bias, void* y, int64_t rows,
                                  int64_t in, int64_t out, int64_t threads);
extern "C" int64_t linear_packed_outputs();
extern "C" int int8_linear_rows(const void* x, int64_t x_bf16, const int8_t* codes, const float* scales,
                                int64_t w_packed, const float* bias, void* y, int64_t rows, int64_t in, int64_t out,
                                int64_t group, int64_t threads);
extern "C" int64_t int8_linear_block_outputs();

namespace {

// linear_rows' kinds: inputs fp32 or bf16, weights bf16 or int8
int64_t kind(at::ScalarType type) { return type == at::kFloat ? 0 : type == at::kBFloat16 ? 1 : 2; }

// `extra` ([out] or [out, 1]) contiguous in `type`, or undefined.
at::Tensor per_output(const std::optional<at::Tensor>& extra, const char* name, int64_t out, at::ScalarType type) {
  if (!extra.has_value()) return at::Tensor();
  TORCH_CHECK_VALUE(extra->numel() == out, "linear_rows: ", name, " ", extra->sizes(),
                    " has not one entry per output (", out, ")");
  return extra->detach().to(type).contiguous();
}

// y = x @ ((w - zero_point) * scale)^T + bias, like x, for `out` outputs of `in` features: w is `weight`, in
// nn.Linear's layout [out, in], or with `packed` its blocks of 16 outputs [ceil(out / 16), in, 16] (linear.cpp's
// packed_block); see cpu_kernels.linear_rows.
at::Tensor linear_product(const at::Tensor& x, const at::Tensor& weight, bool packed, int64_t out, int64_t in,
                          const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& zero_point,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "linear_rows: weight on ", weight.device(),
                    ", x on ", x.device(), ": both must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() > 0 && x.size(-1) == in && (x.scalar_type() == at::kFloat ||
                                                        x.scalar_type() == at::kBFloat16),
                    "linear_rows: x ", x.sizes(), " ", x.scalar_type(), " against weight ", weight.sizes(),
                    ": x must be fp32 or bf16 with ", in, " features");
  const bool codes = weight.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE((weight.scalar_type() == at::kBFloat16 || codes) && codes == scale.has_value(),
                    "linear_rows: weight ", weight.scalar_type(), " with", scale.has_value() ? "" : "out",
                    " a scale; it takes bf16 weights, or int8 codes with their scale");
  const at::Tensor scales = per_output(scale, "scale", out, at::kFloat);
  const at::Tensor zeros = per_output(zero_point, "zero_point", out, at::kChar);
  const at::Tensor biases = per_output(bias, "bias", out, at::kFloat);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  at::Tensor y = at::empty(sizes, x.options());
  auto pointer = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
  (packed ? linear_rows_packed : linear_rows)(
      xc.data_ptr(), kind(x.scalar_type()), wc.data_ptr(), kind(weight.scalar_type()),
      static_cast<const float*>(pointer(scales)), static_cast<const int8_t*>(pointer(zeros)),
      static_cast<const float*>(pointer(biases)), y.data_ptr(), xc.numel() / in, in, out, at::get_num_threads());
  return y;
}

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                      const std::optional<at::Tensor>& zero_point, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) > 0, "linear_rows: weight ", weight.sizes(),
                    ": it takes a 2-D weight with at least one input feature");
  return linear_product(x, weight, false, weight.size(0), weight.size(1), scale, zero_point, bias);
}

at::Tensor cpu_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& zero_point,
                             const std::optional<at::Tensor>& bias) {
  const int64_t block = linear_packed_outputs();
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(1) > 0 && packed.size(2) == block && out_features > 0
                        && (out_features + block - 1) / block == packed.size(0),
                    "linear_rows: packed weight ", packed.sizes(), " for ", out_features, " outputs: it takes "
                    "[ceil(out / ", block, "), in, ", block, "] (cpu_kernels.pack_linear_weight)");
  return linear_product(x, packed, true, out_features, packed.size(1), scale, zero_point, bias);
}

// y = x @ W^T + bias, like x, in int8 x int8 products (integer_linear.cpp), with one scale per output and group of
// features. W's codes either packed in pairs of features for blocks of 16 outputs, [ceil(out / 16), in / 2, 16, 2],
// with scales [ceil(out / 16), in / group, 16] (weights packed once, ahead: a compiled graph's constants), or as
// they are, [out, in] with scales [out, in / group] (each block packed where it is multiplied: eager calls); x
// quantized per row and group inside. See cpu_kernels.int8_linear_rows.
at::Tensor cpu_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           int64_t out_features, const std::optional<at::Tensor>& bias) {
  const int64_t block = int8_linear_block_outputs(), blocks = (out_features + block - 1) / block;
  const bool packed = codes.dim() == 4;
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kChar && out_features > 0
                        && (packed ? codes.size(0) == blocks && codes.size(1) > 0 && codes.size(2) == block
                                         && codes.size(3) == 2
                                   : codes.dim() == 2 && codes.size(0) == out_features && codes.size(1) > 0
                                         && codes.size(1) % 2 == 0),
                    "int8_linear_rows: codes ", codes.sizes(), " ", codes.scalar_type(), " for ", out_features,
                    " outputs: it takes int8 [out, in] (in even), or packed [ceil(out / ", block, "), in / 2, ",
                    block, ", 2] (cpu_kernels.pack_int8_pairs)");
  // the scales' groups are their second dimension in both layouts
  const int64_t in = packed ? 2 * codes.size(1) : codes.size(1), groups = scales.dim() >= 2 ? scales.size(1) : 0;
  const int64_t group = groups > 0 && in % groups == 0 ? in / groups : 0;
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && group > 0 && group % 2 == 0
                        && (packed ? scales.dim() == 3 && scales.size(0) == blocks && scales.size(2) == block
                                   : scales.dim() == 2 && scales.size(0) == out_features),
                    "int8_linear_rows: scales ", scales.sizes(), " ", scales.scalar_type(), " for codes ",
                    codes.sizes(), ": it takes fp32 [out, in / group], or packed [blocks, in / group, ", block,
                    "] beside packed codes, the group even");
  TORCH_CHECK_VALUE(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
                    "int8_linear_rows: x, codes and scales must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() > 0 && x.size(-1) == in && (x.scalar_type() == at::kFloat ||
                                                        x.scalar_type() == at::kBFloat16),
                    "int8_linear_rows: x ", x.sizes(), " ", x.scalar_type(), ": it takes fp32 or bf16 with ", in,
                    " features");
  const at::Tensor biases = per_output(bias, "bias", out_features, at::kFloat);
  const at::Tensor xc = x.contiguous(), wc = codes.contiguous(), sc = scales.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  at::Tensor y = at::empty(sizes, x.options());
  int8_linear_rows(xc.data_ptr(), x.scalar_type() == at::kBFloat16, wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
                   packed, biases.defined() ? biases.data_ptr<float>() : nullptr, y.data_ptr(), xc.numel() / in, in,
                   out_features, group, at::get_num_threads());
  return y;
}

// Softmax attention in fp32 over bf16 keys and values, rounded once to q's dtype; see attention.cpp and
// cpu_kernels.grouped_attention.
at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes().slice(0, 3) == v.sizes().slice(0, 3)
                        && k.size(0) == q.size(0) && k.size(3) == q.size(3) && k.size(1) > 0
                        && q.size(1) % k.size(1) == 0,
                    "grouped_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ": it takes q [batch, "
                    "q_heads, q_len, dim], k [batch, kv_heads, slots, dim], v [batch, kv_heads, slots, dim_v], "
                    "kv_heads dividing q_heads");
  TORCH_CHECK_VALUE(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.stride(3) == 1
                        && v.stride(3) == 1,
                    "grouped_attention: k ", k.scalar_type(), ", v ", v.scalar_type(), ": it takes bf16 keys and "
                    "values whose rows are contiguous");
  TORCH_CHECK_VALUE(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
                    "grouped_attention: q, k and v must be on the CPU");
  const int64_t batch = q.size(0), q_heads = q.size(1), q_len = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), slots = k.size(2), dim_v = v.size(3), group = q_heads / kv_heads;
  // the query heads of a group times the step's queries are the rows of their key/value head
  const at::Tensor queries = q.to(at::kFloat).reshape({batch, kv_heads, group * q_len, dim}).contiguous();
  int64_t strides[10] = {k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0, 0, 0, 0};
  at::Tensor seen;
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool, "grouped_attention: mask ", mask->scalar_type(),
                      "; it takes a boolean mask (True: attend)");
    seen = mask->expand({batch, q_heads, q_len, slots});  // a view: broadcast dimensions have stride 0
    for (int i = 0; i < 4; ++i) strides[6 + i] = seen.stride(i);
  }
  at::Tensor out = at::empty({batch, kv_heads, group * q_len, dim_v}, q.options().dtype(at::kFloat));
  grouped_attention_bf16(queries.data_ptr<float>(), static_cast<const uint16_t*>(k.data_ptr()),
                         static_cast<const uint16_t*>(v.data_ptr()),
                         seen.defined() ? static_cast<const uint8_t*>(seen.data_ptr()) : nullptr,
                         out.data_ptr<float>(), batch, kv_heads, group, q_len, slots, dim, dim_v, strides,
                         float(scale.has_value() ? *scale : std::pow(double(dim), -0.5)), at::get_num_threads());
  return out.reshape({batch, q_heads, q_len, dim_v}).to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(hybridlm, CPU, m) {
  m.impl("cpu_linear", &cpu_linear);
  m.impl("cpu_packed_linear", &cpu_packed_linear);
  m.impl("cpu_int8_linear", &cpu_int8_linear);
  m.impl("cpu_attention", &cpu_attention);
}
