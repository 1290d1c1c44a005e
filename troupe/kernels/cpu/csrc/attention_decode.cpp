// Decode attention: one new token, all G query heads of one kv head, over a range of context positions
// (attention.h has the item format and the pool layout).
//
// The range is walked in tiles of kDecodeTile keys; each tile's K and V are read once from the pool and
// serve all G heads, converted to float32 in registers as they are loaded:
// - scores: K is stored transposed per block, so for each dimension d one vector load brings W keys and
//   G broadcast-FMAs (q[g][d] x those keys) accumulate G x (tile / W) score vectors in registers: no
//   horizontal sums;
// - an online-softmax update per head (running max m, running sum l, the output rescaled by
//   exp(m_old - m_new));
// - P x V: for each key, its V row (a few vectors) is loaded once and FMA'd into a block of heads x a chunk
//   of D of float32 output kept in registers.
// A split-K piece leaves (m, l, unnormalised output) in scratch for `merge_pieces`.
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

constexpr int TK = kDecodeTile;
constexpr int NC = TK / W;  // key vectors per tile
#if defined(__AVX512F__)
constexpr int kQKHeads = 8;  // heads per score block: kQKHeads x NC accumulators
constexpr int kPVHeads = 4;  // heads x kPVVecs accumulators per P x V block
#else
constexpr int kQKHeads = 3;
constexpr int kPVHeads = 3;
#endif
constexpr int kPVVecs = 4;

// s[g][0..TK) = q[g] . K[:, chunk c] for GB heads; k[c] is chunk c of the tile as (D, W) at stride ks.
template <int GB, typename KT>
inline void qk_block(const float* q, int DP, const KT* const* k, int64_t ks, int D, float* s) {
  vf acc[GB][NC];
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) acc[g][c] = vzero();
  }
  for (int d = 0; d < D; ++d) {
    vf kv[NC];
    for (int c = 0; c < NC; ++c) kv[c] = vload(k[c] + d * ks);
    for (int g = 0; g < GB; ++g) {
      const vf qb = vset1(q[g * DP + d]);
      for (int c = 0; c < NC; ++c) acc[g][c] = vfma(qb, kv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) vstore(s + g * TK + c * W, acc[g][c]);
  }
}

template <typename KT>
inline void qk_tile(const float* q, int G, int DP, const KT* const* k, int64_t ks, int D, float* s) {
  for (int g = 0; g < G; g += kQKHeads) {
    const float* qg = q + g * DP;
    float* sg = s + g * TK;
    switch (std::min(kQKHeads, G - g)) {
#if defined(__AVX512F__)
      case 8: qk_block<8>(qg, DP, k, ks, D, sg); break;
      case 7: qk_block<7>(qg, DP, k, ks, D, sg); break;
      case 6: qk_block<6>(qg, DP, k, ks, D, sg); break;
      case 5: qk_block<5>(qg, DP, k, ks, D, sg); break;
      case 4: qk_block<4>(qg, DP, k, ks, D, sg); break;
#endif
      case 3: qk_block<3>(qg, DP, k, ks, D, sg); break;
      case 2: qk_block<2>(qg, DP, k, ks, D, sg); break;
      default: qk_block<1>(qg, DP, k, ks, D, sg); break;
    }
  }
}

// o[g][c0 : c0 + NV * W] = o * alpha[g] + sum_j p[g][j] v[j][c0 : ...] for GB heads, j < n.
template <int GB, int NV, typename KT>
inline void pv_block(float* o, int DP, const float* p, const float* alpha, const KT* const* vr, int n, int c0) {
  vf acc[GB][NV];
  for (int g = 0; g < GB; ++g) {
    const vf al = vset1(alpha[g]);
    for (int i = 0; i < NV; ++i) acc[g][i] = vmul(vload(o + g * DP + c0 + i * W), al);
  }
  for (int j = 0; j < n; ++j) {
    vf pb[GB];
    for (int g = 0; g < GB; ++g) pb[g] = vset1(p[g * TK + j]);
    const KT* v = vr[j] + c0;
    for (int i = 0; i < NV; ++i) {
      const vf vv = vload(v + i * W);
      for (int g = 0; g < GB; ++g) acc[g][i] = vfma(pb[g], vv, acc[g][i]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int i = 0; i < NV; ++i) vstore(o + g * DP + c0 + i * W, acc[g][i]);
  }
}

template <int GB, typename KT>
inline void pv_heads(float* o, int DP, int D, const float* p, const float* alpha, const KT* const* vr, int n) {
  int c = 0, nv = D / W;
  for (; nv >= kPVVecs; nv -= kPVVecs, c += kPVVecs * W) pv_block<GB, kPVVecs>(o, DP, p, alpha, vr, n, c);
  switch (nv) {
    case 3: pv_block<GB, 3>(o, DP, p, alpha, vr, n, c); break;
    case 2: pv_block<GB, 2>(o, DP, p, alpha, vr, n, c); break;
    case 1: pv_block<GB, 1>(o, DP, p, alpha, vr, n, c); break;
    default: break;
  }
  c += nv * W;
  if (c < D) {  // D a multiple of 8 but not of W (16): the last 8 dims
    for (int g = 0; g < GB; ++g) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(o + g * DP + c), _mm256_set1_ps(alpha[g]));
      for (int j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[g * TK + j]), load8(vr[j] + c), acc);
      _mm256_storeu_ps(o + g * DP + c, acc);
    }
  }
}

