// CUDA registrations: argument checks and allocation in ATen, the work in kernels.cu.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../onebit_common.h"
#include "kernels.cuh"

namespace ciuicflow {
namespace {

void check_cuda(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(status));
}

cuda::ElemType elem_type(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kHalf: return cuda::ElemType::kFloat16;
    case at::kBFloat16: return cuda::ElemType::kBFloat16;
    default: return cuda::ElemType::kFloat32;
  }
}

std::tuple<at::Tensor, at::Tensor> pack_into(const at::Tensor& x, const float* err_in,
                                             double decay, at::Tensor& error_out,
                                             int64_t chunk_size, double* sums) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  auto xc = x.contiguous();
  auto packed = at::empty({ceil_div(n, 8)}, x.options().dtype(at::kByte));
  auto scales = at::empty({ceil_div(n, chunk_size)}, x.options().dtype(at::kFloat));
  check_cuda(cuda::onebit_pack(xc.const_data_ptr(), elem_type(xc), err_in,
                               static_cast<float>(decay), error_out.data_ptr<float>(),
                               packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), sums, n,
                               chunk_size, c10::cuda::getCurrentCUDAStream()),
             "onebit_pack");
  return {packed, scales};
}

std::tuple<at::Tensor, at::Tensor> onebit_pack_cuda(const at::Tensor& x, at::Tensor& error,
                                                     int64_t chunk_size) {
  check_pack_args(x, error, chunk_size);
  return pack_into(x, error.data_ptr<float>(), 1.0, error, chunk_size, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> onebit_pack_ef_cuda(const at::Tensor& x,
                                                                   const at::Tensor& error,
                                                                   double error_decay,
                                                                   at::Tensor& error_out,
                                                                   int64_t chunk_size) {
  check_pack_ef_args(x, error, error_out, chunk_size);
  auto norms = at::zeros({2}, x.options().dtype(at::kDouble));
  auto [packed, scales] = pack_into(x, error.const_data_ptr<float>(), error_decay, error_out,
                                    chunk_size, norms.data_ptr<double>());
  return {packed, scales, norms};
}

void onebit_unpack_into_cuda(const at::Tensor& packed, const at::Tensor& scales,
                                   int64_t numel, int64_t chunk_size, at::Tensor& out) {
  check_unpack_args("onebit_unpack", packed, scales, numel, chunk_size, 1);
  check_out("onebit_unpack", out, numel, packed);
  const c10::cuda::CUDAGuard guard(packed.device());
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
  check_cuda(cuda::onebit_unpack(pc.const_data_ptr<uint8_t>(), sc.const_data_ptr<float>(),
                                 out.data_ptr<float>(), numel, chunk_size,
                                 c10::cuda::getCurrentCUDAStream()),
             "onebit_unpack");
}

void onebit_unpack_mean_into_cuda(const at::Tensor& packed, const at::Tensor& scales,
                                        int64_t numel, int64_t chunk_size, at::Tensor& out) {
  check_unpack_args("onebit_unpack_mean", packed, scales, numel, chunk_size, 2);
  check_out("onebit_unpack_mean", out, numel, packed);
  const c10::cuda::CUDAGuard guard(packed.device());
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
  check_cuda(cuda::onebit_unpack_mean(pc.const_data_ptr<uint8_t>(), sc.const_data_ptr<float>(),
                                      out.data_ptr<float>(), pc.size(0), numel, chunk_size,
                                      c10::cuda::getCurrentCUDAStream()),
             "onebit_unpack_mean");
}

at::Tensor onebit_unpack_cuda(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                              int64_t chunk_size) {
  auto out = at::empty({numel}, scales.options().dtype(at::kFloat));
  onebit_unpack_into_cuda(packed, scales, numel, chunk_size, out);
  return out;
}

at::Tensor onebit_unpack_mean_cuda(const at::Tensor& packed, const at::Tensor& scales,
                                   int64_t numel, int64_t chunk_size) {
  auto out = at::empty({numel}, scales.options().dtype(at::kFloat));
  onebit_unpack_mean_into_cuda(packed, scales, numel, chunk_size, out);
  return out;
}

void orthogonalize_cuda(at::Tensor& m, double eps) {
  check_orthogonalize_args(m);
  if (m.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(m.device());
  auto rows = columns_as_float_rows(m);
  const int64_t batch = rows.size(0), r = rows.size(1), n = rows.size(2);
  auto workspace = at::empty({cuda::gram_schmidt_workspace_floats(batch, r, n)},
                             rows.options());
  check_cuda(cuda::gram_schmidt_rows(rows.data_ptr<float>(), batch, r, n, static_cast<float>(eps),
                                     workspace.numel() ? workspace.data_ptr<float>() : nullptr,
                                     c10::cuda::getCurrentCUDAStream()),
             "orthogonalize_");
  write_back_columns(m, rows);
}

}  // namespace

TORCH_LIBRARY_IMPL(ciuicflow, CUDA, m) {
  m.impl("onebit_pack", &onebit_pack_cuda);
  m.impl("onebit_pack_ef", &onebit_pack_ef_cuda);
  m.impl("onebit_unpack", &onebit_unpack_cuda);
  m.impl("onebit_unpack_into", &onebit_unpack_into_cuda);
  m.impl("onebit_unpack_mean", &onebit_unpack_mean_cuda);
  m.impl("onebit_unpack_mean_into", &onebit_unpack_mean_into_cuda);
  m.impl("orthogonalize_", &orthogonalize_cuda);
}

}  // namespace ciuicflow
