// Decode attention: one new token, all G query heads of one kv head, over a range of context positions
// (attention.h has the item format and the pool layout).
//
// The range is walked in tiles of 4 key vectors (64 keys with AVX-512, 32 with AVX2); each tile's K and V
// are read once from the pool and serve all G heads, converted to float32 in registers as they are loaded:
// - scores: K is stored transposed per block, so for each dimension d one vector load brings W keys and
//   G broadcast-FMAs (q[g][d] x those keys) accumulate G x 4 score vectors in registers: no horizontal
//   sums. The online-softmax update of each head (running max m, running sum l, the output rescaled by
//   exp(m_old - m_new)) runs on those registers; only the probabilities go to memory, for P x V;
// - P x V: for each key, its V row (a few vectors) is loaded once and FMA'd into a block of heads x a chunk
//   of D of float32 output kept in registers.
// When the block size is a multiple of W, a chunk of W keys lies in one block, whose K (D, BS) and V
// (BS, D) are read in place; the next tile's lines are prefetched from inside these loops (one per key
// vector and dimension, the lines of one V row per key), so the loads of the next tile overlap the
// arithmetic of this one at an even rate instead of in a burst the fill buffers cannot hold. Other
// block sizes copy each chunk's keys and V rows into buffers first.
// A split-K piece leaves (m, l, unnormalised output) in scratch for `merge_pieces`.
// With a sliding window the item starts at the window's start rounded down to kDecodeTile (the plan), so
// only its first tile has keys before the window, masked like the keys past the end; with soft-capping
// the score registers are capped before the mask.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "attention.h"
#include "vec_attn.h"

namespace troupe_attn {

using namespace troupe_vec;

int padded_dim(int D) { return (D + W - 1) / W * W; }

Buffers& thread_buffers() {
  thread_local Buffers buf;
  return buf;
}

namespace {

#define TROUPE_INLINE inline __attribute__((always_inline))

// Keys per tile: 4 vectors (64 keys with AVX-512, 32 with AVX2), a divisor of kDecodeTile's multiples.
constexpr int NC = 4;
constexpr int TK = NC * W;
static_assert(kDecodeTile % W == 0, "split pieces must start on a vector of keys");
#if defined(__AVX512F__)
constexpr int kQKHeads = 4;  // heads per score block: kQKHeads x NC accumulators
constexpr int kPVHeads = 4;  // heads x kPVVecs accumulators per P x V block
#else
constexpr int kQKHeads = 3;
constexpr int kPVHeads = 3;
#endif
constexpr int kPVVecs = 4;

// Scores of GB heads over the tile (chunk c of W keys is k[c], (D, W) at stride ks; keys [0, skip) and
// [n, TK) masked, skip < n; with cap > 0 soft-capped first) and the online-softmax update of each head in
// registers: s[g][0..TK) becomes exp(score - m_new), m and l are updated and alpha[g] = exp(m_old - m_new)
// is the factor for the head's old output.
template <int GB, typename KT>
TROUPE_INLINE void qk_softmax(const float* q, int DP, const KT* const* k, int64_t ks, int D, int n, int skip,
                              float cap, float* s, float* m, float* l, float* alpha, const KT* const* pf) {
  vf acc[GB][NC];
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) acc[g][c] = vzero();
  }
  for (int d = 0; d < D; ++d) {
    vf kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = vload(k[c] + d * ks);
    if (pf != nullptr) {
      for (int c = 0; c < NC; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf[c] + d * ks), _MM_HINT_T0);
    }
    for (int g = 0; g < GB; ++g) {
      const vf qb = vset1(q[g * DP + d]);
      for (int c = 0; c < NC; ++c) acc[g][c] = vfma(qb, kv[c], acc[g][c]);
    }
  }
  if (cap > 0.0f) {
    const float inv_cap = 1.0f / cap;
    for (int g = 0; g < GB; ++g) {
      for (int c = 0; c < NC; ++c) acc[g][c] = vsoftcap(acc[g][c], cap, inv_cap);
    }
  }
  if (skip > 0) {
    for (int g = 0; g < GB; ++g) {
      for (int c = 0; c < NC; ++c) acc[g][c] = vkeep_range(acc[g][c], skip - c * W, n - c * W, kNegInf);
    }
  } else if (n < TK) {
    for (int g = 0; g < GB; ++g) {
      for (int c = 0; c < NC; ++c) acc[g][c] = vkeep_first(acc[g][c], n - c * W, kNegInf);
    }
  }
  for (int g = 0; g < GB; ++g) {
    vf mx = acc[g][0];
    for (int c = 1; c < NC; ++c) mx = vmax(mx, acc[g][c]);
    const float m_new = std::max(m[g], vhmax(mx));
    alpha[g] = m[g] == kNegInf ? 0.0f : std::exp(m[g] - m_new);
    const vf mv = vset1(m_new);
    vf sum = vzero();
    for (int c = 0; c < NC; ++c) {
      const vf p = vexp(vsub(acc[g][c], mv));
      vstore(s + g * TK + c * W, p);
      sum = vadd(sum, p);
    }
    l[g] = l[g] * alpha[g] + vsum(sum);
    m[g] = m_new;
  }
}

