// The 16-bit rows path of "gguf-bf16" at decode sizes: y (M, N) = x (M, K) @ W^T (+ bias) for a few rows of
// x, with x quantized to int16 once per call and W's K-quant blocks multiplied as the small integers they
// hold, by `vpdpwssd` (AVX512_VNNI: 32 int16 products summed into 16 int32 lanes per instruction, at the FMA's
// rate). Included by qmatmul_bf16.cpp and moe.cpp, after qmatmul_rows.h (the float rows path, whose grouping,
// prefetching and threading this one follows).
//
// Formats: Q4_K, Q5_K, Q6_K. A Q4_K sub-block of 32 values is w_i = ds_j * q_i - dm_j (q_i a nibble,
// ds_j = d * scale_j, dm_j = dmin * min_j: quant.h; Q5_K adds a fifth bit, Q6_K below). With x_i ~= s * xq_i
// (xq_i int16, one s per 32 values of x: s = max |x_i| / 32767):
//   dot(x, w) over the sub-block ~= (ds_j * s) * dot(xq, q) - dm_j * sum(x)
// dot(xq, q) is exact in int32 (32 x 15 x 32767 < 2^31); sum(x) is x's own float32 sum. Per 64 weights: one
// widening load, an AND and a shift for the two nibbles, then per row of x two `vpdpwssd`, two conversions
// and two FMAs, against the float path's two table builds, four lookups (on the shuffle port) and four
// FMAs. On a Xeon (model 207) 1.6x the float rows path at M = 1, 1.45x at 2, 1.3x at 4 (docs/kernels.md).
//
// Error: the weights are exact (every format's integers and scales are used as they are); x is rounded to
// steps of 2^-16 of its 32-value chunk's largest magnitude (bf16 rounds each value to 2^-9 of itself: the
// int16 step is the finer one for values above 1/128 of their chunk's largest); the rest is float32
// arithmetic. tests/kernels/test_cpu_bf16.py bounds it against x times the reference's dequantized weights
// in float64; on tiny K-quant models the logits stay within 7e-4 of transformers' largest, where the mode's
// bf16 GEMM is off by 1.5e-2 to 7e-2 (tests/models/test_gguf.py).
#pragma once

#include <cstdint>
#include <vector>

#include "qmatmul_rows.h"
#include "quant.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TROUPE_ROWS_I16 1
namespace troupe_quant {
namespace rows_i16 {

// the formats with a 16-bit rows decoder; the others keep the float rows path
template <int Q>
constexpr bool decodes() {
  return Q == Q4_K || Q == Q5_K || Q == Q6_K;
}
inline bool supported(int64_t qtype) {
  bool yes = false;
  dispatch(qtype, [&](auto q) { yes = decodes<decltype(q)::value>(); });
  return yes;
}

// x prepared for M rows (each K values, K a multiple of 32): q (M, K) int16, per 32-value chunk its scale s
// and its float32 sum (M, K / 32 each)
struct Prepared {
  const int16_t* q;
  const float* s;
  const float* sum;
  int64_t ldq, lds;  // row strides of q and of s / sum
};

// one row of x into q[K], s[K / 32], sum[K / 32]
inline void prepare_row(const float* x, int64_t K, int16_t* q, float* s, float* sum) {
  for (int64_t c = 0; c < K / 32; ++c) {
    const __m512 a = _mm512_loadu_ps(x + 32 * c), b = _mm512_loadu_ps(x + 32 * c + 16);
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
    s[c] = mx / 32767.0f;
    sum[c] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    // round to nearest (MXCSR's default), saturated to int16
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * c), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * c + 16),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
  }
}

// Storage for M prepared rows of K values, and the view of it.
struct PreparedRows {
  std::vector<int16_t> q;
  std::vector<float> s, sum;
  int64_t K = 0;
  PreparedRows(int64_t M, int64_t K_) : q(M * K_), s(M * (K_ / 32)), sum(M * (K_ / 32)), K(K_) {}
  void prepare(const float* x, int64_t row) { prepare_row(x, K, q.data() + row * K, s.data() + row * (K / 32), sum.data() + row * (K / 32)); }
  Prepared rows_from(int64_t row) const {
    return {q.data() + row * K, s.data() + row * (K / 32), sum.data() + row * (K / 32), K, K / 32};
  }
};