template <typename KT>
inline void pv_tile(float* o, int G, int DP, int D, const float* p, const float* alpha, const KT* const* vr, int n) {
  for (int g = 0; g < G; g += kPVHeads) {
    float* og = o + g * DP;
    const float* pg = p + g * TK;
    const float* ag = alpha + g;
    switch (std::min(kPVHeads, G - g)) {
#if defined(__AVX512F__)
      case 4: pv_heads<4>(og, DP, D, pg, ag, vr, n); break;
#endif
      case 3: pv_heads<3>(og, DP, D, pg, ag, vr, n); break;
      case 2: pv_heads<2>(og, DP, D, pg, ag, vr, n); break;
      default: pv_heads<1>(og, DP, D, pg, ag, vr, n); break;
    }
  }
}

// Online-softmax update of one head over the tile's scores s[0..TK), of which [0, n) are real keys: s
// becomes the probabilities exp(s - m_new), m and l are updated; returns the factor for the old output.
inline float softmax_update(float* s, int n, float& m, float& l) {
  for (int j = n; j < TK; ++j) s[j] = kNegInf;
  vf mx = vset1(kNegInf);
  for (int j = 0; j < TK; j += W) mx = vmax(mx, vload(s + j));
  const float m_new = std::max(m, vhmax(mx));
  const float alpha = m == kNegInf ? 0.0f : std::exp(m - m_new);
  const vf mv = vset1(m_new);
  vf sum = vzero();
  for (int j = 0; j < TK; j += W) {
    const vf p = vexp(vsub(vload(s + j), mv));
    vstore(s + j, p);
    sum = vadd(sum, p);
  }
  l = l * alpha + vsum(sum);
  m = m_new;
  return alpha;
}

template <typename QT, typename KT>
void decode(const AttnArgs& a, int64_t seq, int64_t h, int64_t c0, int64_t c1, int64_t slot, Buffers& buf) {
  const int G = a.G, D = a.D, DP = a.DP, BS = a.BS;
  float* const qs = buf.get(size_t(2 * G * DP + G * TK + 3 * G + NC * D * W));
  float* const acc = qs + G * DP;
  float* const s = acc + G * DP;
  float* const ms = s + G * TK;
  float* const ls = ms + G;
  float* const alphas = ls + G;
  KT* const tmp = reinterpret_cast<KT*>(alphas + G);  // NC chunks of D x W keys for the copying path

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
  const KT* kc[NC];
  const KT* vr[TK];
  const int64_t ks = BS % W == 0 ? BS : W;  // key_chunk's stride: the pool's, or its copies'
  for (int64_t p0 = c0; p0 < c1; p0 += TK) {
    const int n = int(std::min<int64_t>(TK, c1 - p0));
    for (int c = 0; c < NC; ++c) {  // chunks past the range reuse chunk 0: their scores are masked anyway
      const int64_t p = p0 + c * W;
      int64_t stride = 0;
      kc[c] = p >= c1 ? kc[0]
                      : key_chunk(kpool, table, p, int(std::min<int64_t>(W, c1 - p)), BS, block_stride, head_off, D,
                                  W, tmp + c * D * W, stride);
    }
    for (int j = 0; j < n; ++j) {
      const int64_t p = p0 + j;
      vr[j] = vpool + table[p / BS] * block_stride + head_off + (p % BS) * D;
    }
    qk_tile(qs, G, DP, kc, ks, D, s);
    for (int g = 0; g < G; ++g) alphas[g] = softmax_update(s + g * TK, n, ms[g], ls[g]);
    pv_tile(acc, G, DP, D, s, alphas, vr, n);
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
