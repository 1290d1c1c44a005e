// The panel GEMM's two weight layouts: how a panel of NR weight rows is packed (decoded once per call) and
// the MR x NR register-tile micro-kernel that multiplies rows of x by it (panel_gemm.h drives them).
//
// Both compute c[m][j] (m < mr rows of x, j < nc <= NR panel rows) = (first ? bias[j] : c[m][j]) +
// sum_k x[m][k] * W[j][k] over a k range (kc), with x read in place (row stride ldx) and c stored directly
// (row stride ldc; masked or through a buffer past nc). Float32 FMAs on the decoded values: only the
// summation order differs from x @ W^T.
//
// - PanelT ("transposed", both ISAs): dst[k * NR + j] = W[j][k], NR = 2 vectors (AVX-512 32, AVX2 16
//   columns). Outer products: per k, NR / W vector loads of the panel and MR broadcasts of x[m][k] feed
//   MR * 2 FMAs into MR x 2 accumulators (AVX-512 12 x 2 zmm, AVX2 6 x 2 ymm); no horizontal sums. Packing:
//   W rows' block at a time into a row-major stage (L1), then W x W register transposes (16 x 16 / 8 x 8).
// - PanelL4 (AVX-512 only): dst[(k / 4) * 32 + 4 * j + k % 4] = W[j][k], NR = 8: each vector holds 4 k of
//   4 rows. Per 4 k: two panel loads and MR 128-bit broadcasts of x[m][k .. k + 4) feed 2 MR FMAs; each lane
//   keeps one (row, k mod 4) partial sum, reduced once at the end. Packing needs one 128-bit lane shuffle
//   per vector instead of a transpose's four, so it costs about half of PanelT's: the better trade where
//   M is small and the packing is a large part of the call (panel_gemm.h chooses by M).
#pragma once

#include <algorithm>
#include <cstdint>

#include "quant.h"

namespace troupe_quant {

constexpr int G_NV = 2;  // panel vectors per k step

// While block b of a panel's rows is decoded, block b of the next panel's first `rows` rows (nr rows
// further) is prefetched: the packing reads the panel's rows side by side, interleaved streams that the
// hardware prefetcher does not follow well, so weights streamed from memory (every projection of a model
// step) stalled the packing (docs/kernels.md). Spread over the blocks, one line per row and block, rather
// than the next panel at once.
inline void prefetch_next_panel(const uint8_t* blk, int64_t row_bytes, int nr, int rows) {
  const uint8_t* next = blk + nr * row_bytes;
  for (int r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * row_bytes), _MM_HINT_T0);
}

// ------------------------------------------------------------------------------- W x W transposes

