// Prefill attention: a tile of new tokens of one sequence, all G query heads of one kv head, causal with
// the offset of the context already cached (attention.h has the item format and the pool layout).
//
// The tile's R = tokens x G query rows (row r: token r / G, head r % G) are scaled into a float32 buffer.
// The context [0, last token's position] is walked in KV tiles of kTK keys; each KV tile is packed once
// (K as (D, kTK), already transposed in the pool, V as (kTK, D) rows, both float32) and serves all R rows:
// S = Q K^T by broadcast-FMA microkernels (kRB rows x kTK keys in registers, no horizontal sums), then
// on those same registers the causal mask and each row's online-softmax update (only the probabilities
// go to memory), then O = O * alpha + P V by microkernels holding a block of rows x a chunk of D in
// registers. KV tiles entirely after a row's position are never read
// for it. With a sliding window the walk starts at the tile holding the first token's window start, and
// each row also masks the keys before its own window; a row with no visible key in a tile leaves its
// state as it is (every row sees itself, so none ends with an empty sum). With soft-capping the score
// registers are capped before the mask.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention.h"
#include "vec_attn.h"

namespace troupe_attn {

using namespace troupe_vec;

namespace {

constexpr int kTKV = 4;         // vectors of keys per KV tile
constexpr int kTK = kTKV * W;   // keys per KV tile
#if defined(__AVX512F__)
constexpr int kRB = 6;  // query rows per S microkernel (kRB x kTKV accumulators)
constexpr int kRO = 4;  // rows per O microkernel
#else
constexpr int kRB = 3;
constexpr int kRO = 2;
#endif
constexpr int kNV = 4;        // vectors of D per O microkernel
constexpr int kRowsTarget = 64;  // query rows per item (tokens x G)

// The causal view of one KV tile: row r (token r / G of the item) sees the tile's first
// min(nk, first + r / G) keys (first: what row 0 sees, <= 0 when none), from key `lo(r)` on with a window.
struct TileView {
  int nk, G;
  int64_t first;
  int64_t window;  // 0: none
  float cap;  // soft-capping, 0: none
  int visible(int r) const { return int(std::max<int64_t>(0, std::min<int64_t>(nk, first + r / G))); }
  int lo(int r) const {
    return window > 0 ? int(std::max<int64_t>(0, std::min<int64_t>(kTK, first + r / G - window))) : 0;
  }
};

// For RB rows: S[r][0..kTK) = Q[r] . Kt[:, 0..kTK) (Kt is (D, kTK)), then each row's online-softmax update
// on those registers (keys it cannot see masked): s[r] becomes the probabilities exp(S - m_new), m and l
// are updated and alpha[r] is the factor for the row's old output (1 with no visible key: it adds zero).
template <int RB>
inline __attribute__((always_inline)) void s_block(const float* q, int DP, const float* kt, int D, float* s,
                                                    float* m, float* l, float* alpha, const TileView& view, int r0) {
  vf acc[RB][kTKV];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < kTKV; ++c) acc[r][c] = vzero();
  }
  for (int d = 0; d < D; ++d) {
    vf qb[RB];
    for (int r = 0; r < RB; ++r) qb[r] = vset1(q[r * DP + d]);
    for (int c = 0; c < kTKV; ++c) {
      const vf kv = vload(kt + d * kTK + c * W);
      for (int r = 0; r < RB; ++r) acc[r][c] = vfma(qb[r], kv, acc[r][c]);
    }
  }
  if (view.cap > 0.0f) {
    const float inv_cap = 1.0f / view.cap;
    for (int r = 0; r < RB; ++r) {
      for (int c = 0; c < kTKV; ++c) acc[r][c] = vsoftcap(acc[r][c], view.cap, inv_cap);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const int vis = view.visible(r0 + r), lo = view.lo(r0 + r);
    float* sr = s + r * kTK;
    if (vis <= lo) {  // no visible key here (vis <= 0 without a window)
      for (int c = 0; c < kTKV; ++c) vstore(sr + c * W, vzero());
      alpha[r] = 1.0f;
      continue;
    }
    vf mx = vset1(kNegInf);
    for (int c = 0; c < kTKV; ++c) {
      if (lo > 0) {
        acc[r][c] = vkeep_range(acc[r][c], lo - c * W, vis - c * W, kNegInf);
      } else if (vis < kTK) {
        acc[r][c] = vkeep_first(acc[r][c], vis - c * W, kNegInf);
      }
      mx = vmax(mx, acc[r][c]);
    }
    const float m_new = std::max(m[r], vhmax(mx));
    alpha[r] = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
    const vf mv = vset1(m_new);
    vf sum = vzero();
    for (int c = 0; c < kTKV; ++c) {
      const vf p = vexp(vsub(acc[r][c], mv));
      vstore(sr + c * W, p);
      sum = vadd(sum, p);
    }
    l[r] = l[r] * alpha[r] + vsum(sum);
    m[r] = m_new;
  }
}

inline void s_rows(const float* q, int R, int DP, const float* kt, int D, float* s, float* m, float* l, float* alpha,
                   const TileView& view) {
  int r = 0;
  for (; r + kRB <= R; r += kRB) s_block<kRB>(q + r * DP, DP, kt, D, s + r * kTK, m + r, l + r, alpha + r, view, r);
  float* sr = s + r * kTK;
  switch (R - r) {
#if defined(__AVX512F__)
    case 5: s_block<5>(q + r * DP, DP, kt, D, sr, m + r, l + r, alpha + r, view, r); break;
    case 4: s_block<4>(q + r * DP, DP, kt, D, sr, m + r, l + r, alpha + r, view, r); break;
    case 3: s_block<3>(q + r * DP, DP, kt, D, sr, m + r, l + r, alpha + r, view, r); break;
#endif
    case 2: s_block<2>(q + r * DP, DP, kt, D, sr, m + r, l + r, alpha + r, view, r); break;
    case 1: s_block<1>(q + r * DP, DP, kt, D, sr, m + r, l + r, alpha + r, view, r); break;
    default: break;
  }
}

// O[r][c0 : c0 + NV * W] = O * alpha[r] + sum_j P[r][j] V[j][c0 : ...] for RB rows, j < nk.
template <int RB, int NV>
inline void o_block(float* o, int DP, const float* p, const float* alpha, const float* v, int nk, int c0) {
  vf acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const vf al = vset1(alpha[r]);
    for (int i = 0; i < NV; ++i) acc[r][i] = vmul(vload(o + r * DP + c0 + i * W), al);
  }
  for (int j = 0; j < nk; ++j) {
    vf vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = vload(v + j * DP + c0 + i * W);
    for (int r = 0; r < RB; ++r) {
      const vf pb = vset1(p[r * kTK + j]);
      for (int i = 0; i < NV; ++i) acc[r][i] = vfma(pb, vv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int i = 0; i < NV; ++i) vstore(o + r * DP + c0 + i * W, acc[r][i]);
  }
}

template <int RB>
inline void o_rows_chunks(float* o, int DP, const float* p, const float* alpha, const float* v, int nk) {
  int c = 0, nv = DP / W;
  for (; nv >= kNV; nv -= kNV, c += kNV * W) o_block<RB, kNV>(o, DP, p, alpha, v, nk, c);
  switch (nv) {
    case 3: o_block<RB, 3>(o, DP, p, alpha, v, nk, c); break;
    case 2: o_block<RB, 2>(o, DP, p, alpha, v, nk, c); break;
    case 1: o_block<RB, 1>(o, DP, p, alpha, v, nk, c); break;
    default: break;
  }
}

inline void o_rows(float* o, int R, int DP, const float* p, const float* alpha, const float* v, int nk) {
  int r = 0;
  for (; r + kRO <= R; r += kRO) o_rows_chunks<kRO>(o + r * DP, DP, p + r * kTK, alpha + r, v, nk);
  for (; r < R; ++r) o_rows_chunks<1>(o + r * DP, DP, p + r * kTK, alpha + r, v, nk);
}

template <typename QT, typename KT>
void prefill(const AttnArgs& a, int64_t seq, int64_t h, int64_t i0, int64_t i1, Buffers& buf) {
  const int G = a.G, D = a.D, DP = a.DP, BS = a.BS;
  const int R = int(i1 - i0) * G;
  float* const qs = buf.get(size_t(2 * R * DP + R * kTK + 2 * kTK * DP + 3 * R + D * W));
  float* const o = qs + R * DP;
  float* const s = o + R * DP;
  float* const kt = s + R * kTK;  // (D, kTK) the K tile, float32
  float* const vt = kt + kTK * DP;  // (kTK, DP) V rows, float32
  float* const ms = vt + kTK * DP;
  float* const ls = ms + R;
  float* const alphas = ls + R;
  KT* const tmp = reinterpret_cast<KT*>(alphas + R);  // D x W keys for key_chunk's copying path
  std::memset(o, 0, sizeof(float) * R * DP);
  for (int j = 0; j < kTK; ++j) {
    for (int d = D; d < DP; ++d) vt[j * DP + d] = 0.0f;
  }

  const int64_t t0 = a.query_start_loc[seq];
  const int64_t n = a.query_start_loc[seq + 1] - t0;
  const int64_t base = a.seq_lens[seq] - n;  // position of the chunk's first token
  for (int r = 0; r < R; ++r) {
    const int64_t t = t0 + i0 + r / G;
    const QT* src = static_cast<const QT*>(a.q) + t * a.q_tok_stride + (h * G + r % G) * a.q_head_stride;
    float* dst = qs + r * DP;
    for (int d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * a.scale;
    for (int d = D; d < DP; ++d) dst[d] = 0.0f;
    ms[r] = kNegInf;
    ls[r] = 0.0f;
  }

  const int64_t* table = a.block_tables + seq * a.bt_stride;
  const int64_t block_stride = int64_t(a.KVH) * BS * D, head_off = h * int64_t(BS) * D;
  const KT* kpool = static_cast<const KT*>(a.k_pool);
  const KT* vpool = static_cast<const KT*>(a.v_pool);
  const int64_t kv_end = base + i1;  // positions [kv_start, kv_end) are visible to some row
  const int64_t kv_start = window_start(base + i0, a.window) / kTK * kTK;
  for (int64_t p0 = kv_start; p0 < kv_end; p0 += kTK) {
    const int nk = int(std::min<int64_t>(kTK, kv_end - p0));
    for (int c = 0; c < kTK / W; ++c) {  // kt[d][c W ..] = the chunk's keys, float32
      const int64_t p = p0 + c * W;
      if (p >= kv_end) {
        for (int d = 0; d < D; ++d) vstore(kt + d * kTK + c * W, vzero());
        continue;
      }
      int64_t ks = 0;
      const KT* src = key_chunk(kpool, table, p, int(std::min<int64_t>(W, kv_end - p)), BS, block_stride, head_off,
                                D, W, tmp, ks);
      for (int d = 0; d < D; ++d) vstore(kt + d * kTK + c * W, vload(src + d * ks));
    }
    for (int j = 0; j < nk; ++j) {
      const int64_t p = p0 + j;
      convert_row(vpool + table[p / BS] * block_stride + head_off + (p % BS) * D, vt + j * DP, D);
    }
    s_rows(qs, R, DP, kt, D, s, ms, ls, alphas, TileView{nk, G, base + i0 - p0 + 1, a.window, a.softcap});
    o_rows(o, R, DP, s, alphas, vt, nk);
  }

  for (int r = 0; r < R; ++r) {
    const int64_t t = t0 + i0 + r / G;
    QT* dst = static_cast<QT*>(a.out) + t * a.out_tok_stride + (h * G + r % G) * a.out_head_stride;
    const float inv = 1.0f / ls[r];
    for (int d = 0; d < D; ++d) dst[d] = from_f32<QT>(o[r * DP + d] * inv);
  }
}

template <typename QT>
void prefill_q(const AttnArgs& a, const int64_t* it, Buffers& buf) {
  switch (a.kvtype) {
    case DType::kFloat: prefill<QT, float>(a, it[1], it[2], it[3], it[4], buf); break;
    case DType::kHalf: prefill<QT, Half>(a, it[1], it[2], it[3], it[4], buf); break;
    case DType::kBFloat16: prefill<QT, BFloat16>(a, it[1], it[2], it[3], it[4], buf); break;
  }
}

}  // namespace

int prefill_tile_tokens(int G) { return std::max(1, kRowsTarget / G); }

void prefill_item(const AttnArgs& a, const int64_t* item, Buffers& buf) {
  if (a.qtype == DType::kFloat) {
    prefill_q<float>(a, item, buf);
  } else {
    prefill_q<BFloat16>(a, item, buf);
  }
}

}  // namespace troupe_attn
