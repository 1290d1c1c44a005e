// Paged attention over the block pool: what the attention sources share (attention*.cpp).
//
// Pool layout (one layer): K (num_blocks, KVH, D, block_size) -- each block's keys of one kv head stored
// transposed, so W consecutive keys of one dimension are one vector load -- and V (num_blocks, KVH,
// block_size, D), row-major; both contiguous, float32, float16 or bfloat16. Position p of a sequence is
// key column p % BS of block block_table[p / BS]. Queries q (T, H, D) and the output (T, H, D) are float32
// or bfloat16 (the model's dtype), last dim contiguous.
//
// A step's work is a list of items (built once per step by `plan`, attention.cpp), each one row of
// `kItemCols` int64: [kind, seq, kv_head, a, b, slot].
// - kind kDecode: the one new token of `seq`, all G = H / KVH query heads of `kv_head`, over context
//   positions [a, b) (a a multiple of kDecodeTile). slot < 0: the item covers the whole context (from
//   its window's start rounded down to kDecodeTile) and writes the output; slot >= 0: a split-K piece,
//   which writes (max, sum, unnormalised output) of its G heads to scratch[slot] for the merge pass.
// - kind kPrefill: new tokens [a, b) of `seq` (indices within its chunk), causal with the offset of the
//   cached context, all G heads of `kv_head` at once.
//
// Sliding window (`window` > 0, the same for the step's plan and the layer's call): a query at position
// p sees keys p - window < j <= p. The plan starts each decode item at its window (rounded down to
// kDecodeTile), the kernels mask the keys before it and prefill items skip the KV tiles before their
// first token's window. Soft-capping (`softcap` > 0): scores become softcap * tanh(score / softcap)
// before the mask (vec_attn.h `vsoftcap`). window 0 and softcap 0: plain causal attention, the same code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace troupe_attn {

enum class DType : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

constexpr int kItemCols = 6;
constexpr int64_t kDecode = 0;
constexpr int64_t kPrefill = 1;
constexpr int kDecodeTile = 32;  // split-K pieces start at a multiple of this (a multiple of the vector width)
constexpr int kMaxHeadDim = 256;

struct AttnArgs {
  const void* q;
  int64_t q_tok_stride, q_head_stride;
  const void* k_pool;
  const void* v_pool;
  const int64_t* block_tables;
  int64_t bt_stride;
  const int64_t* seq_lens;
  const int64_t* query_start_loc;
  void* out;
  int64_t out_tok_stride, out_head_stride;
  float* scratch;  // (slots, G, DP + 2): per split-K piece and head, max, sum, then the output row
  int H, KVH, G, D, DP, BS;
  float scale;
  int64_t window;  // 0: none
  float softcap;  // 0: none
  DType qtype, kvtype;
};

// The first position a query at `pos` sees (0 without a window).
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Per-thread float scratch, kept across calls (grown when a call needs more).
struct Buffers {
  std::vector<float> data;
  float* get(size_t n) {
    if (data.size() < n) data.resize(n);
    return data.data();
  }
};
Buffers& thread_buffers();

int padded_dim(int D);  // D rounded up to the vector width
int prefill_tile_tokens(int G);  // query tokens per prefill item

// Keys [p, p + n) of one kv head of a sequence as a (D, n) slice, n <= W (the vector width): returns the
// slice and sets `stride` to its distance between dimensions. When the block size is a multiple of W and p
// of W (the fast path), that is the pool itself; otherwise the keys are copied into `tmp` (D x W), keys
// from n on being zero.
template <typename KT>
inline const KT* key_chunk(const KT* kpool, const int64_t* table, int64_t p, int n, int BS, int64_t block_stride,
                           int64_t head_off, int D, int W, KT* tmp, int64_t& stride) {
  if (BS % W == 0 && p % W == 0) {
    stride = BS;
    return kpool + table[p / BS] * block_stride + head_off + p % BS;
  }
  for (int j = 0; j < W; ++j) {
    const KT* src = j < n ? kpool + table[(p + j) / BS] * block_stride + head_off + (p + j) % BS : nullptr;
    for (int d = 0; d < D; ++d) tmp[d * W + j] = src != nullptr ? src[int64_t(d) * BS] : KT(0);
  }
  stride = W;
  return tmp;
}

void decode_item(const AttnArgs& a, const int64_t* item, Buffers& buf);
// Requests into L2 the K and V lines of a decode item's first keys (no-op for prefill items): a thread
// calls it for the item it will take next, so that item does not start on cold misses.
void prefetch_item(const AttnArgs& a, const int64_t* item);
void prefill_item(const AttnArgs& a, const int64_t* item, Buffers& buf);
// Combines the split-K pieces [slot0, slot0 + count) of (seq, kv_head) into the output.
void merge_pieces(const AttnArgs& a, int64_t seq, int64_t kv_head, int64_t slot0, int64_t count);

}  // namespace troupe_attn
