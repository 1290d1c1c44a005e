// Float32 SIMD helpers for the attention and fused elementwise kernels (one vector type per build).
//
// The build picks the instruction set (troupe/kernels/cpu/build.py): with AVX-512 (`-march=native` on
// such a CPU) a vector is a __m512 of 16 floats, otherwise (the AVX2/FMA/F16C baseline) a __m256 of 8.
// Kernels are written once against `Vec` (load/store from float32, float16 and bfloat16 storage, FMA,
// exp, reductions) and compile to either width. Storage types: float, c10::Half, c10::BFloat16; all
// math is float32. Stores to float16 saturate at +-65504 (a K/V value past the range becomes the largest
// finite half instead of inf, which would turn attention into NaN); stores to bfloat16 round to nearest
// even.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace troupe_vec {

using Half = c10::Half;
using BFloat16 = c10::BFloat16;

constexpr float kHalfMax = 65504.0f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__AVX512F__)
constexpr int W = 16;  // floats per vector
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vload(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf vload(const BFloat16* p) {
  __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
inline void vstore(Half* p, vf v) {
  v = _mm512_min_ps(_mm512_max_ps(v, vset1(-kHalfMax)), vset1(kHalfMax));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void vstore(BFloat16* p, vf v) {
  __m512i x = _mm512_castps_si512(v);  // round to nearest even: add 0x7fff + the lowest kept bit
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  x = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
}
// 2^n for integer-valued n in [-126, 127]
inline vf vpow2i(vf n) {
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vzero_below(vf v, vf x, float lo) {  // v where x >= lo, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(lo), _CMP_GE_OQ), v);
}
// v in lanes [0, k), `fill` in the others (any k: <= 0 fills all, >= W keeps all).
inline vf vkeep_first(vf v, int k, float fill) {
  const __mmask16 keep = k >= 16 ? __mmask16(0xffff) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1);
  return _mm512_mask_mov_ps(vset1(fill), keep, v);
}
// v in lanes [lo, hi), `fill` in the others (any lo, hi).
inline vf vkeep_range(vf v, int lo, int hi, float fill) {
  auto first = [](int k) { return k >= 16 ? __mmask16(0xffff) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1); };
  return _mm512_mask_mov_ps(vset1(fill), __mmask16(first(hi) & ~first(lo)), v);
}
// The two 8-float halves of a vector added: what the 8-lane reductions below take.
inline __m256 vfold8(vf v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
constexpr int W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float vsum(vf v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float vhmax(vf v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline vf vload(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vload(const BFloat16* p) {
  __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
inline void vstore(Half* p, vf v) {
  v = _mm256_min_ps(_mm256_max_ps(v, vset1(-kHalfMax)), vset1(kHalfMax));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void vstore(BFloat16* p, vf v) {
  __m256i x = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  x = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline vf vpow2i(vf n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vzero_below(vf v, vf x, float lo) { return _mm256_and_ps(v, _mm256_cmp_ps(x, vset1(lo), _CMP_GE_OQ)); }
inline __m256 vfold8(vf v) { return v; }
inline vf vkeep_first(vf v, int k, float fill) {
  const vf lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_blendv_ps(vset1(fill), v, _mm256_cmp_ps(lane, vset1(float(k)), _CMP_LT_OQ));
}
inline vf vkeep_range(vf v, int lo, int hi, float fill) {
  const vf lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const vf keep = _mm256_and_ps(_mm256_cmp_ps(lane, vset1(float(lo)), _CMP_GE_OQ),
                                _mm256_cmp_ps(lane, vset1(float(hi)), _CMP_LT_OQ));
  return _mm256_blendv_ps(vset1(fill), v, keep);
}
#endif

// exp(x) in float32 (Cephes' expf polynomial on x - n ln2, scaled by 2^n): about 2 ulp; exp(x) = 0 below
// -87.3 (so exp(-inf) = 0), x is clamped at 88.3 above.
inline vf vexp(vf x) {
  const float lo = -87.33654f;
  vf xc = vmin(vmax(x, vset1(lo)), vset1(88.3762626647949f));
  vf n = vround(vmul(xc, vset1(1.44269504088896341f)));
  vf r = vfnma(n, vset1(0.693359375f), xc);  // x - n ln2, ln2 split in two for precision
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset1(1.0f)));
  return vzero_below(vmul(p, vpow2i(n)), x, lo);
}

// tanh(x) in float32: Eigen's rational approximation (odd degree 13 over even degree 6) on x clamped to
// +-7.9, where tanh is 1 within float32 rounding; at most 3.5e-7 from tanh anywhere (checked against
// float64 on 2e6 points in [-12, 12]).
inline vf vtanh(vf x) {
  const float c = 7.90531110763549805f;
  x = vmin(vmax(x, vset1(-c)), vset1(c));
  const vf x2 = vmul(x, x);
  vf p = vset1(-2.76076847742355e-16f);
  p = vfma(p, x2, vset1(2.00018790482477e-13f));
  p = vfma(p, x2, vset1(-8.60467152213735e-11f));
  p = vfma(p, x2, vset1(5.12229709037114e-08f));
  p = vfma(p, x2, vset1(1.48572235717979e-05f));
  p = vfma(p, x2, vset1(6.37261928875436e-04f));
  p = vfma(p, x2, vset1(4.89352455891786e-03f));
  p = vmul(p, x);
  vf q = vset1(1.19825839466702e-06f);
  q = vfma(q, x2, vset1(1.18534705686654e-04f));
  q = vfma(q, x2, vset1(2.26843463243900e-03f));
  q = vfma(q, x2, vset1(4.89352518554385e-03f));
  return vdiv(p, q);
}

// Logit soft-capping of scores s: cap * tanh(s / cap) (`inv_cap` = 1 / cap).
inline vf vsoftcap(vf s, float cap, float inv_cap) { return vmul(vset1(cap), vtanh(vmul(s, vset1(inv_cap)))); }

// Eight 8-float vectors -> one vector of their eight sums, in order (the dot products of 8 keys).
inline __m256 vsum8x8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  t0 = _mm256_hadd_ps(t0, t1);  // lanes 0-3: sums of a0..a3 (low halves), lanes 4-7: high halves
  t2 = _mm256_hadd_ps(t2, t3);
  __m256 lo = _mm256_permute2f128_ps(t0, t2, 0x20);
  __m256 hi = _mm256_permute2f128_ps(t0, t2, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Transposes an 8x8 float block: rows r[0..7] (8 floats each) -> columns c[0..7].
inline void transpose8x8(const __m256* r, __m256* c) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  c[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  c[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  c[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  c[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  c[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  c[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  c[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  c[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// 8-float loads from any storage type (for head dims that are a multiple of 8 but not of W).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const BFloat16* p) {
  __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

// Scalar conversions for loop tails.
inline float to_f32(float x) { return x; }
inline float to_f32(Half x) { return static_cast<float>(x); }
inline float to_f32(BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline Half from_f32<Half>(float x) { return Half(std::fmin(std::fmax(x, -kHalfMax), kHalfMax)); }
template <>
inline BFloat16 from_f32<BFloat16>(float x) { return BFloat16(x); }  // c10 rounds to nearest even

// n floats of `src` (any storage type) to float32 `dst`; n a multiple of 8.
template <typename T>
inline void convert_row(const T* src, float* dst, int n) {
  int d = 0;
  for (; d + W <= n; d += W) vstore(dst + d, vload(src + d));
  for (; d < n; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

}  // namespace troupe_vec
