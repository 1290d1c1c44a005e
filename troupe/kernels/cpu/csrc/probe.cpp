// What the build targeted: lets tests check that TROUPE_CPU_ISA reached the compiler and that the
// library shares torch's OpenMP threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <string>

namespace {

std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "none";
#endif
}

// Threads an at::parallel_for over 64 items actually used (1 if OpenMP did not reach the build).
int64_t parallel_threads() {
  std::atomic<int64_t> most{0};
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
    int64_t mine = at::get_thread_num() + 1;
    int64_t seen = most.load();
    while (mine > seen && !most.compare_exchange_weak(seen, mine)) {
    }
  });
  return most.load();
}

}  // namespace

TORCH_LIBRARY(troupe_probe, m) {
  m.def("isa() -> str", &isa);
  m.def("parallel_threads() -> int", &parallel_threads);
}