template <typename KT>
TROUPE_INLINE void qk_tile(const float* q, int G, int DP, const KT* const* k, int64_t ks, int D, int n, int skip,
                           float cap, float* s, float* m, float* l, float* alpha, const KT* const* pf) {
  for (int g = 0; g < G; g += kQKHeads, pf = nullptr) {
    const float* qg = q + g * DP;
    float* sg = s + g * TK;
    switch (std::min(kQKHeads, G - g)) {
#if defined(__AVX512F__)
      case 4: qk_softmax<4>(qg, DP, k, ks, D, n, skip, cap, sg, m + g, l + g, alpha + g, pf); break;
#endif
      case 3: qk_softmax<3>(qg, DP, k, ks, D, n, skip, cap, sg, m + g, l + g, alpha + g, pf); break;
      case 2: qk_softmax<2>(qg, DP, k, ks, D, n, skip, cap, sg, m + g, l + g, alpha + g, pf); break;
      default: qk_softmax<1>(qg, DP, k, ks, D, n, skip, cap, sg, m + g, l + g, alpha + g, pf); break;
    }
  }
}

// o[g][c0 : c0 + NV * W] = o * alpha[g] + sum_j p[g][j] V[j][c0 : ...] for GB heads over the tile's n
// keys; key j's V row is v[j / W] + (j % W) * D (each chunk's W rows consecutive).
template <int GB, int NV, typename KT>
TROUPE_INLINE void pv_block(float* o, int DP, int D, const float* p, const float* alpha, const KT* const* v, int n,
                            int c0, const KT* const* pf) {
  const int row_bytes = D * int(sizeof(KT));
  vf acc[GB][NV];
  for (int g = 0; g < GB; ++g) {
    const vf al = vset1(alpha[g]);
    for (int i = 0; i < NV; ++i) acc[g][i] = vmul(vload(o + g * DP + c0 + i * W), al);
  }
  for (int c = 0; c < NC; ++c) {
    const int nj = std::min(W, n - c * W);
    const KT* base = v[c] + c0;
    const float* pc = p + c * W;
    for (int j = 0; j < nj; ++j) {
      vf pb[GB];
      for (int g = 0; g < GB; ++g) pb[g] = vset1(pc[g * TK + j]);
      const KT* row = base + j * D;
      if (pf != nullptr) {
        const char* nrow = reinterpret_cast<const char*>(pf[c] + j * D);
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(nrow + b, _MM_HINT_T0);
      }
      for (int i = 0; i < NV; ++i) {
        const vf vv = vload(row + i * W);
        for (int g = 0; g < GB; ++g) acc[g][i] = vfma(pb[g], vv, acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int i = 0; i < NV; ++i) vstore(o + g * DP + c0 + i * W, acc[g][i]);
  }
}

template <int GB, typename KT>
TROUPE_INLINE void pv_heads(float* o, int DP, int D, const float* p, const float* alpha, const KT* const* v, int n,
                            const KT* const* pf) {
  int c = 0, nv = D / W;
  for (; nv >= kPVVecs; nv -= kPVVecs, c += kPVVecs * W, pf = nullptr) {
    pv_block<GB, kPVVecs>(o, DP, D, p, alpha, v, n, c, pf);
  }
  switch (nv) {
    case 3: pv_block<GB, 3>(o, DP, D, p, alpha, v, n, c, pf); break;
    case 2: pv_block<GB, 2>(o, DP, D, p, alpha, v, n, c, pf); break;
    case 1: pv_block<GB, 1>(o, DP, D, p, alpha, v, n, c, pf); break;
    default: break;
  }
  c += nv * W;
  if (c < D) {  // D a multiple of 8 but not of W (16): the last 8 dims
    for (int g = 0; g < GB; ++g) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o + g * DP + c), _mm256_set1_ps(alpha[g]));
      for (int j = 0; j < n; ++j) {
        const __m256 pj = _mm256_set1_ps(p[g * TK + j]);
        acc = _mm256_fmadd_ps(pj, load8(v[j / W] + (j % W) * D + c), acc);
      }
      _mm256_storeu_ps(o + g * DP + c, acc);
    }
  }
}