// The loop both decoders share: acc zeroed, then for each block b of the R weight rows (row r's at
// w + r * row_bytes + b * BYTES), the group's next bytes prefetched and body(r, block, b) for each row r
// (unrolled, so each row's accumulators stay in registers).
template <int MB, int R, int BYTES, class Body>
inline void for_blocks(Vf (&acc)[R][MB], const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* pf, Body&& body) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t o = b * R * BYTES; o < (b + 1) * R * BYTES; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + o), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) body(r, w + r * row_bytes + b * BYTES, b);
  }
}

// Q4_K and Q5_K (quant.h's layouts): out[m * ldo + r] = dot(x[m], W[n + r]) (+ bias[r]) for m < MB, r < R: `w`
// points at row n, `pf` at the bytes to prefetch while this group computes (as rows::group). Q5_K's fifth
// bit of sub-block j, bit j of its qh byte, is ORed in as 16 (its values 0..31 keep the int32 sums exact).
template <int Q, int MB, int R>
inline void group_k(const Prepared& x, const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* pf, float* out,
                    int64_t ldo, const float* bias) {
  static_assert(Q == Q4_K || Q == Q5_K, "group_k decodes Q4_K and Q5_K");
  using F = Fmt<Q>;
  constexpr int QS = Q == Q5_K ? 48 : 16;  // offset of the nibbles in a block
  const __m512i low4 = _mm512_set1_epi16(0x000F), bit4 = _mm512_set1_epi16(0x0010), zero = _mm512_setzero_si512();
  Vf acc[R][MB];
  for_blocks<MB, R, F::BYTES>(acc, w, row_bytes, nb, pf, [&](int r, const uint8_t* blk, int64_t b) {
    alignas(32) float ds[8], dm[8];
    k_scales(blk, ds, dm);
    alignas(32) float f[MB][8];  // ds_j * s_j per row of x, read back as broadcasts (as k_scales's)
    for (int m = 0; m < MB; ++m) {
      const float* xs = x.s + m * x.lds + b * 8;
      _mm256_store_ps(f[m], _mm256_mul_ps(_mm256_load_ps(ds), _mm256_loadu_ps(xs)));
      // - sum_j dm_j * sum(x over sub-block j), in the low 8 lanes
      acc[r][m] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(_mm256_load_ps(dm)),
                                   _mm512_zextps256_ps512(_mm256_loadu_ps(x.sum + m * x.lds + b * 8)), acc[r][m]);
    }
    asm volatile("" : : "r"(f) : "memory");
    const uint8_t* q = blk + QS;
    __m512i qh4 = zero;  // Q5_K: the 32 qh bytes as words, shifted up by 4 (bit j of a byte lands on 16 << j)
    if constexpr (Q == Q5_K)
      qh4 = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))), 4);
    for (int c = 0; c < 4; ++c) {  // bytes 32c.. hold sub-block 2c (low nibbles) and 2c + 1 (high)
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c)));
      __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
      if constexpr (Q == Q5_K) {  // nib | (qh4 >> j & 16)
        lo = _mm512_ternarylogic_epi32(lo, _mm512_srli_epi16(qh4, 2 * c), bit4, 0xF8);
        hi = _mm512_ternarylogic_epi32(hi, _mm512_srli_epi16(qh4, 2 * c + 1), bit4, 0xF8);
      }
      for (int m = 0; m < MB; ++m) {
        const int16_t* xq = x.q + m * x.ldq + b * 256 + 64 * c;
        const __m512i s_lo = _mm512_dpwssd_epi32(zero, lo, _mm512_loadu_si512(xq));
        const __m512i s_hi = _mm512_dpwssd_epi32(zero, hi, _mm512_loadu_si512(xq + 32));
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_lo), _mm512_set1_ps(f[m][2 * c]), acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_hi), _mm512_set1_ps(f[m][2 * c + 1]), acc[r][m]);
      }
    }
  });
  rows::store_sums<MB, R>(acc, out, ldo, bias);
}

