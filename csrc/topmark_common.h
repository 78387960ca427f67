// The topmark codec's layout (ciuicflow/compression/topmark.py has the format and why): how many
// elements a chunk marks, its block's sizes, and the combinatorial number system that writes the
// marked positions as one integer below C(len, k) (log2 C(len, k) bits: 248 for 55 of 512, where a
// bitmap would take 512).
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace ciuicflow {
namespace topmark {

constexpr int64_t kMaxChunk = 512;
// marked elements of a chunk of len: 55/512 of it, rounded (55 of 512: the most whose rank fits
// 31 bytes), at least one (the scale is the marked elements' mean |y|: a chunk without one could
// not send its others' magnitude)
CIUICFLOW_HD constexpr int64_t marked(int64_t len) {
  return len == 0 ? 0 : ((len * 55 + 256) / 512 > 0 ? (len * 55 + 256) / 512 : 1);
}
constexpr int64_t kMaxMarked = marked(kMaxChunk);

// An unsigned integer of 256 bits (C(512, 55) < 2^248), little-endian limbs.
struct U256 {
  uint64_t w[4] = {0, 0, 0, 0};
};

CIUICFLOW_HD inline U256 add(const U256& a, const U256& b) {
  U256 r;
  uint64_t carry = 0;
  for (int i = 0; i < 4; ++i) {
    const uint64_t s = a.w[i] + b.w[i];
    const uint64_t t = s + carry;
    carry = static_cast<uint64_t>(s < a.w[i]) | static_cast<uint64_t>(t < s);
    r.w[i] = t;
  }
  return r;
}

CIUICFLOW_HD inline U256 sub(const U256& a, const U256& b) {  // a >= b
  U256 r;
  uint64_t borrow = 0;
  for (int i = 0; i < 4; ++i) {
    const uint64_t d = a.w[i] - b.w[i];
    const uint64_t next = (a.w[i] < b.w[i]) || (d < borrow);
    r.w[i] = d - borrow;
    borrow = next;
  }
  return r;
}

CIUICFLOW_HD inline bool less(const U256& a, const U256& b) {
  for (int i = 3; i >= 0; --i)
    if (a.w[i] != b.w[i]) return a.w[i] < b.w[i];
  return false;
}

inline int bit_length(const U256& a) {
  for (int i = 3; i >= 0; --i)
    if (a.w[i]) return 64 * i + 64 - __builtin_clzll(a.w[i]);
  return 0;
}

// C(n, j) for n <= kMaxChunk, j <= kMaxMarked (Pascal's rule: additions only, exact), and each
// chunk length's rank bytes: ceil(bits of C(len, marked(len)) - 1, the largest rank, / 8). The
// kernels read C(n, j) at binom[n * kStride + j] (on a GPU, a copy of this table).
constexpr int64_t kStride = kMaxMarked + 1;

struct Tables {
  U256 binom[kMaxChunk + 1][kMaxMarked + 1];
  int64_t rank_bytes[kMaxChunk + 1];
  Tables() {
    for (int64_t n = 0; n <= kMaxChunk; ++n) {
      binom[n][0].w[0] = 1;
      for (int64_t j = 1; j <= kMaxMarked; ++j)
        binom[n][j] = n == 0 ? U256{} : add(binom[n - 1][j - 1], binom[n - 1][j]);
    }
    U256 one;
    one.w[0] = 1;
    for (int64_t len = 0; len <= kMaxChunk; ++len)
      rank_bytes[len] = (bit_length(sub(binom[len][marked(len)], one)) + 7) / 8;
  }
};

inline const Tables& tables() {
  static const Tables t;  // about 1 MiB, built once (thread-safe static init)
  return t;
}

// [chunk / 8 bytes of signs | the lo byte | rank bytes] per chunk; a trimmed last chunk has a
// whole chunk's block (its missing elements neither signed nor marked, unless fewer than k are
// left), so a payload padded with zero bytes to more chunks decodes as the chunks it holds
inline int64_t block_bytes(int64_t chunk) { return chunk / 8 + 1 + tables().rank_bytes[chunk]; }

inline int64_t payload_bytes(int64_t n, int64_t chunk) {
  return (n + chunk - 1) / chunk * block_bytes(chunk);
}

inline void check_chunk(int64_t chunk_size, const char* op) {
  TORCH_CHECK(chunk_size >= 8 && chunk_size <= kMaxChunk && chunk_size % 8 == 0, op,
              ": chunk_size must be a multiple of 8 in [8, ", kMaxChunk, "], got ", chunk_size);
}

// The ops' argument checks, the same on CPU and CUDA.
inline void check_pack(const at::Tensor& x, const at::Tensor& error, int64_t chunk_size) {
  check_chunk(chunk_size, "topmark_pack");
  TORCH_CHECK(x.dim() == 1, "topmark_pack: x must be 1-D, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              "topmark_pack: x must be float32, float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() &&
                  error.numel() == x.numel() && error.device() == x.device(),
              "topmark_pack: error must be a contiguous float32 tensor of ", x.numel(),
              " elements on x's device, got ", error.scalar_type(), " ", error.sizes());
}

inline void check_unpack(const at::Tensor& payload, const at::Tensor& scales, int64_t numel,
                         int64_t chunk_size, const at::Tensor& out) {
  check_chunk(chunk_size, "topmark_unpack_mean_into");
  const int64_t nchunks = (numel + chunk_size - 1) / chunk_size;
  TORCH_CHECK(payload.dim() == 2 && payload.scalar_type() == at::kByte &&
                  payload.size(1) >= payload_bytes(numel, chunk_size),
              "topmark_unpack_mean_into: payload must be uint8 [rows, >= ",
              payload_bytes(numel, chunk_size), "], got ", payload.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == payload.size(0) && scales.size(1) >= nchunks,
              "topmark_unpack_mean_into: scales must be float32 [", payload.size(0), ", >= ",
              nchunks, "], got ", scales.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= numel,
              "topmark_unpack_mean_into: out must be contiguous float32 of >= ", numel,
              " elements");
  TORCH_CHECK(payload.device() == out.device() && scales.device() == out.device(),
              "topmark_unpack_mean_into: payload, scales and out on one device");
}

// A position's selection key: larger |y| first, then the lower position (every key distinct, so
// any selection of the k largest keys picks the same set: the CPU's nth_element, CUDA's
// quickselect).
CIUICFLOW_HD inline uint64_t key_of(float y, int32_t i) {
  const float a = fabsf(y);
  uint32_t bits;
  memcpy(&bits, &a, sizeof bits);
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

CIUICFLOW_HD inline int32_t position_of(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}

inline const U256* binomials() { return &tables().binom[0][0]; }

// The rank of the ascending positions p[0] < ... < p[k-1]: sum of C(p[i], i + 1).
CIUICFLOW_HD inline U256 rank_of(const int32_t* p, int64_t k, const U256* binom) {
  U256 r;
  for (int64_t i = 0; i < k; ++i) r = add(r, binom[p[i] * kStride + i + 1]);
  return r;
}

// Marks the k positions of a rank (one scan down the chunk); false when the rank is not one that
// rank_of writes for len (a corrupt or hostile payload).
CIUICFLOW_HD inline bool marks_of(U256 r, int64_t len, int64_t k, uint8_t* mark, const U256* binom) {
  for (int64_t i = 0; i < len; ++i) mark[i] = 0;
  if (!less(r, binom[len * kStride + k])) return false;
  int64_t p = len - 1;
  for (int64_t i = k; i >= 1; --i) {
    while (p >= 0 && less(r, binom[p * kStride + i])) --p;  // the largest p with C(p, i) <= r
    if (p < 0) return false;
    mark[p] = 1;
    r = sub(r, binom[p * kStride + i]);
    --p;
  }
  return true;
}

CIUICFLOW_HD inline void write_rank(const U256& r, uint8_t* out, int64_t nbytes) {
  for (int64_t b = 0; b < nbytes; ++b) out[b] = static_cast<uint8_t>(r.w[b / 8] >> (8 * (b % 8)));
}

CIUICFLOW_HD inline U256 read_rank(const uint8_t* in, int64_t nbytes) {
  U256 r;
  for (int64_t b = 0; b < nbytes; ++b) r.w[b / 8] |= static_cast<uint64_t>(in[b]) << (8 * (b % 8));
  return r;
}

// What a chunk sends once its k marked positions are known (``marked``: ascending; where fewer
// than k elements are real, the missing ones after them): the sums in position order (float: at
// most 512 elements), hi (the scale; NaN where the chunk is not ``finite``) and the lo byte, the
// signs, the rank, and the memory ``err`` (y on entry) less what was sent. CPU and CUDA (one thread
// per chunk) both call it: the same bits for the same y and marks. ``mark``: kMaxChunk scratch.
CIUICFLOW_HD inline void send_marked(float* err, const int32_t* marked_at, uint8_t* mark,
                                     int64_t len, int64_t chunk, bool finite, uint8_t* block,
                                     float* scale, const U256* binom, int64_t rank_bytes) {
  const int64_t k = marked(chunk);
  for (int64_t i = 0; i < chunk; ++i) mark[i] = 0;
  for (int64_t i = 0; i < k; ++i) mark[marked_at[i]] = 1;
  const int64_t n_marked = k < len ? k : len;  // real ones
  float sum_all = 0.0f, sum_marked = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float a = fabsf(err[i]);
    sum_all += a;
    sum_marked += mark[i] ? a : 0.0f;
  }
  const float hi = n_marked > 0 ? sum_marked / static_cast<float>(n_marked) : 0.0f;
  const float lo = len > k ? (sum_all - sum_marked) / static_cast<float>(len - k) : 0.0f;
  float ratio = hi > 0.0f ? rintf(lo / hi * 255.0f) : 0.0f;
  ratio = ratio > 255.0f ? 255.0f : (ratio < 0.0f ? 0.0f : ratio);  // lo <= hi: marked are largest
  const float lo_sent = hi * ratio / 255.0f;
  *scale = finite ? hi : NAN;  // a chunk holding inf/NaN says so
  const int64_t sign_bytes = chunk / 8;
  for (int64_t b = 0; b < sign_bytes; ++b) {
    uint32_t byte = 0;
    for (int64_t j = 0; j < 8 && b * 8 + j < len; ++j) {
      const int64_t i = b * 8 + j;
      const float y = err[i];
      const float m = mark[i] ? hi : lo_sent;
      err[i] = y < 0.0f ? y + m : y - m;
      byte |= static_cast<uint32_t>(y < 0.0f) << j;
    }
    block[b] = static_cast<uint8_t>(byte);
  }
  block[sign_bytes] = static_cast<uint8_t>(ratio);
  write_rank(rank_of(marked_at, k, binom), block + sign_bytes + 1, rank_bytes);
}

// A chunk of the mean of ``rows`` payload rows (one: its values), summed in row order: out[i] for
// the len real elements; false on a rank that names no positions. ``mark``: kMaxChunk scratch.
CIUICFLOW_HD inline bool unpack_chunk_mean(const uint8_t* payload, int64_t payload_row,
                                           const float* scales, int64_t scales_row, int64_t rows,
                                           int64_t c, int64_t len, int64_t chunk, float* out,
                                           uint8_t* mark, const U256* binom, int64_t rank_bytes) {
  const int64_t k = marked(chunk), sign_bytes = chunk / 8;
  const int64_t stride = sign_bytes + 1 + rank_bytes;
  bool ok = true;
  for (int64_t i = 0; i < len; ++i) out[i] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* block = payload + r * payload_row + c * stride;
    const float hi = scales[r * scales_row + c];
    const float lo = hi * static_cast<float>(block[sign_bytes]) / 255.0f;
    if (!marks_of(read_rank(block + sign_bytes + 1, rank_bytes), chunk, k, mark, binom)) {
      ok = false;
      continue;
    }
    for (int64_t i = 0; i < len; ++i) {
      const float m = mark[i] ? hi : lo;
      out[i] += (block[i / 8] >> (i % 8)) & 1 ? -m : m;
    }
  }
  if (rows > 1)
    for (int64_t i = 0; i < len; ++i) out[i] /= static_cast<float>(rows);
  return ok;
}

}  // namespace topmark
}  // namespace ciuicflow
