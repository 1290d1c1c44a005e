// The bf16 panel layout for the panel GEMM (panel_gemm.h drives it as it drives panel_pack.h's float ones):
// weight panels decoded from GGUF blocks to float32 (quant.h), rounded to bfloat16 (round to nearest even)
// and packed in k pairs; rows of x in bfloat16; products summed in float32 by `vdpbf16ps`
// (`_mm512_dpbf16_ps`: per float lane, acc += a[2i] * b[2i] + a[2i + 1] * b[2i + 1]). Compiled only where
// the compiler targets AVX512_BF16 (`__AVX512BF16__`); elsewhere this header defines nothing.
//
// PanelB: NR = 32 weight rows, MR = 12 rows of x. dst[(k / 2) * 2 NR + 2 j + k % 2] = bf16(W[j][k]): for each
// k pair, one 64-byte line per 16 rows holding (W[j][k], W[j][k + 1]) as one 32-bit lane. The micro-kernel:
// per k pair, two panel loads and MR 32-bit broadcasts of (x[m][k], x[m][k + 1]) feed 2 MR `vdpbf16ps` into
// MR x 2 float32 accumulators, twice the multiply-adds of a float FMA per instruction. Packing: a block of 16
// rows decoded into a float stage (L1), converted to bf16 (32 k per row = 16 pairs of 32 bits) and put
// through the same 16 x 16 transpose of 32-bit lanes as the float PanelT (a pair moves as one lane).
//
// Error (what tests/kernels/test_cpu_bf16.py bounds): each x and W value is rounded once to bf16 (relative
// error <= 2^-9), the sums are float32: |out - x @ W^T| <= ~2^-8 * sum_k |x[m][k]| |W[n][k]| + float32 rounding.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "panel_pack.h"
#include "quant.h"

namespace troupe_quant {

#if defined(__AVX512BF16__)

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }  // the same 64 bytes (a GCC vector cast)
inline __m512i bh_bits(__m512bh v) { return (__m512i)v; }

struct PanelB {
  using XT = uint16_t;  // bf16 bits
  using PT = uint16_t;
  static constexpr int MR = 12;
  static constexpr int NR = 32;
  static constexpr int STAGE = 16;  // rows of QK floats the packing stages

  // Decode weight rows [0, nr) (nr <= NR; row r at w + r * row_bytes), K values each, into one panel as above;
  // rows >= nr are zeros. `stage`: 16 * QK floats.
  template <int Q>
  static void pack(const uint8_t* w, int64_t row_bytes, int64_t K, int nr, float* stage, uint16_t* dst, int pf_rows) {
    using F = Fmt<Q>;
    constexpr int QK = F::QK;
    const int64_t nb = K / QK;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_next_panel(w + b * F::BYTES, row_bytes, NR, pf_rows);
      for (int g = 0; g < NR / 16; ++g) {
        const int rows = std::clamp(nr - g * 16, 0, 16);
        for (int r = 0; r < rows; ++r) {
          float* o = stage + r * QK;
          F::decode(w + (g * 16 + r) * row_bytes + b * F::BYTES, [&](int c, const Vf* v) {
            for (int j = 0; j < NV; ++j) vstore(o + 32 * c + W * j, v[j]);
          });
        }
        if (rows < 16) std::fill(stage + rows * QK, stage + 16 * QK, 0.0f);
        uint16_t* d = dst + b * QK * NR + g * 32;  // pair b * QK / 2, rows g * 16 ..
        for (int k0 = 0; k0 < QK; k0 += 32) {
          Vf t[16];
          for (int r = 0; r < 16; ++r) {
            const float* s = stage + r * QK + k0;
            // 32 bf16 in k order (the second argument fills the low half): 16 pairs, one per 32-bit lane
            t[r] = _mm512_castsi512_ps(bh_bits(_mm512_cvtne2ps_pbh(vload(s + 16), vload(s))));
          }
          transpose_w(t);  // t[p] = pair k0 / 2 + p of the 16 rows
          for (int p = 0; p < 16; ++p) vstore(reinterpret_cast<float*>(d + (k0 / 2 + p) * 2 * NR), t[p]);
        }
      }
    }
  }

  // c[m * ldc + j] (m < mr, j < nc) = (first ? bias[j] : c[...]) + sum_k x[m * ldx + k] * W[j][k], kc even
  template <int mr>
  static inline void micro(const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t kc, float* c, int64_t ldc, int nc,
                           const float* bias, bool first) {
    Vf acc[mr][2];
    for (int m = 0; m < mr; ++m) acc[m][0] = acc[m][1] = vzero();
    for (int64_t k = 0; k < kc; k += 2) {
      const __m512bh b0 = as_bh(_mm512_loadu_si512(b + k * NR)), b1 = as_bh(_mm512_loadu_si512(b + k * NR + 32));
      for (int m = 0; m < mr; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * ldx + k, 4);
        const __m512bh a = as_bh(_mm512_set1_epi32(pair));
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
      }
    }
    __mmask16 mask[2];
    for (int v = 0; v < 2; ++v) mask[v] = static_cast<__mmask16>((1u << std::clamp(nc - v * 16, 0, 16)) - 1);
    Vf base[2];
    for (int v = 0; v < 2; ++v) base[v] = first && bias ? _mm512_maskz_loadu_ps(mask[v], bias + v * 16) : vzero();
    for (int m = 0; m < mr; ++m)
      for (int v = 0; v < 2; ++v) {
        float* p = c + m * ldc + v * 16;
        const Vf prev = first ? base[v] : _mm512_maskz_loadu_ps(mask[v], p);
        _mm512_mask_storeu_ps(p, mask[v], vadd(prev, acc[m][v]));
      }
  }
};

