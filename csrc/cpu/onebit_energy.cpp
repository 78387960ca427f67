// The energy of what a 1-bit pack packed, per chunk: the outlier gate's measure
// (ciuicflow/compression/outliers.py). After onebit_pack_ef, y = scale * sign + error_out; the gate
// needs, per chunk, sum y^2 and max y^2. In torch ops that is five passes over the tensor (unpack,
// add the error, square, sum, max) and cost the pack 2.5x its native time; here it is one read of
// the error. CPU only: on CUDA the torch ops are not the bottleneck (outliers.py uses them there).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "onebit_common.h"

namespace ciuicflow {
namespace {


// (sum y^2, max y^2) over one chunk of len elements, y = (bit ? scale : -scale) + error: the same
// float operations as onebit_unpack followed by adding the error, so y is bit for bit what those
// two ops give.
CIUICFLOW_HOT void chunk_energy(const uint8_t* packed, float scale, const float* error,
                                int64_t len, float* out) {
  const IntLanes bit = {1, 2, 4, 8, 16, 32, 64, 128};
  const Lanes plus = {scale, scale, scale, scale, scale, scale, scale, scale};
  const Lanes minus = -plus;
  Lanes sum = {}, top = {};
  const int64_t body = len - len % 8;
  for (int64_t i = 0; i < body; i += 8) {
    const int32_t byte = packed[i / 8];
    const IntLanes set = (IntLanes{byte, byte, byte, byte, byte, byte, byte, byte} & bit) != 0;
    Lanes e;
    std::memcpy(&e, error + i, sizeof e);
    const Lanes y = (set ? plus : minus) + e;
    const Lanes y2 = y * y;
    sum += y2;
    top = top > y2 ? top : y2;
  }
  float total = 0, largest = 0;
  for (int k = 0; k < 8; ++k) total += sum[k], largest = std::max(largest, top[k]);
  for (int64_t i = body; i < len; ++i) {
    const float y = (((packed[i / 8] >> (i % 8)) & 1) ? scale : -scale) + error[i];
    total += y * y;
    largest = std::max(largest, y * y);
  }
  out[0] = total;
  out[1] = largest;
}

at::Tensor onebit_chunk_energy_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                   const at::Tensor& error, int64_t chunk_size) {
  const char* op = "onebit_chunk_energy";
  TORCH_CHECK(error.dim() == 1 && error.scalar_type() == at::kFloat, op,
              ": error must be a 1-D float32 tensor, got ", error.scalar_type(), " ",
              error.sizes());
  const int64_t numel = error.numel();
  check_unpack_args(op, packed, scales, numel, chunk_size, 1);
  TORCH_CHECK(error.device() == packed.device(), op, ": error is on ", error.device(),
              ", packed on ", packed.device());
  auto pc = packed.contiguous();
  auto sc = scales.contiguous();
  auto ec = error.contiguous();
  const int64_t nchunks = sc.numel();
  auto out = at::empty({nchunks, 2}, sc.options());
  const uint8_t* p = pc.const_data_ptr<uint8_t>();
  const float* s = sc.const_data_ptr<float>();
  const float* e = ec.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, kGrainElements / chunk_size);
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * chunk_size;
      chunk_energy(p + begin / 8, s[c], e + begin, std::min(chunk_size, numel - begin),
                   o + 2 * c);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ciuicflow, m) {
  // packed uint8 [ceil(n/8)], scales float32 [ceil(n/chunk_size)], error float32 [n] ->
  // float32 [ceil(n/chunk_size), 2]: per chunk (sum y^2, max y^2), y = scale * sign + error
  m.def("onebit_chunk_energy(Tensor packed, Tensor scales, Tensor error, int chunk_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(ciuicflow, CPU, m) { m.impl("onebit_chunk_energy", &onebit_chunk_energy_cpu); }

}  // namespace ciuicflow