template <typename KT>
TROUPE_INLINE void pv_tile(float* o, int G, int DP, int D, const float* p, const float* alpha, const KT* const* v,
                           int n, const KT* const* pf) {
  for (int g = 0; g < G; g += kPVHeads, pf = nullptr) {
    float* og = o + g * DP;
    const float* pg = p + g * TK;
    const float* ag = alpha + g;
    switch (std::min(kPVHeads, G - g)) {
#if defined(__AVX512F__)
      case 4: pv_heads<4>(og, DP, D, pg, ag, v, n, pf); break;
#endif
      case 3: pv_heads<3>(og, DP, D, pg, ag, v, n, pf); break;
      case 2: pv_heads<2>(og, DP, D, pg, ag, v, n, pf); break;
      default: pv_heads<1>(og, DP, D, pg, ag, v, n, pf); break;
    }
  }
}

template <typename QT, typename KT>
void decode(const AttnArgs& a, int64_t seq, int64_t h, int64_t c0, int64_t c1, int64_t slot, Buffers& buf) {
  const int G = a.G, D = a.D, DP = a.DP, BS = a.BS;
  float* const qs = buf.get(size_t(2 * G * DP + G * TK + 3 * G + 2 * NC * D * W));
  float* const acc = qs + G * DP;
  float* const s = acc + G * DP;
  float* const ms = s + G * TK;
  float* const ls = ms + G;
  float* const alphas = ls + G;
  KT* const ktmp = reinterpret_cast<KT*>(alphas + G);  // NC chunks of (D, W) keys for the copying path
  KT* const vtmp = ktmp + NC * D * W;                   // NC chunks of (W, D) V rows for the copying path

  const int64_t t = a.query_start_loc[seq];
  for (int g = 0; g < G; ++g) {
    const QT* src = static_cast<const QT*>(a.q) + t * a.q_tok_stride + (h * G + g) * a.q_head_stride;
    float* dst = qs + g * DP;
    for (int d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * a.scale;
    ms[g] = kNegInf;
    ls[g] = 0.0f;
  }
  std::memset(acc, 0, sizeof(float) * G * DP);

  const int64_t* table = a.block_tables + seq * a.bt_stride;
  const int64_t block_stride = int64_t(a.KVH) * BS * D, head_off = h * int64_t(BS) * D;
  const KT* kpool = static_cast<const KT*>(a.k_pool);
  const KT* vpool = static_cast<const KT*>(a.v_pool);
  const bool direct = BS % W == 0;  // every chunk of W keys lies in one block: read the pool in place
  const int64_t ks = direct ? BS : W;
  // Chunk c of the tile at p0: its keys k[c] ((D, W) at stride ks) and V rows v[c] ((W, D)); chunks past
  // the range reuse chunk 0 (their scores are masked, their V rows never read).
  auto chunks = [&](int64_t p0, const KT** k, const KT** v) {
    for (int c = 0; c < NC; ++c) {
      const int64_t p = p0 + c * W;
      if (p >= c1) {
        k[c] = k[0];
        v[c] = v[0];
      } else if (direct) {
        const int64_t base = table[p / BS] * block_stride + head_off, col = p % BS;
        k[c] = kpool + base + col;
        v[c] = vpool + base + col * D;
      } else {
        const int nk = int(std::min<int64_t>(W, c1 - p));
        KT* kt = ktmp + c * D * W;
        KT* vt = vtmp + c * W * D;
        for (int j = 0; j < W; ++j) {
          const int64_t off = j < nk ? table[(p + j) / BS] * block_stride + head_off : -1;
          const int64_t col = (p + j) % BS;
          for (int d = 0; d < D; ++d) kt[d * W + j] = off >= 0 ? kpool[off + d * int64_t(BS) + col] : KT(0);
          if (off >= 0) std::memcpy(vt + j * D, vpool + off + col * D, sizeof(KT) * D);
        }
        k[c] = kt;
        v[c] = vt;
      }
    }
  };
  const KT* kc[NC];
  const KT* vc[NC];
  const KT* kn[NC];
  const KT* vn[NC];
  const int64_t lo = window_start(a.seq_lens[seq] - 1, a.window);  // keys before it are out of the window
  chunks(c0, kc, vc);
  for (int64_t p0 = c0; p0 < c1; p0 += TK) {
    const int n = int(std::min<int64_t>(TK, c1 - p0));
    const int skip = int(std::max<int64_t>(0, std::min<int64_t>(lo - p0, TK)));
    const bool next = direct && p0 + TK < c1;
    // Reading the pool in place, the next tile's lines are requested while this one computes, spread
    // over its loops (a line per key vector and dimension, the lines of a V row per key).
    if (next) chunks(p0 + TK, kn, vn);
    qk_tile(qs, G, DP, kc, ks, D, n, skip, a.softcap, s, ms, ls, alphas, next ? kn : nullptr);
    pv_tile(acc, G, DP, D, s, alphas, vc, n, next ? vn : nullptr);
    if (next) {
      std::copy(kn, kn + NC, kc);
      std::copy(vn, vn + NC, vc);
    } else if (p0 + TK < c1) {
      chunks(p0 + TK, kc, vc);
    }
  }

  if (slot >= 0) {
    for (int g = 0; g < G; ++g) {
      float* dst = a.scratch + (slot * G + g) * int64_t(DP + 2);
      dst[0] = ms[g];
      dst[1] = ls[g];
      std::memcpy(dst + 2, acc + g * DP, sizeof(float) * DP);
    }
    return;
  }
  for (int g = 0; g < G; ++g) {
    QT* dst = static_cast<QT*>(a.out) + t * a.out_tok_stride + (h * G + g) * a.out_head_stride;
    const float inv = 1.0f / ls[g];
    for (int d = 0; d < D; ++d) dst[d] = from_f32<QT>(acc[g * DP + d] * inv);
  }
}

// The lines of K and V for positions [p0, p1) of kv head `h` (whole blocks) into L2.
template <typename KT>
void prefetch_l2(const AttnArgs& a, int64_t seq, int64_t h, int64_t p0, int64_t p1) {
  const int BS = a.BS, D = a.D;
  const int64_t* table = a.block_tables + seq * a.bt_stride;
  const int64_t block_stride = int64_t(a.KVH) * BS * D, head_off = h * int64_t(BS) * D;
  const int64_t bytes = int64_t(BS) * D * int64_t(sizeof(KT));
  for (int64_t b = p0 / BS; b * BS < p1; ++b) {
    const int64_t off = (table[b] * block_stride + head_off) * int64_t(sizeof(KT));
    const char* k = static_cast<const char*>(a.k_pool) + off;
    const char* v = static_cast<const char*>(a.v_pool) + off;
    for (int64_t i = 0; i < bytes; i += 64) {
      _mm_prefetch(k + i, _MM_HINT_T1);
      _mm_prefetch(v + i, _MM_HINT_T1);
    }
  }
}

template <typename QT>
void decode_q(const AttnArgs& a, const int64_t* it, Buffers& buf) {
  switch (a.kvtype) {
    case DType::kFloat: decode<QT, float>(a, it[1], it[2], it[3], it[4], it[5], buf); break;
    case DType::kHalf: decode<QT, Half>(a, it[1], it[2], it[3], it[4], it[5], buf); break;
    case DType::kBFloat16: decode<QT, BFloat16>(a, it[1], it[2], it[3], it[4], it[5], buf); break;
  }
}

template <typename QT>
void merge(const AttnArgs& a, int64_t seq, int64_t h, int64_t slot0, int64_t count) {
  const int G = a.G, D = a.D, DP = a.DP;
  const int64_t t = a.query_start_loc[seq];
  for (int g = 0; g < G; ++g) {
    const float* piece = a.scratch + (slot0 * G + g) * int64_t(DP + 2);
    const int64_t step = int64_t(G) * (DP + 2);  // the same head in the next piece
    float m = kNegInf;
    for (int64_t i = 0; i < count; ++i) m = std::max(m, piece[i * step]);
    float l = 0.0f, o[kMaxHeadDim];
    std::fill(o, o + D, 0.0f);
    for (int64_t i = 0; i < count; ++i) {
      const float* p = piece + i * step;
      const float w = std::exp(p[0] - m);
      l += w * p[1];
      for (int d = 0; d < D; ++d) o[d] += w * p[2 + d];
    }
    QT* dst = static_cast<QT*>(a.out) + t * a.out_tok_stride + (h * G + g) * a.out_head_stride;
    const float inv = 1.0f / l;
    for (int d = 0; d < D; ++d) dst[d] = from_f32<QT>(o[d] * inv);
  }
}

}  // namespace

void prefetch_item(const AttnArgs& a, const int64_t* item) {
  if (item[0] != kDecode) return;
  const int64_t p1 = std::min(item[4], item[3] + int64_t(2 * TK));
  switch (a.kvtype) {
    case DType::kFloat: prefetch_l2<float>(a, item[1], item[2], item[3], p1); break;
    case DType::kHalf: prefetch_l2<Half>(a, item[1], item[2], item[3], p1); break;
    case DType::kBFloat16: prefetch_l2<BFloat16>(a, item[1], item[2], item[3], p1); break;
  }
}

void decode_item(const AttnArgs& a, const int64_t* item, Buffers& buf) {
  if (a.qtype == DType::kFloat) {
    decode_q<float>(a, item, buf);
  } else {
    decode_q<BFloat16>(a, item, buf);
  }
}

void merge_pieces(const AttnArgs& a, int64_t seq, int64_t kv_head, int64_t slot0, int64_t count) {
  if (a.qtype == DType::kFloat) {
    merge<float>(a, seq, kv_head, slot0, count);
  } else {
    merge<BFloat16>(a, seq, kv_head, slot0, count);
  }
}

}  // namespace troupe_attn