// Q6_K (ql[128], qh[64], int8 scales[16], d; w = d * scale * (q - 32) per 16 values, q 6 bits): q - 32 as
// signed words (|q - 32| <= 32: exact int32 sums) and no min term. A 32-value chunk spans two scales: the
// `vpdpwssd` lanes 0..7 hold the first 16 values' sums, 8..15 the second's, so the chunk's scale is one
// vector of the two (a lane permute of the block's 16 d * scale products, as quant.h's decoder computes
// them), times x's chunk scale.
template <int MB, int R>
inline void group_q6k(const Prepared& x, const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* pf, float* out,
                      int64_t ldo, const float* bias) {
  using F = Fmt<Q6_K>;
  const __m512i low4 = _mm512_set1_epi16(0x000F), bits45 = _mm512_set1_epi16(0x0030), k32 = _mm512_set1_epi16(32);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  Vf acc[R][MB];
  for_blocks<MB, R, F::BYTES>(acc, w, row_bytes, nb, pf, [&](int r, const uint8_t* blk, int64_t b) {
    const __m512 dsc = q6k_scales(blk);
    for (int half = 0; half < 2; ++half) {
      const __m512i qh4 = _mm512_slli_epi16(
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * half))), 4);
      const __m512i ql0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half)));
      const __m512i ql1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * half + 32)));
      for (int i = 0; i < 4; ++i) {  // values 32i.. of this half: chunk c = 4 half + i, scales 2c and 2c + 1
        const int c = 4 * half + i;
        const __m512i ql = i % 2 == 0 ? ql0 : ql1;
        const __m512i nib = i < 2 ? _mm512_and_si512(ql, low4) : _mm512_srli_epi16(ql, 4);
        const __m512i q = _mm512_sub_epi16(_mm512_ternarylogic_epi32(nib, _mm512_srli_epi16(qh4, 2 * i), bits45, 0xF8), k32);
        const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(pair, _mm512_set1_epi32(2 * c)), dsc);
        for (int m = 0; m < MB; ++m) {
          const int16_t* xq = x.q + m * x.ldq + b * 256 + 32 * c;
          const __m512i sums = _mm512_dpwssd_epi32(zero, q, _mm512_loadu_si512(xq));
          const __m512 fs = _mm512_mul_ps(scale, _mm512_set1_ps(x.s[m * x.lds + b * 8 + c]));
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), fs, acc[r][m]);
        }
      }
    }
  });
  rows::store_sums<MB, R>(acc, out, ldo, bias);
}

template <int Q, int MB, int R>
inline void group(const Prepared& x, const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* pf, float* out,
                  int64_t ldo, const float* bias) {
  if constexpr (Q == Q6_K)
    group_q6k<MB, R>(x, w, row_bytes, nb, pf, out, ldo, bias);
  else
    group_k<Q, MB, R>(x, w, row_bytes, nb, pf, out, ldo, bias);
}

// rows [g0 * R, min(g1 * R, N)) of the output for MB rows of x, R = rows::group_rows<MB>() (as rows::range)
template <int Q, int MB>
void range(const Prepared& x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t g0, int64_t g1,
           float* out, int64_t ldo, const float* bias) {
  constexpr int R = rows::group_rows<MB>();
  const int64_t nb = K / Fmt<Q>::QK;
  rows::walk_groups<R>(
      w, row_bytes, N, g0, g1,
      [&](int64_t n, const uint8_t* pf) {
        group<Q, MB, R>(x, w + n * row_bytes, row_bytes, nb, pf, out + n, ldo, bias ? bias + n : nullptr);
      },
      [&](int64_t r, const uint8_t* pf) {
        group<Q, MB, 1>(x, w + r * row_bytes, row_bytes, nb, pf, out + r, ldo, bias ? bias + r : nullptr);
      });
}

// Output rows [n0, n1) (multiples of 4, or n1 = N) for the M prepared rows of x from row0, in passes of
// rows::MAX_MB rows of x; out (M, ldo) holds their outputs.
template <int Q>
void rows_range(const PreparedRows& x, int64_t row0, int64_t M, const uint8_t* w, int64_t row_bytes, int64_t N,
                int64_t n0, int64_t n1, float* out, int64_t ldo, const float* bias) {
  rows::passes(M, [&](int64_t m0, auto mb) {
    range<Q, decltype(mb)::value>(x.rows_from(row0 + m0), x.K, w, row_bytes, N, n0 / 4, (n1 + 3) / 4, out + m0 * ldo,
                                  ldo, bias);
  });
}
static_assert(rows::group_rows<1>() == 4 && rows::group_rows<4>() == 4, "rows_range assumes groups of 4 weight rows");

// y = x @ W^T (+ bias) for M rows of x: N split across threads in contiguous runs of groups of 4 rows
template <int Q>
void rows_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
               const float* bias) {
  PreparedRows xp(M, K);
  for (int64_t m = 0; m < M; ++m) xp.prepare(x + m * K, m);
  const int64_t groups = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, rows::MIN_BLOCKS_PER_THREAD / std::max<int64_t>(1, 4 * (K / Fmt<Q>::QK)));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    rows_range<Q>(xp, 0, M, w, row_bytes, N, 4 * g0, std::min(N, 4 * g1), out, N, bias);
  });
}

}  // namespace rows_i16
}  // namespace troupe_quant
#endif
