// Decode attention: one new token, all G query heads of one kv head, over a range of context positions
// (attention.h has the item format and the pool layout).
//
// The range is walked in tiles of kDecodeTile keys. Each tile's K and V rows are read once from the pool
// (converted to float32 in a per-thread buffer unless the pool is float32 already) and serve all G heads:
// scores are dot products, eight keys at a time with one 8x8 transpose-add at the end (no horizontal sum
// per key); then an online-softmax update per head (running max m, running sum l, the output rescaled by
// exp(m_old - m_new)); then P x V into G float32 output rows kept in vector registers one chunk of D at a
// time. A split-K piece leaves (m, l, unnormalised output) in scratch for `merge_pieces`.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

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

// o[c0 : c0 + NV * W] = o * alpha + sum_j p[j] * v[j][c0 : ...]
template <int NV>
inline void pv_chunk(float* o, const float* p, const float* const* vr, int n, int c0, float alpha) {
  vf acc[NV];
  const vf al = vset1(alpha);
  for (int i = 0; i < NV; ++i) acc[i] = vmul(vload(o + c0 + i * W), al);
  for (int j = 0; j < n; ++j) {
    const vf pj = vset1(p[j]);
    const float* v = vr[j] + c0;
    for (int i = 0; i < NV; ++i) acc[i] = vfma(pj, vload(v + i * W), acc[i]);
  }
  for (int i = 0; i < NV; ++i) vstore(o + c0 + i * W, acc[i]);
}

inline void pv_row(float* o, const float* p, const float* const* vr, int n, int DP, float alpha) {
  int c = 0, nv = DP / W;
  for (; nv >= 8; nv -= 8, c += 8 * W) pv_chunk<8>(o, p, vr, n, c, alpha);
  switch (nv) {
    case 7: pv_chunk<7>(o, p, vr, n, c, alpha); break;
    case 6: pv_chunk<6>(o, p, vr, n, c, alpha); break;
    case 5: pv_chunk<5>(o, p, vr, n, c, alpha); break;
    case 4: pv_chunk<4>(o, p, vr, n, c, alpha); break;
    case 3: pv_chunk<3>(o, p, vr, n, c, alpha); break;
    case 2: pv_chunk<2>(o, p, vr, n, c, alpha); break;
    case 1: pv_chunk<1>(o, p, vr, n, c, alpha); break;
    default: break;
  }
}

// s[0..n8) = q . k[j] for the rows kr[0..n8), n8 a multiple of 8 (q and the rows hold DP floats).
inline void scores(const float* q, const float* const* kr, int n8, int DP, float* s) {
  for (int j0 = 0; j0 < n8; j0 += 8) {
    vf acc[8];
    for (int jj = 0; jj < 8; ++jj) acc[jj] = vzero();
    for (int c = 0; c < DP; c += W) {
      const vf qv = vload(q + c);
      for (int jj = 0; jj < 8; ++jj) acc[jj] = vfma(qv, vload(kr[j0 + jj] + c), acc[jj]);
    }
    __m256 f[8];
    for (int jj = 0; jj < 8; ++jj) f[jj] = vfold8(acc[jj]);
    _mm256_storeu_ps(s + j0, vsum8x8(f));
  }
}

// Online-softmax update of one head over the tile's scores s[0..n) (s has kDecodeTile floats): s becomes
// the probabilities exp(s - m_new), m and l are updated; returns the factor for the old output.
inline float softmax_update(float* s, int n, float& m, float& l) {
  for (int j = n; j < kDecodeTile; ++j) s[j] = kNegInf;
  vf mx = vset1(kNegInf);
  for (int j = 0; j < kDecodeTile; j += W) mx = vmax(mx, vload(s + j));
  const float m_new = std::max(m, vhmax(mx));
  const float alpha = m == kNegInf ? 0.0f : std::exp(m - m_new);
  const vf mv = vset1(m_new);
  vf sum = vzero();
  for (int j = 0; j < kDecodeTile; j += W) {
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
  constexpr int TK = kDecodeTile;
  constexpr bool direct = std::is_same<KT, float>::value;  // pool rows usable in place when DP == D
  const bool in_place = direct && DP == D;
  float* const qs = buf.get(size_t(2 * G * DP + G * TK + 2 * TK * DP + DP + 3 * G));
  float* const acc = qs + G * DP;
  float* const s = acc + G * DP;
  float* const kf = s + G * TK;
  float* const vfb = kf + TK * DP;
  float* const zero_row = vfb + TK * DP;
  float* const ms = zero_row + DP;
  float* const ls = ms + G;
  float* const alphas = ls + G;
  std::memset(zero_row, 0, sizeof(float) * DP);

  const int64_t t = a.query_start_loc[seq];
  for (int g = 0; g < G; ++g) {
    const QT* src = static_cast<const QT*>(a.q) + t * a.q_tok_stride + (h * G + g) * a.q_head_stride;
    float* dst = qs + g * DP;
    for (int d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * a.scale;
    for (int d = D; d < DP; ++d) dst[d] = 0.0f;
    ms[g] = kNegInf;
    ls[g] = 0.0f;
  }
  std::memset(acc, 0, sizeof(float) * G * DP);
  if (!in_place) {  // the pad columns [D, DP) of the converted rows stay zero
    for (int j = 0; j < TK; ++j) {
      for (int d = D; d < DP; ++d) kf[j * DP + d] = vfb[j * DP + d] = 0.0f;
    }
  }

  const int64_t* table = a.block_tables + seq * a.bt_stride;
  const int64_t block_stride = int64_t(a.KVH) * BS * D, head_off = h * int64_t(BS) * D;
  const KT* kpool = static_cast<const KT*>(a.k_pool);
  const KT* vpool = static_cast<const KT*>(a.v_pool);
  int64_t bi = c0 / BS;
  int off = int(c0 % BS);
  const float* kr[TK];
  const float* vr[TK];
  for (int64_t p0 = c0; p0 < c1; p0 += TK) {
    const int n = int(std::min<int64_t>(TK, c1 - p0));
    for (int j = 0; j < n; ++j) {
      const int64_t row = table[bi] * block_stride + head_off + int64_t(off) * D;
      if (in_place) {
        kr[j] = reinterpret_cast<const float*>(kpool + row);
        vr[j] = reinterpret_cast<const float*>(vpool + row);
      } else {
        convert_row(kpool + row, kf + j * DP, D);
        convert_row(vpool + row, vfb + j * DP, D);
        kr[j] = kf + j * DP;
        vr[j] = vfb + j * DP;
      }
      if (++off == BS) {
        off = 0;
        ++bi;
      }
    }
    const int n8 = (n + 7) & ~7;
    for (int j = n; j < n8; ++j) kr[j] = zero_row;
    for (int g = 0; g < G; ++g) scores(qs + g * DP, kr, n8, DP, s + g * TK);
    for (int g = 0; g < G; ++g) alphas[g] = softmax_update(s + g * TK, n, ms[g], ls[g]);
    for (int g = 0; g < G; ++g) pv_row(acc + g * DP, s + g * TK, vr, n, DP, alphas[g]);
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
