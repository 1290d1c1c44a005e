// Paged attention ops (TORCH_LIBRARY troupe_attention): the per-step plan and the per-layer kernel.
//
// `plan` (once per step) turns the step's sequences into work items (attention.h): one decode item per
// (decoding sequence, kv head), one prefill item per (chunk, kv head, tile of query tokens); a decode
// item whose share of the step's work is large (few sequences, long context: batch 1) is split over its
// context into pieces of at least `min_split` keys, which a merge pass combines. Items are sorted by
// cost, largest first, and `paged_attention` hands them out to its threads one at a time from a shared
// counter, so uneven contexts still balance. A step with less work than `min_parallel` runs on one
// thread (a parallel region costs more than the work).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#include "attention.h"

namespace troupe_attn {
namespace {

struct Item {
  int64_t cols[kItemCols];
  int64_t cost;
};

std::tuple<at::Tensor, at::Tensor, int64_t> plan(const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                                 int64_t num_heads, int64_t num_kv_heads, int64_t num_threads,
                                                 int64_t min_split, int64_t min_parallel, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(query_start_loc.dtype() == at::kLong && seq_lens.dtype() == at::kLong, "int64 metadata expected");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous(), "contiguous metadata expected");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t S = seq_lens.numel(), G = num_heads / num_kv_heads;
  TORCH_CHECK(query_start_loc.numel() == S + 1, "query_start_loc must have one more entry than seq_lens");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t tile = prefill_tile_tokens(int(G));
  std::vector<Item> items;
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s], ctx = lens[s];
    TORCH_CHECK(n >= 1 && ctx >= n, "sequence ", s, ": ", n, " new tokens, context ", ctx);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if (n == 1) {
        const int64_t a = window_start(ctx - 1, window) / kDecodeTile * kDecodeTile;
        items.push_back({{kDecode, s, h, a, ctx, -1}, (ctx - a) * G});
        total += (ctx - a) * G;
        continue;
      }
      for (int64_t i0 = 0; i0 < n; i0 += tile) {
        const int64_t i1 = std::min(n, i0 + tile);
        const int64_t cost = (i1 - i0) * G * (ctx - n + i1 - window_start(ctx - n + i0, window));
        items.push_back({{kPrefill, s, h, i0, i1, -1}, cost});
        total += cost;
      }
    }
  }
  int64_t threads = total < min_parallel ? 1 : std::max<int64_t>(1, num_threads);
  std::vector<int64_t> merges;
  if (threads > 1) {  // split-K: decode items above a fair share of the work, in pieces of >= min_split keys
    const int64_t share = std::max<int64_t>(1, total / (2 * threads));
    std::vector<Item> split;
    int64_t slot = 0;
    for (const Item& it : items) {
      const int64_t a = it.cols[3], ctx = it.cols[4];
      int64_t pieces = std::min((it.cost + share - 1) / share, (ctx - a) / std::max<int64_t>(1, min_split));
      if (it.cols[0] != kDecode || pieces <= 1) {
        split.push_back(it);
        continue;
      }
      int64_t len = (ctx - a + pieces - 1) / pieces;
      len = (len + kDecodeTile - 1) / kDecodeTile * kDecodeTile;
      pieces = (ctx - a + len - 1) / len;
      merges.insert(merges.end(), {it.cols[1], it.cols[2], slot, pieces});
      for (int64_t c0 = a; c0 < ctx; c0 += len) {
        const int64_t c1 = std::min(ctx, c0 + len);
        split.push_back({{kDecode, it.cols[1], it.cols[2], c0, c1, slot++}, (c1 - c0) * G});
      }
    }
    items.swap(split);
  }
  threads = std::min<int64_t>(threads, int64_t(items.size()));
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  at::Tensor out = at::empty({int64_t(items.size()), kItemCols}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (const Item& it : items) p = std::copy(it.cols, it.cols + kItemCols, p);
  at::Tensor m = at::empty({int64_t(merges.size() / 4), 4}, at::kLong);
  std::copy(merges.begin(), merges.end(), m.data_ptr<int64_t>());
  return {out, m, std::max<int64_t>(threads, 1)};
}

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat;
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& items, const at::Tensor& merges, const at::Tensor& scratch,
                     const at::Tensor& out, double scale, int64_t threads, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (T, H, D) with a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1,
              "out must be like q");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "the K and V pools must be contiguous and of one dtype");
  const int64_t H = q.size(1), D = q.size(2), KVH = v_pool.size(1), BS = v_pool.size(2);
  TORCH_CHECK(v_pool.size(3) == D && k_pool.size(0) == v_pool.size(0) && k_pool.size(1) == KVH &&
                  k_pool.size(2) == D && k_pool.size(3) == BS,
              "pools must be K (num_blocks, KVH, D, block_size) and V (num_blocks, KVH, block_size, D) with q's D (",
              D, ")");
  TORCH_CHECK(D % 8 == 0 && D <= kMaxHeadDim, "head dim must be a multiple of 8 up to ", kMaxHeadDim, ", got ", D);
  TORCH_CHECK(H % KVH == 0, "num_heads (", H, ") must be a multiple of num_kv_heads (", KVH, ")");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.stride(1) == 1,
              "block_tables must be (S, max_blocks) int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous(),
              "seq_lens and query_start_loc must be contiguous int64");
  TORCH_CHECK(items.dim() == 2 && items.size(1) == kItemCols && items.scalar_type() == at::kLong &&
                  items.is_contiguous(), "items must come from plan()");
  AttnArgs a;
  a.q = q.data_ptr();
  a.q_tok_stride = q.stride(0);
  a.q_head_stride = q.stride(1);
  a.k_pool = k_pool.data_ptr();
  a.v_pool = v_pool.data_ptr();
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.bt_stride = block_tables.stride(0);
  a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.query_start_loc = query_start_loc.data_ptr<int64_t>();
  a.out = out.data_ptr();
  a.out_tok_stride = out.stride(0);
  a.out_head_stride = out.stride(1);
  a.H = int(H);
  a.KVH = int(KVH);
  a.G = int(H / KVH);
  a.D = int(D);
  a.DP = padded_dim(int(D));
  a.BS = int(BS);
  a.scale = float(scale);
  a.window = window;
  a.softcap = float(softcap);
  a.qtype = dtype_of(q);
  a.kvtype = dtype_of(k_pool);
  a.scratch = nullptr;
  const int64_t num_merges = merges.size(0);
  if (num_merges > 0) {
    const int64_t* mp = merges.data_ptr<int64_t>();
    const int64_t slots = mp[4 * (num_merges - 1) + 2] + mp[4 * (num_merges - 1) + 3];
    TORCH_CHECK(scratch.scalar_type() == at::kFloat && scratch.is_contiguous() &&
                    scratch.numel() >= slots * a.G * (a.DP + 2),
                "scratch too small for the split-K pieces");
    a.scratch = scratch.data_ptr<float>();
  }

  const int64_t n = items.size(0);
  const int64_t* ip = items.data_ptr<int64_t>();
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    Buffers& buf = thread_buffers();
    // Each thread claims its next item before it runs the current one and requests that item's first
    // keys into L2 meanwhile, so an item does not start on cold misses: faster where the pool streams
    // from memory, neutral where the L3 holds it (docs/kernels.md).
    for (int64_t i = next.fetch_add(1), j = i < n ? next.fetch_add(1) : n; i < n;
         i = j, j = i < n ? next.fetch_add(1) : n) {
      const int64_t* it = ip + i * kItemCols;
      if (j < n) prefetch_item(a, ip + j * kItemCols);
      if (it[0] == kDecode) {
        decode_item(a, it, buf);
      } else {
        prefill_item(a, it, buf);
      }
    }
  };
  if (threads <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, threads, 1, work);
  }
  if (num_merges > 0) {
    const int64_t* mp = merges.data_ptr<int64_t>();
    at::parallel_for(0, num_merges, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) merge_pieces(a, mp[4 * i], mp[4 * i + 1], mp[4 * i + 2], mp[4 * i + 3]);
    });
  }
}

}  // namespace
}  // namespace troupe_attn

TORCH_LIBRARY(troupe_attention, m) {
  m.def("plan(Tensor query_start_loc, Tensor seq_lens, int num_heads, int num_kv_heads, int num_threads, "
        "int min_split, int min_parallel, int window=0) -> (Tensor, Tensor, int)",
        &troupe_attn::plan);
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor items, Tensor merges, Tensor scratch, Tensor(a!) out, float scale, "
        "int threads, int window=0, float softcap=0.) -> ()",
        &troupe_attn::paged_attention);
}
