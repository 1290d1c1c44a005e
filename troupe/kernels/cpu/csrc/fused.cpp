// Fused per-layer elementwise ops (TORCH_LIBRARY troupe_fused): RMSNorm, residual add + RMSNorm in place,
// SiLU x up, and rotary + the KV write. Float32 math on float32 or bfloat16 tensors (the model's dtype);
// the KV pool may also be float16. Rows go to torch's threads when a call has enough work to pay for a
// parallel region (`kGrain` elements per thread at least), otherwise the calling thread does it all.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "vec_attn.h"

namespace troupe_fused {
namespace {

using namespace troupe_vec;

constexpr int64_t kGrain = 32768;
constexpr int64_t kMaxHeadDim = 256;  // elements: below this a call stays on one thread

int64_t rows_grain(int64_t per_row) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, per_row)); }

template <typename T>
float sum_squares(const T* x, int64_t n) {
  vf acc = vzero();
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    const vf v = vload(x + d);
    acc = vfma(v, v, acc);
  }
  float ss = vsum(acc);
  for (; d < n; ++d) ss += to_f32(x[d]) * to_f32(x[d]);
  return ss;
}

// out[d] = x[d] * inv * w[d]
template <typename T>
void scale_row(const T* x, const T* w, float inv, int64_t n, T* out) {
  const vf iv = vset1(inv);
  int64_t d = 0;
  for (; d + W <= n; d += W) vstore(out + d, vmul(vmul(vload(x + d), iv), vload(w + d)));
  for (; d < n; ++d) out[d] = from_f32<T>(to_f32(x[d]) * inv * to_f32(w[d]));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": x must be (T, h) with a contiguous last dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              what, ": weight must be (h,) in x's dtype");
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& out) {
  const int64_t T_ = x.size(0), h = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, T_, rows_grain(h), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float inv = 1.0f / std::sqrt(sum_squares(xp + t * xs, h) / float(h) + float(eps));
      scale_row(xp + t * xs, wp, inv, h, op + t * os);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, w, eps, out);
  } else {
    rms_norm_impl<BFloat16>(x, w, eps, out);
  }
  return out;
}

// residual += x; x = rms_norm(residual) * w (both in place)
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  const int64_t T_ = x.size(0), h = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  T* xp = static_cast<T*>(x.data_ptr());
  T* rp = static_cast<T*>(residual.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  at::parallel_for(0, T_, rows_grain(h), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      T* xr = xp + t * xs;
      T* rr = rp + t * rs;
      int64_t d = 0;
      for (; d + W <= h; d += W) vstore(rr + d, vadd(vload(rr + d), vload(xr + d)));
      for (; d < h; ++d) rr[d] = from_f32<T>(to_f32(rr[d]) + to_f32(xr[d]));
      const float inv = 1.0f / std::sqrt(sum_squares(rr, h) / float(h) + float(eps));
      scale_row(rr, wp, inv, h, xr);
    }
  });
}