// x (M, K) float32 -> (M, K) bf16 bits, round to nearest even (K a multiple of 32)
inline void to_bf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, bh_bits(v));
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Whether this process may use the AMX tile data (Linux asks for it once per process:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); refused on kernels before 5.16).
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// The tile configuration every PanelA call uses: palette 1, all eight tiles 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// PanelB's panels (the same packing) multiplied with AMX tiles: per 32 k, A tiles of 16 rows of x (tmm4, 5),
// B tiles of the panel's 16-row halves (tmm6, 7: 16 k pairs x 16 rows, PanelB's lines at a 128-byte stride),
// C tiles tmm0..3 (float32). MR = 32 rows of x per call; A tiles read 16 or 32 rows from x whatever mr is, so
// x must hold 32 rows (zeros or values never stored) past any block: the caller pads it. Between
// `amx_begin()` and `amx_end()` on the calling thread only.
struct PanelA : PanelB {
  static constexpr int MR = 32;

  static void amx_begin() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  static void amx_end() { _tile_release(); }

  template <int mr>
  static inline void micro(const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t kc, float* c, int64_t ldc, int nc,
                           const float* bias, bool first) {
    micro_rt(mr, x, ldx, b, kc, c, ldc, nc, bias, first);
  }

  static void micro_rt(int mr, const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t kc, float* c, int64_t ldc,
                       int nc, const float* bias, bool first) {
    alignas(64) float buf[32 * 32];  // (32, 32): the C tiles
    const int64_t xs = 2 * ldx;      // bytes
    _tile_zero(0);
    _tile_zero(1);
    if (mr > 16) {
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < kc; k += 32) {
        _tile_loadd(6, b + k * NR, 4 * NR);
        _tile_loadd(7, b + k * NR + 32, 4 * NR);
        _tile_loadd(4, x + k, xs);
        _tile_loadd(5, x + 16 * ldx + k, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(2, buf + 16 * 32, 128);
      _tile_stored(3, buf + 16 * 32 + 16, 128);
    } else {
      for (int64_t k = 0; k < kc; k += 32) {
        _tile_loadd(6, b + k * NR, 4 * NR);
        _tile_loadd(7, b + k * NR + 32, 4 * NR);
        _tile_loadd(4, x + k, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, buf, 128);
    _tile_stored(1, buf + 16, 128);
    __mmask16 mask[2];
    for (int v = 0; v < 2; ++v) mask[v] = static_cast<__mmask16>((1u << std::clamp(nc - v * 16, 0, 16)) - 1);
    Vf base[2];
    for (int v = 0; v < 2; ++v) base[v] = first && bias ? _mm512_maskz_loadu_ps(mask[v], bias + v * 16) : vzero();
    for (int m = 0; m < mr; ++m)
      for (int v = 0; v < 2; ++v) {
        float* p = c + m * ldc + v * 16;
        const Vf prev = first ? base[v] : _mm512_maskz_loadu_ps(mask[v], p);
        _mm512_mask_storeu_ps(p, mask[v], vadd(prev, vload(buf + m * 32 + v * 16)));
      }
  }
};
#endif  // AMX

#endif  // __AVX512BF16__

}  // namespace troupe_quant