#if defined(__AVX512F__)
// r[i] (i < 16) rows of 16 floats -> r[j] = column j
inline void transpose_w(Vf r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // now r[4a + b] holds, per 128-bit lane l, column 4l + (b') of rows 4a..4a+3 (b' the in-lane index)
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#else
inline void transpose_w(Vf r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// ------------------------------------------------------------------------------- PanelT

// NVP panel vectors per k (NR = NVP * W columns), MRP rows of x per register tile
template <int NVP, int MRP>
struct PanelTT {
  using XT = float;  // x's element type
  using PT = float;  // the packed panel's
  static constexpr int MR = MRP;
  static constexpr int NR = NVP * W;
  static constexpr int STAGE = W;  // rows of QK floats the packing stages

  // Decode weight rows [0, nr) (nr <= NR; row r at w + r * row_bytes) into one panel: dst[k * NR + j] =
  // W[j][k] for k < K, zero for j >= nr. `stage`: W * QK floats.
  template <int Q>
  static void pack(const uint8_t* w, int64_t row_bytes, int64_t K, int nr, float* stage, float* dst, int pf_rows) {
    using F = Fmt<Q>;
    constexpr int QK = F::QK;
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_next_panel(w + b * F::BYTES, row_bytes, NR, pf_rows);
      for (int g = 0; g < NVP; ++g) {  // both halves of each panel line while it is in L1
        const int rows = std::clamp(nr - g * W, 0, W);
        for (int r = 0; r < rows; ++r) {
          float* o = stage + r * QK;
          F::decode(w + (g * W + r) * row_bytes + b * F::BYTES, [&](int c, const Vf* v) {
            for (int j = 0; j < NV; ++j) vstore(o + 32 * c + W * j, v[j]);
          });
        }
        if (rows < W) std::fill(stage + rows * QK, stage + W * QK, 0.0f);
        float* d = dst + b * QK * NR + g * W;
        for (int k0 = 0; k0 < QK; k0 += W) {
          Vf t[W];
          for (int r = 0; r < W; ++r) t[r] = vload(stage + r * QK + k0);
          transpose_w(t);
          for (int j = 0; j < W; ++j) vstore(d + (k0 + j) * NR, t[j]);
        }
      }
    }
  }

  // c[m * ldc + j] (m < mr, j < nc) = (first ? bias[j] : c[...]) + sum_k x[m * ldx + k] * b[k * NR + j]
  template <int mr>
  static inline void micro(const float* x, int64_t ldx, const float* b, int64_t kc, float* c, int64_t ldc, int nc,
                             const float* bias, bool first) {
    Vf acc[mr][NVP];
    for (int m = 0; m < mr; ++m)
      for (int v = 0; v < NVP; ++v) acc[m][v] = vzero();
    for (int64_t k = 0; k < kc; ++k) {
      Vf bv[NVP];
      for (int v = 0; v < NVP; ++v) bv[v] = vload(b + k * NR + v * W);
      for (int m = 0; m < mr; ++m) {
        const Vf a = vset1(x[m * ldx + k]);
        for (int v = 0; v < NVP; ++v) acc[m][v] = vfma(a, bv[v], acc[m][v]);
      }
    }
#if defined(__AVX512F__)
    __mmask16 mask[NVP];
    for (int v = 0; v < NVP; ++v) {
      const int n = std::clamp(nc - v * W, 0, W);
      mask[v] = static_cast<__mmask16>((1u << n) - 1);
    }
    Vf base[NVP];
    for (int v = 0; v < NVP; ++v) base[v] = first && bias ? _mm512_maskz_loadu_ps(mask[v], bias + v * W) : vzero();
    for (int m = 0; m < mr; ++m)
      for (int v = 0; v < NVP; ++v) {
        float* p = c + m * ldc + v * W;
        const Vf prev = first ? base[v] : _mm512_maskz_loadu_ps(mask[v], p);
        _mm512_mask_storeu_ps(p, mask[v], vadd(prev, acc[m][v]));
      }
#else
    if (nc == NR) {
      Vf base[NVP];
      for (int v = 0; v < NVP; ++v) base[v] = first && bias ? vload(bias + v * W) : vzero();
      for (int m = 0; m < mr; ++m)
        for (int v = 0; v < NVP; ++v) {
          float* p = c + m * ldc + v * W;
          vstore(p, vadd(first ? base[v] : vload(p), acc[m][v]));
        }
    } else {  // the tile's last, partial panel
      alignas(32) float t[NR];
      for (int m = 0; m < mr; ++m) {
        for (int v = 0; v < NVP; ++v) vstore(t + v * W, acc[m][v]);
        float* p = c + m * ldc;
        for (int j = 0; j < nc; ++j) p[j] = (first ? (bias ? bias[j] : 0.0f) : p[j]) + t[j];
      }
    }
#endif
  }
};
#if defined(__AVX512F__)
using PanelT = PanelTT<2, 12>;
#else
using PanelT = PanelTT<2, 6>;
#endif

#if defined(__AVX512F__)
// ------------------------------------------------------------------------------- PanelL4 (AVX-512)

struct PanelL4 {
  using XT = float;
  using PT = float;
  static constexpr int MR = 12;
  static constexpr int NR = 8;
  static constexpr int STAGE = 4;

  // Decode weight rows [0, nr) (nr <= NR; row r at w + r * row_bytes) into one panel: the 4 values
  // W[r][4q .. 4q + 4) at dst[q * 32 + 4 * r], zeros for r >= nr. Block by block, four rows at a time: their
  // values go to `stage` (4 x QK floats, L1), then for each 8 values of k two 256-bit loads and inserts pair
  // rows (0 | 1) and (2 | 3), and one 128-bit lane shuffle per output vector finishes the interleave.
  template <int Q>
  static void pack(const uint8_t* w, int64_t row_bytes, int64_t K, int nr, float* stage, float* dst, int pf_rows) {
    using F = Fmt<Q>;
    constexpr int QK = F::QK;
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_next_panel(w + b * F::BYTES, row_bytes, NR, pf_rows);
      for (int r0 = 0; r0 < NR; r0 += 4) {
        const int rows = std::clamp(nr - r0, 0, 4);
        auto decode = [&](int r) {
          float* o = stage + r * QK;
          F::decode(w + (r0 + r) * row_bytes + b * F::BYTES, [&](int c, const Vf* v) {
            for (int j = 0; j < NV; ++j) vstore(o + 32 * c + W * j, v[j]);
          });
        };
        if (rows == 4) {  // a fixed count: the four rows' decodes interleave
          for (int r = 0; r < 4; ++r) decode(r);
        } else {
          for (int r = 0; r < rows; ++r) decode(r);
          std::fill(stage + rows * QK, stage + 4 * QK, 0.0f);
        }
        float* d = dst + b * QK * NR + 4 * r0;
        for (int k = 0; k < QK; k += 8) {
          const Vf u = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(stage + k)),
                                          _mm256_loadu_ps(stage + QK + k), 1);  // rows 0 | 1, 8 k each
          const Vf v = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(stage + 2 * QK + k)),
                                          _mm256_loadu_ps(stage + 3 * QK + k), 1);  // rows 2 | 3
          vstore(d + k * NR, _mm512_shuffle_f32x4(u, v, 0x88));          // k .. k + 4 of rows r0 .. r0 + 4
          vstore(d + (k + 4) * NR, _mm512_shuffle_f32x4(u, v, 0xDD));    // k + 4 .. k + 8
        }
      }
    }
  }

  // c[m * ldc + j] (m < mr, j < nc) = (first ? bias[j] : c[...]) + sum_k x[m * ldx + k] * W[j][k], the panel
  // as `pack` lays it out, kc a multiple of 4. Per k step: x[m][k .. k + 4) broadcast to the four 128-bit
  // lanes, times the two panel vectors (rows 0..3, 4..7, 4 k each): each lane accumulates one (row, k mod 4)
  // partial sum, reduced at the end (two rows of x per vector permute).
  template <int mr>
  static inline void micro(const float* x, int64_t ldx, const float* b, int64_t kc, float* c, int64_t ldc, int nc,
                             const float* bias, bool first) {
    Vf acc[mr][G_NV];
    for (int m = 0; m < mr; ++m)
      for (int v = 0; v < G_NV; ++v) acc[m][v] = vzero();
    for (int64_t k = 0; k < kc; k += 4) {
      const Vf b0 = vload(b + k * NR), b1 = vload(b + k * NR + W);
      for (int m = 0; m < mr; ++m) {
        const Vf a = _mm512_broadcast_f32x4(_mm_loadu_ps(x + m * ldx + k));
        acc[m][0] = vfma(a, b0, acc[m][0]);
        acc[m][1] = vfma(a, b1, acc[m][1]);
      }
    }
    const __mmask16 lo = static_cast<__mmask16>((1u << nc) - 1), hi = static_cast<__mmask16>(lo << 8);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    // bias - 8 and c1 below address lanes 8..15 only: the masked-off lanes 0..7 are never accessed
    Vf base = vzero();
    if (first && bias) base = _mm512_mask_loadu_ps(_mm512_maskz_loadu_ps(lo, bias), hi, bias - 8);
    for (int m = 0; m < mr; m += 2) {
      const bool two = m + 1 < mr;
      const Vf a0 = acc[m][0], b0 = acc[m][1];
      const int m1 = two ? m + 1 : m;  // (an index in range for odd mr; its values are not used then)
      const Vf a1 = two ? acc[m1][0] : vzero(), b1 = two ? acc[m1][1] : vzero();
      // lane 4i + (0, 1, 2, 3) of t0: (a0, b0, a0, b0) partial sums of row i (and 4 + i), two k each
      const Vf t0 = vadd(_mm512_unpacklo_ps(a0, b0), _mm512_unpackhi_ps(a0, b0));
      const Vf t1 = vadd(_mm512_unpacklo_ps(a1, b1), _mm512_unpackhi_ps(a1, b1));
      // lane 4i + (0, 1, 2, 3): sums of row m (col i, 4 + i), row m + 1 (col i, 4 + i)
      const Vf u = vadd(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
      const Vf s = _mm512_permutexvar_ps(order, u);  // row m's 8 columns, then row m + 1's
      float* c0 = c + m * ldc;
      float* c1 = c0 + ldc - 8;  // row m + 1's columns are lanes 8..15
      Vf prev = base;
      if (!first) {
        prev = _mm512_maskz_loadu_ps(lo, c0);
        if (two) prev = _mm512_mask_loadu_ps(prev, hi, c1);
      }
      const Vf out = vadd(prev, s);
      _mm512_mask_storeu_ps(c0, lo, out);
      if (two) _mm512_mask_storeu_ps(c1, hi, out);
    }
  }
};
#endif

}  // namespace troupe_quant
