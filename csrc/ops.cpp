// The library's module init and the schemas of the 1-bit and Gram-Schmidt ops. Kernels register
// themselves per backend: csrc/cpu/*.cpp for CPU, csrc/cuda/* for CUDA. A compressor added later
// keeps its schemas beside its CPU kernels (TORCH_LIBRARY_FRAGMENT in csrc/cpu/intq.cpp): adding one
// adds its kernel files and its wrappers in ciuicflow/ops.py, nothing here. Nothing here communicates.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import ciuicflow._C` loads this library, which runs the registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(ciuicflow, m) {
  // error is updated in place; returns (packed uint8[ceil(n/8)], scales float32[ceil(n/chunk_size)])
  m.def("onebit_pack(Tensor x, Tensor(a!) error, int chunk_size) -> (Tensor, Tensor)");
  // the same from error_out = error_decay * error (error_out may be error itself), plus float64
  // (sum error_out^2, sum x^2) on x's device: the accuracy guard's norms in one pass
  m.def("onebit_pack_ef(Tensor x, Tensor error, float error_decay, Tensor(a!) error_out, int chunk_size) -> (Tensor, Tensor, Tensor)");
  m.def("onebit_unpack(Tensor packed, Tensor scales, int numel, int chunk_size) -> Tensor");
  // _into writes into a caller's float32 buffer of numel elements (no allocation on the hot path)
  m.def("onebit_unpack_into(Tensor packed, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  // packed [W, nbytes], scales [W, nchunks] -> mean of the W decompressed vectors (on CPU packed
  // may also be [W, nchunks, block bytes]: each chunk's signs at the start of its block)
  m.def("onebit_unpack_mean(Tensor packed, Tensor scales, int numel, int chunk_size) -> Tensor");
  m.def("onebit_unpack_mean_into(Tensor packed, Tensor scales, int numel, int chunk_size, Tensor(a!) out) -> ()");
  // Gram-Schmidt on the columns of m ([n, r] or [B, n, r]), in place
  m.def("orthogonalize_(Tensor(a!) m, float eps) -> ()");
}