void add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be like x");
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x, residual, w, eps);
  } else {
    add_rms_norm_impl<BFloat16>(x, residual, w, eps);
  }
}

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, const at::Tensor& out) {
  const int64_t T_ = x.size(0), f = out.size(1), xs = x.stride(0);
  const T* xp = static_cast<const T*>(x.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, T_, rows_grain(f), [&](int64_t b, int64_t e) {
    const vf one = vset1(1.0f), zero = vzero();
    for (int64_t t = b; t < e; ++t) {
      const T* gate = xp + t * xs;
      const T* up = gate + f;
      T* o = op + t * f;
      int64_t j = 0;
      for (; j + W <= f; j += W) {
        const vf g = vload(gate + j);
        const vf sig = vdiv(one, vadd(one, vexp(vsub(zero, g))));
        vstore(o + j, vmul(vmul(g, sig), vload(up + j)));
      }
      for (; j < f; ++j) {
        const float g = to_f32(gate[j]);
        o[j] = from_f32<T>(g / (1.0f + std::exp(-g)) * to_f32(up[j]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be (T, 2f) with a contiguous last dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "silu_and_mul: float32 or bfloat16");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(x, out);
  } else {
    silu_and_mul_impl<BFloat16>(x, out);
  }
  return out;
}

// Rotate-half rotary of one head row x (D) in place from cos | sin (D/2 each).
template <typename T>
inline void rotate_row(T* x, const float* cs, int64_t D) {
  const int64_t half = D / 2;
  const float* sn = cs + half;
  int64_t d = 0;
  for (; d + W <= half; d += W) {
    const vf c = vload(cs + d), s = vload(sn + d), x1 = vload(x + d), x2 = vload(x + half + d);
    vstore(x + d, vfnma(x2, s, vmul(x1, c)));
    vstore(x + half + d, vfma(x1, s, vmul(x2, c)));
  }
  for (; d < half; ++d) {
    const float x1 = to_f32(x[d]), x2 = to_f32(x[half + d]);
    x[d] = from_f32<T>(x1 * cs[d] - x2 * sn[d]);
    x[half + d] = from_f32<T>(x2 * cs[d] + x1 * sn[d]);
  }
}

template <typename T, typename KT>
void copy_row(const T* src, int64_t D, KT* dst) {
  int64_t d = 0;
  for (; d + W <= D; d += W) vstore(dst + d, vload(src + d));
  for (; d < D; ++d) dst[d] = from_f32<KT>(to_f32(src[d]));
}

template <typename T, typename KT>
void rope_and_cache_impl(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& rope, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const at::Tensor& slots) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), BS = v_pool.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* table = rope.data_ptr<float>();
  T* qp = static_cast<T*>(q.data_ptr());
  T* kp = static_cast<T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  KT* kc = static_cast<KT*>(k_pool.data_ptr());
  KT* vc = static_cast<KT*>(v_pool.data_ptr());
  at::parallel_for(0, T_, rows_grain((H + 2 * KVH) * D), [&](int64_t b, int64_t e) {
    KT krow[kMaxHeadDim];
    for (int64_t t = b; t < e; ++t) {
      const float* cs = table + pos[t] * D;
      for (int64_t i = 0; i < H; ++i) rotate_row<T>(qp + t * q.stride(0) + i * q.stride(1), cs, D);
      const int64_t s = slot[t], blk = s / BS, off = s % BS;
      for (int64_t i = 0; i < KVH; ++i) {
        T* x = kp + t * k.stride(0) + i * k.stride(1);
        rotate_row<T>(x, cs, D);
        if (s < 0) continue;
        // K is stored transposed per block: (D, BS) for this kv head; the rotated k as stored in x
        copy_row<T, KT>(x, D, krow);
        KT* kdst = kc + (blk * KVH + i) * D * BS + off;
        for (int64_t d = 0; d < D; ++d) kdst[d * BS] = krow[d];
        copy_row<T, KT>(vp + t * v.stride(0) + i * v.stride(1), D, vc + ((blk * KVH + i) * BS + off) * D);
      }
    }
  });
}

void rope_and_cache(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& rope, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "rope_and_cache: q, k, v must be (T, heads, D) with a contiguous last dim");
  const int64_t T_ = q.size(0), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(0) == T_ && v.sizes() == k.sizes() && k.size(2) == D && D % 2 == 0,
              "rope_and_cache: q (T, H, D), k and v (T, KVH, D), D even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && v.scalar_type() == k.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "rope_and_cache: q, k, v float32 or bfloat16, alike");
  TORCH_CHECK(rope.dim() == 2 && rope.size(1) == D && rope.is_contiguous() && rope.scalar_type() == at::kFloat,
              "rope_and_cache: the rotary table must be (max_pos, D) float32");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.scalar_type() == v_pool.scalar_type() && v_pool.size(1) == KVH && v_pool.size(3) == D &&
                  k_pool.size(0) == v_pool.size(0) && k_pool.size(1) == KVH && k_pool.size(2) == D &&
                  k_pool.size(3) == v_pool.size(2),
              "rope_and_cache: pools must be K (num_blocks, KVH, D, block_size) and V (num_blocks, KVH, block_size, D), "
              "contiguous, of one dtype");
  TORCH_CHECK(D <= kMaxHeadDim, "rope_and_cache: head dim up to ", kMaxHeadDim);
  TORCH_CHECK(positions.numel() == T_ && slot_mapping.numel() == T_ && positions.scalar_type() == at::kLong &&
                  slot_mapping.scalar_type() == at::kLong && positions.is_contiguous() && slot_mapping.is_contiguous(),
              "rope_and_cache: positions and slot_mapping must be (T,) contiguous int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t slots = v_pool.size(0) * v_pool.size(2);
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < rope.size(0), "rope_and_cache: position ", pos[t], " outside the table");
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "rope_and_cache: slot ", slot[t], " outside the pool");
  }
  const bool f32 = q.scalar_type() == at::kFloat;
  switch (k_pool.scalar_type()) {
    case at::kFloat:
      f32 ? rope_and_cache_impl<float, float>(positions, q, k, v, rope, k_pool, v_pool, slot_mapping)
          : rope_and_cache_impl<BFloat16, float>(positions, q, k, v, rope, k_pool, v_pool, slot_mapping);
      break;
    case at::kHalf:
      f32 ? rope_and_cache_impl<float, Half>(positions, q, k, v, rope, k_pool, v_pool, slot_mapping)
          : rope_and_cache_impl<BFloat16, Half>(positions, q, k, v, rope, k_pool, v_pool, slot_mapping);
      break;
    case at::kBFloat16:
      f32 ? rope_and_cache_impl<float, BFloat16>(positions, q, k, v, rope, k_pool, v_pool, slot_mapping)
          : rope_and_cache_impl<BFloat16, BFloat16>(positions, q, k, v, rope, k_pool, v_pool, slot_mapping);
      break;
    default:
      TORCH_CHECK(false, "rope_and_cache: the pool must be float32, float16 or bfloat16");
  }
}

}  // namespace
}  // namespace troupe_fused

TORCH_LIBRARY(troupe_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &troupe_fused::rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()", &troupe_fused::add_rms_norm_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &troupe_fused::silu_and_mul);
  m.def("rope_and_cache(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor rope, Tensor(c!) k_pool, "
        "Tensor(d!) v_pool, Tensor slot_mapping) -> ()",
        &troupe_fused::rope_and_cache);
}
