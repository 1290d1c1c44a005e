// The panel path (moderate and large M): out (M, N) = x (M, K) @ W^T (+ bias), W (N, K) GGUF blocks,
// BLIS-style: weight panels decoded once per call into a packed layout, MR x NR outer-product register
// tiles over them (the layouts and micro-kernels: panel_pack.h).
//
// Threads (`at::parallel_for`, torch's pool) take tiles of consecutive weight rows. Rows of x go in blocks
// of at most MR, as even as possible (13 rows: 7 + 6, not 12 + 1: a block of a few rows has too few
// independent FMA chains). Two schedules:
// - large M (PanelT): a tile of up to ~512 KiB of packed panels (L2) is decoded first; then for each
//   block of rows of x and each KC-long slice of K (the x block and a panel slice within L1-L2 reach), the
//   micro-kernel runs over every panel of the tile. x streams once per tile.
// - M <= L4_MAX_M with AVX-512 (PanelL4, cheaper to pack): a tile is 32 rows; each panel's KC slice is
//   packed into L1 and every row of x runs against it at once.
// A later K slice adds into out; the first adds the bias.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "panel_pack.h"
#include "quant.h"
#include "scratch.h"

namespace troupe_quant {

constexpr int64_t PANEL_KC = 576;  // k per slice: the default model's K = 576 whole, 1536 in three
#if defined(__AVX512F__)
constexpr int64_t L4_MAX_M = 64;  // measured: PanelL4 ahead up to here, level at 96, PanelT ahead from 128
#endif

template <class L, int mr>
inline void micro_any(int mr_rt, const typename L::XT* x, int64_t ldx, const typename L::PT* b, int64_t kc, float* c,
                      int64_t ldc, int nc, const float* bias, bool first) {
  if constexpr (mr > 1) {
    if (mr_rt < mr) return micro_any<L, mr - 1>(mr_rt, x, ldx, b, kc, c, ldc, nc, bias, first);
  }
  L::template micro<mr>(x, ldx, b, kc, c, ldc, nc, bias, first);
}

// Blocks of rows of x: `count` blocks, the first `extra` of them one row longer than `base`.
struct RowBlocks {
  int64_t count, base, extra;
  template <int MR>
  static RowBlocks of(int64_t M) {
    const int64_t count = (M + MR - 1) / MR;
    return {count, M / count, M % count};
  }
  int size(int64_t i) const { return static_cast<int>(base + (i < extra ? 1 : 0)); }
};

// Tiles of whole panels, each thread's share equal to a panel: `count` tiles (a multiple of the thread
// count, at least two per thread), tile t = panels [t * panels / count, (t + 1) * panels / count).
struct Tiles {
  int64_t panels, count, max_panels;
  int64_t begin(int64_t t) const { return t * panels / count; }
  // per_tile: the panels a tile should hold at most (its cache budget)
  static Tiles of(int64_t panels, int64_t per_tile) {
    const int64_t threads = std::max(1, at::get_num_threads());
    int64_t count = std::max<int64_t>(2 * threads, (panels + per_tile - 1) / per_tile);
    count = std::min(std::max<int64_t>(1, panels), (count + threads - 1) / threads * threads);
    return {panels, count, (panels + count - 1) / count};
  }
};

// Panels per tile: the fused schedule 32 weight rows; the large-M one as many as fit ~512 KiB.
template <class L>
int64_t tile_panels(bool fused, int64_t K) {
  if (fused) return std::max(1, 32 / L::NR);
  return std::max<int64_t>(1, (int64_t{1} << 19) / (static_cast<int64_t>(sizeof(typename L::PT)) * K * L::NR));
}

// A thread's share: tiles [t0, t1); `fused`: pack each panel's K slice just before using it.
template <class L, int Q>
void panel_tiles(const typename L::XT* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                 const float* bias, const Tiles& tiles, bool fused, int64_t t0, int64_t t1) {
  using F = Fmt<Q>;
  const RowBlocks rb = RowBlocks::of<L::MR>(M);
  const int64_t KC = std::max<int64_t>(F::QK, PANEL_KC / F::QK * F::QK);
  // the panels (a tile, or one K slice), then the stage 1 KiB further (off the panels' 4 KiB alignment)
  using PT = typename L::PT;
  const size_t panel_bytes = sizeof(PT) * static_cast<size_t>(fused ? KC * L::NR : tiles.max_panels * L::NR * K);
  uint8_t* scratch = thread_scratch((panel_bytes + 63) / 64 * 64 + 1024 + sizeof(float) * L::STAGE * F::QK);
  PT* packed = reinterpret_cast<PT*>(scratch);
  float* stage = reinterpret_cast<float*>(scratch + (panel_bytes + 63) / 64 * 64 + 1024);
  // the rows of the panel after the one at row n that this thread packs next (none past its share: another
  // thread streams those)
  const int64_t rows_end = std::min<int64_t>(tiles.begin(t1) * L::NR, N);
  auto next_rows = [&](int64_t n) { return static_cast<int>(std::clamp<int64_t>(rows_end - (n + L::NR), 0, L::NR)); };
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = tiles.begin(t) * L::NR, nt = std::min<int64_t>(tiles.begin(t + 1) * L::NR, N) - n0;
    const int64_t np = (nt + L::NR - 1) / L::NR;
    if (fused) {
      for (int64_t p = 0; p < np; ++p) {
        const int nr = static_cast<int>(std::min<int64_t>(L::NR, nt - p * L::NR));
        const int64_t n = n0 + p * L::NR;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min<int64_t>(KC, K - k0);
          L::template pack<Q>(w + n * row_bytes + k0 / F::QK * F::BYTES, row_bytes, kc, nr, stage, packed, next_rows(n));
          for (int64_t i = 0, m0 = 0; i < rb.count; m0 += rb.size(i), ++i)
            micro_any<L, L::MR>(rb.size(i), x + m0 * K + k0, K, packed, kc, out + m0 * N + n, N, nr,
                                bias ? bias + n : nullptr, k0 == 0);
        }
      }
      continue;
    }
    for (int64_t p = 0; p < np; ++p) {
      const int nr = static_cast<int>(std::min<int64_t>(L::NR, nt - p * L::NR));
      L::template pack<Q>(w + (n0 + p * L::NR) * row_bytes, row_bytes, K, nr, stage, packed + p * K * L::NR,
                          next_rows(n0 + p * L::NR));
    }
    for (int64_t i = 0, m0 = 0; i < rb.count; m0 += rb.size(i), ++i) {
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min<int64_t>(KC, K - k0);
        for (int64_t p = 0; p < np; ++p) {
          const int nc = static_cast<int>(std::min<int64_t>(L::NR, nt - p * L::NR));
          const int64_t n = n0 + p * L::NR;
          micro_any<L, L::MR>(rb.size(i), x + m0 * K + k0, K, packed + p * K * L::NR + k0 * L::NR, kc,
                              out + m0 * N + n, N, nc, bias ? bias + n : nullptr, k0 == 0);
        }
      }
    }
  }
}

template <class L, int Q>
void panel_run(const typename L::XT* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
               const float* bias, bool fused) {
  const Tiles tiles = Tiles::of((N + L::NR - 1) / L::NR, tile_panels<L>(fused, K));
  at::parallel_for(0, tiles.count, 1, [&](int64_t t0, int64_t t1) {
    panel_tiles<L, Q>(x, M, K, w, row_bytes, N, out, bias, tiles, fused, t0, t1);
  });
}

template <int Q>
void gemm_panel_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                     const float* bias) {
#if defined(__AVX512F__)
  if (M <= L4_MAX_M) return panel_run<PanelL4, Q>(x, M, K, w, row_bytes, N, out, bias, true);
#endif
  panel_run<PanelT, Q>(x, M, K, w, row_bytes, N, out, bias, false);
}

}  // namespace troupe_quant
