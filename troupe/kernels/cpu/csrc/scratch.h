// A thread's scratch for the GEMMs (panel_gemm.h, q8_gemm.h): one 64-byte aligned buffer per thread that
// lives as long as the thread and only grows, so a call neither allocates nor page-faults (a fresh
// allocation of a tile's size is an mmap whose faults cost as much as unpacking a small tile). One call
// uses it at a time: the kernels that take it do not call each other.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace troupe_quant {

// At least `bytes` of this thread's scratch (its contents are whatever the last call left).
inline uint8_t* thread_scratch(size_t bytes) {
  struct Buffer {
    uint8_t* p = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer buf;
  if (buf.size < bytes) {
    std::free(buf.p);
    buf.size = (bytes + 63) / 64 * 64;
    buf.p = static_cast<uint8_t*>(std::aligned_alloc(64, buf.size));
    if (buf.p == nullptr) buf.size = 0;
    TORCH_CHECK(buf.p != nullptr, "troupe_qmm: out of memory");
  }
  return buf.p;
}

}  // namespace troupe_quant
