// The arithmetic peak this CPU gives the kernels' inner instructions (benchmarks/kernels/
// cpu_peak.py): VDPBF16PS (the bfloat16 products: linear layers, attention's q.k) and
// VFMADD231PS (float32 multiply-adds: attention's p.V), each in 12 independent chains per
// thread, and where the CPU has AMX, TDPBF16PS (the AMX kernels' products) on four
// accumulator tiles, so that neither latency nor memory limits it. Not part of the server.
#include <cstdint>

#include <immintrin.h>
#include <omp.h>

#include "../../tp_worker/cpu/csrc/amx.h"

#if defined(TOKENMILL_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int CHAINS = 12;
volatile float g_sink;  // NOTE: the chains' sums land here, so none is dead code

// NOTE: the empty asm makes every chain's start opaque, so the compiler can neither fold
// the chains into one nor drop them.
template <typename Step>
float chains(int64_t iters, Step step) {
  __m512 c[CHAINS];
  for (int i = 0; i < CHAINS; ++i) {
    c[i] = _mm512_set1_ps(static_cast<float>(i));
    __asm__ volatile("" : "+v"(c[i]));
  }
  // NOTE: unrolled, so that the chains live in registers, not on the stack.
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) c[i] = step(c[i]);
  }
  __m512 sum = c[0];
  for (int i = 1; i < CHAINS; ++i) sum = _mm512_add_ps(sum, c[i]);
  return _mm512_reduce_add_ps(sum);
}

#if defined(TOKENMILL_AMX)
// Seconds for `threads` threads to run `iters` rounds of 12 TDPBF16PS each (16 x 16 float32
// sums of 32 bfloat16 products: 16,384 flops), three on each of tiles 0-3 from tiles 4-7
// loaded once; -1 where the process may not use the tiles.
double amx_seconds(int threads, int64_t iters) {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -1.0;
  alignas(64) static const uint16_t ones[16 * 32] = {};
  const double started = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float out[16 * 16];
    tokenmill::configure_tiles();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    for (int64_t n = 0; n < iters; ++n) {
      for (int r = 0; r < 3; ++r) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, out, 64);
    g_sink = out[0];
    _tile_release();
  }
  return omp_get_wtime() - started;
}
#endif

}  // namespace

extern "C" {

// Seconds for `threads` threads to run `iters` rounds of 12 instructions each; kind 0 =
// VDPBF16PS (64 flops an instruction), 1 = VFMADD231PS (32 flops), 2 = TDPBF16PS (16,384
// flops). -1 where this build or process lacks the instruction.
double tm_peak_seconds(int kind, int threads, int64_t iters) {
#if !defined(__AVX512BF16__)
  if (kind == 0) return -1.0;
#endif
  if (kind == 2) {
#if defined(TOKENMILL_AMX)
    return amx_seconds(threads, iters);
#else
    return -1.0;
#endif
  }
  float sink = 0.0f;
  const double started = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-30f);
    __asm__ volatile("" : "+v"(a), "+v"(b));
    if (kind == 1) {
      sink += chains(iters, [&](__m512 c) { return _mm512_fmadd_ps(a, b, c); });
#if defined(__AVX512BF16__)
    } else {
      const __m512bh ah = (__m512bh)_mm512_set1_epi32(0x3f803f80);
      const __m512bh bh = (__m512bh)_mm512_set1_epi32(0x3f803f80);
      sink += chains(iters, [&](__m512 c) { return _mm512_dpbf16_ps(c, ah, bh); });
#endif
    }
  }
  const double seconds = omp_get_wtime() - started;
  g_sink = sink;
  return seconds;
}
}
