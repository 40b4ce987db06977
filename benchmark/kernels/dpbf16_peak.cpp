// Peak VDPBF16PS throughput of this CPU: NCH independent accumulator chains per thread, no
// loads in the loop, one OpenMP thread per core. Prints G instructions/s and GMAC/s (one zmm
// VDPBF16PS = 16 lanes x 2 bf16 products). Built and run by dpbf16_peak.py.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

template <int NCH>
static float run(long iters) {
  __m512 acc[NCH];
  for (int c = 0; c < NCH; ++c) acc[c] = _mm512_set1_ps(float(c));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1.0, 1.0) bf16 pairs
  __m512bh b = (__m512bh)_mm512_set1_epi32(0x00010001);        // tiny: sums stay finite
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 32
    for (int c = 0; c < NCH; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 s = acc[0];
  for (int c = 1; c < NCH; ++c) s = _mm512_add_ps(s, acc[c]);
  return _mm512_reduce_add_ps(s);
}

template <int NCH>
static void measure(int threads, long iters) {
  float sink = 0.f;
  auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  sink += run<NCH>(iters);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double ginst = double(iters) * NCH * threads / s / 1e9;
  std::printf("{\"chains\": %d, \"threads\": %d, \"g_inst_per_s\": %.2f, \"gmac_per_s\": %.1f, "
              "\"sink\": %g}\n", NCH, threads, ginst, ginst * 32, double(sink) * 0);
}

int main(int argc, char** argv) {
  const long iters = argc > 1 ? std::atol(argv[1]) : 200000000L;
  const int cores = omp_get_num_procs();
  for (int t : {1, cores}) {
    measure<8>(t, iters);
    measure<16>(t, iters);
    measure<24>(t, iters);
  }
  return 0;
}
