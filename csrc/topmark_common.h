// The topmark codec's layout (ciuicflow/compression/topmark.py has the format and why): how many
// elements a chunk marks, its block's sizes, and the combinatorial number system that writes the
// marked positions as one integer below C(len, k) (log2 C(len, k) bits: 248 for 55 of 512, where a
// bitmap would take 512).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace ciuicflow {
namespace topmark {

constexpr int64_t kMaxChunk = 512;
// marked elements of a chunk of len: 55/512 of it, rounded (55 of 512: the most whose rank fits
// 31 bytes), at least one (the scale is the marked elements' mean |y|: a chunk without one could
// not send its others' magnitude)
constexpr int64_t marked(int64_t len) {
  return len == 0 ? 0 : ((len * 55 + 256) / 512 > 0 ? (len * 55 + 256) / 512 : 1);
}
constexpr int64_t kMaxMarked = marked(kMaxChunk);

// An unsigned integer of 256 bits (C(512, 55) < 2^248), little-endian limbs.
struct U256 {
  uint64_t w[4] = {0, 0, 0, 0};
};

inline U256 add(const U256& a, const U256& b) {
  U256 r;
  unsigned __int128 carry = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned __int128 s = static_cast<unsigned __int128>(a.w[i]) + b.w[i] + carry;
    r.w[i] = static_cast<uint64_t>(s);
    carry = s >> 64;
  }
  return r;
}

inline U256 sub(const U256& a, const U256& b) {  // a >= b
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

inline bool less(const U256& a, const U256& b) {
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
// chunk length's rank bytes: ceil(bits of C(len, marked(len)) - 1, the largest rank, / 8).
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

// The rank of the ascending positions p[0] < ... < p[k-1]: sum of C(p[i], i + 1).
inline U256 rank_of(const int32_t* p, int64_t k) {
  const Tables& t = tables();
  U256 r;
  for (int64_t i = 0; i < k; ++i) r = add(r, t.binom[p[i]][i + 1]);
  return r;
}

// Marks the k positions of a rank (one scan down the chunk); false when the rank is not one that
// rank_of writes for len (a corrupt or hostile payload).
inline bool marks_of(U256 r, int64_t len, int64_t k, uint8_t* mark) {
  const Tables& t = tables();
  for (int64_t i = 0; i < len; ++i) mark[i] = 0;
  if (!less(r, t.binom[len][k])) return false;
  int64_t p = len - 1;
  for (int64_t i = k; i >= 1; --i) {
    while (p >= 0 && less(r, t.binom[p][i])) --p;  // the largest p with C(p, i) <= r
    if (p < 0) return false;
    mark[p] = 1;
    r = sub(r, t.binom[p][i]);
    --p;
  }
  return true;
}

inline void write_rank(const U256& r, uint8_t* out, int64_t nbytes) {
  for (int64_t b = 0; b < nbytes; ++b) out[b] = static_cast<uint8_t>(r.w[b / 8] >> (8 * (b % 8)));
}

inline U256 read_rank(const uint8_t* in, int64_t nbytes) {
  U256 r;
  for (int64_t b = 0; b < nbytes; ++b) r.w[b / 8] |= static_cast<uint64_t>(in[b]) << (8 * (b % 8));
  return r;
}

}  // namespace topmark
}  // namespace ciuicflow
