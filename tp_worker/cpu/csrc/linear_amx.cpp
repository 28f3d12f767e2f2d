// bfloat16 y = x W^T (+ b) on Intel's AMX tiles (tp_worker, via ctypes; linear.cpp is the
// AVX-512 and portable kernel for the same packed weights).
//
// The rule: every output element is one float32 accumulator in a tile register that takes
// its K products 32 at a time, one TDPBF16PS per 32 k in ascending k, whatever M is, wherever
// the row sits and whichever thread runs it. The rows of a tile never mix (tested: a row's
// result is the same in a tile of 1 row as of 16), so a row's numbers do not depend on its
// company, as with linear.cpp. NOTE: how TDPBF16PS rounds inside one instruction is the
// hardware's own: measured on a Xeon (Emerald Rapids) it matches neither order of
// VDPBF16PS's two roundings nor one rounding of the exact sum. So an AMX machine gives its own
// bits, the same on every AMX CPU that rounds alike, not linear.cpp's; TOKENMILL_CPU_AMX=0
// (cpu/ops.py) runs linear.cpp's kernel there instead.
//
// The weights are linear.cpp's bfloat16 panels, [N/32][K/2][32][2] with K zero-padded to a
// multiple of 32: a panel's 16 pairs of k for 16 output features are one B tile as it stands
// (rows 128 bytes apart), so nothing is repacked.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "bf16.h"
#include "epilogue.h"
#include "kernels.h"
#include "panel_queue.h"

#if defined(TOKENMILL_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(TOKENMILL_AMX)
namespace {

constexpr int NR = 32;        // output features per panel: two tiles of 16
constexpr int TILE_K = 32;    // bfloat16 k per TDPBF16PS
constexpr int BLOCK_M = 32;   // rows per block: two tiles of 16
constexpr int64_t CHUNK_BYTES = 1 << 20;  // of x, staying in L2 while the panels stream past

using tokenmill::configure_tiles;

// Rows of x per chunk: as many whole blocks as keep the chunk within CHUNK_BYTES, the same
// number in every chunk (a short last chunk would stream every panel again for few rows).
int64_t chunk_rows(int64_t m, int64_t k_pad) {
  const int64_t most = std::max<int64_t>(BLOCK_M, CHUNK_BYTES / (k_pad * 2) / BLOCK_M * BLOCK_M);
  const int64_t chunks = (m + most - 1) / most;
  return ((m + chunks - 1) / chunks + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
}

// A block's float32 sums on their way out (epilogue.h's rows: + bias, + residual, or glu):
// written a share at a time while the next block's tiles multiply, so that the tile unit does
// not wait for the epilogue's vector work. Each row is written once, as it would be at once.
template <typename Out>
class PendingRows {
 public:
  PendingRows(Out* out, int64_t ldc, const Out* residual, int glu)
      : out_(out), residual_(residual), ldc_(ldc), glu_(glu) {}

  // The block of rows r0.. (count of them) of panel p, whose sums are in acc.
  void set(const float* acc, int count, int64_t r0, int64_t p, int64_t cols, const float* bias) {
    acc_ = acc, count_ = count, done_ = 0, cols_ = cols, bias_ = bias ? bias + p * NR : nullptr;
    dst_ = out_ + r0 * ldc_ + (glu_ ? p * NR / 2 : p * NR);
    res_ = residual_ ? residual_ + r0 * ldc_ + p * NR : nullptr;
  }
  // The rows up to share / shares of the block.
  void write(int64_t share, int64_t shares) {
    const int upto = static_cast<int>((count_ * share + shares - 1) / shares);
    for (; done_ < upto; ++done_) {
      const float* sums = acc_ + done_ * NR;
      if (glu_) {
        tokenmill::write_glu_row(sums, bias_, dst_ + done_ * ldc_, glu_);
      } else {
        tokenmill::write_row(sums, cols_, bias_, dst_ + done_ * ldc_,
                             res_ ? res_ + done_ * ldc_ : nullptr);
      }
    }
  }
  void finish() { write(1, 1); }

 private:
  Out* out_;
  const Out* residual_;
  int64_t ldc_;
  int glu_;  // NOTE: 0, or silu.h's activation code
  const float* acc_ = nullptr;
  int count_ = 0, done_ = 0;
  int64_t cols_ = 0;
  const float* bias_ = nullptr;
  Out* dst_ = nullptr;
  const Out* res_ = nullptr;
};

// The cache lines of the weights a thread multiplies next that a block of rows asks for, a
// few at each of its steps: each block of a panel asks for its share of the next panel, so
// that the next panel streams in from memory while every block multiplies, not only the last
// (a 64-row decode step's second block of 32 rows ran with memory idle, and the next panel's
// first block then waited on its loads).
struct Ahead {
  const char* first = nullptr;
  int64_t lines = 0, per_step = 0;

  // Block `b` of `blocks` over a panel of `steps` steps, `next` the panel asked for (or null).
  Ahead(const uint16_t* next, int64_t panel_bytes, int64_t b, int64_t blocks, int64_t steps) {
    if (next == nullptr) return;
    const int64_t total = panel_bytes / 64, l0 = total * b / blocks, l1 = total * (b + 1) / blocks;
    first = reinterpret_cast<const char*>(next) + l0 * 64;
    lines = l1 - l0;
    per_step = (lines + steps - 1) / steps;
  }

  void at_step(int64_t step) const {
    const int64_t l1 = std::min(lines, (step + 1) * per_step);
    for (int64_t l = step * per_step; l < l1; ++l) _mm_prefetch(first + l * 64, _MM_HINT_T1);
  }
};

// Tiles 0-3 accumulate, 4-5 hold x, 6-7 weights.
// acc [16 * RB][NR] = a [16 * RB rows, k_pad] . panel, one row tile (RB = 1) or two, while
// `pending` (the block before, if any) is written out and `ahead`'s lines are pulled into L2.
template <int RB, typename Out>
void block(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t k_pad, float* acc,
           const Ahead& ahead, PendingRows<Out>& pending) {
  _tile_zero(0);
  _tile_zero(1);
  if (RB == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t steps = k_pad / TILE_K;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t k0 = step * TILE_K;
    const uint16_t* b = panel + k0 * NR;
    ahead.at_step(step);
    _tile_loadd(6, b, NR * 4);
    _tile_loadd(7, b + 32, NR * 4);
    _tile_loadd(4, a + k0, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RB == 2) {
      _tile_loadd(5, a + 16 * lda + k0, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.write(step + 1, steps);
  }
  pending.finish();
  _tile_stored(0, acc, NR * 4);
  _tile_stored(1, acc + 16, NR * 4);
  if (RB == 2) {
    _tile_stored(2, acc + 16 * NR, NR * 4);
    _tile_stored(3, acc + 16 * NR + 16, NR * 4);
  }
}

// The output (and residual) lines of a block's rows into L2 while its tiles multiply: rows
// ldc apart miss every cache otherwise, and a store that waits for its line stalls the
// epilogue.
template <typename Out>
void prefetch_rows(const Out* first, int rows, int64_t ldc, int64_t cols) {
  const int64_t bytes = cols * static_cast<int64_t>(sizeof(Out));
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + r * ldc) + b, _MM_HINT_T1);
}

// The rows a tile may not read from x in place (past the last whole block, or every row when
// K is not a multiple of 32), copied into rows of k_pad with zeros past k. The tail block's
// rows past m are left as they are: a tile's rows never mix, and those rows' results are
// never written.
class Rows {
 public:
  Rows(const uint16_t* x, int64_t m, int64_t k, int64_t lda, int64_t k_pad)
      : x_(x), lda_(lda), direct_rows_(k % TILE_K == 0 ? m / BLOCK_M * BLOCK_M : 0),
        k_pad_(k_pad) {
    const int64_t rest = m - direct_rows_, padded = (rest + 15) / 16 * 16;
    // NOTE: one buffer per calling thread, kept: a decode step would otherwise allocate
    // one for every layer.
    thread_local std::vector<uint16_t> buffer;
    if (buffer.size() < static_cast<size_t>(padded * k_pad)) buffer.resize(padded * k_pad);
    tail_ = buffer.data();
    for (int64_t r = 0; r < rest; ++r) {
      uint16_t* dst = tail_ + r * k_pad;
      std::memcpy(dst, x + (direct_rows_ + r) * lda, k * 2);
      std::fill(dst + k, dst + k_pad, uint16_t{0});
    }
  }
  const uint16_t* at(int64_t row) const {
    return row < direct_rows_ ? x_ + row * lda_ : tail_ + (row - direct_rows_) * k_pad_;
  }
  int64_t stride(int64_t row) const { return row < direct_rows_ ? lda_ : k_pad_; }

 private:
  const uint16_t* x_;
  int64_t lda_, direct_rows_, k_pad_;
  uint16_t* tail_;
};

template <typename Out>
void linear_amx(const uint16_t* x, int64_t m, int64_t k, int64_t lda, const uint16_t* packed,
                int64_t n, const float* bias, Out* out, int64_t ldc, const Out* residual,
                int glu, const tokenmill::NextProduct& then) {
  const int64_t k_pad = (k + TILE_K - 1) / TILE_K * TILE_K;
  const int64_t num_panels = (n + NR - 1) / NR, panel_elems = k_pad * NR;
  const Rows rows(x, m, k, lda, k_pad);
  const int64_t chunk = chunk_rows(m, k_pad), num_chunks = (m + chunk - 1) / chunk;
  // NOTE: each thread takes its own share of the panels front to back (the same panels from
  // one chunk to the next, as schedule(static) would give it), then the back of another's
  // share that is not done: a thread that the server's other processes preempt no longer
  // holds the other one idle at the region's end (panel_queue.h).
  tokenmill::PanelQueue queue(num_chunks, omp_get_max_threads(), num_panels);
  // NOTE: fewer than 16 rows (a decode step of a few requests): tiles of that many rows,
  // the same bits in fewer cycles (amx.h).
  const int tile_rows = static_cast<int>(std::clamp<int64_t>(m, 1, 16));
#pragma omp parallel
  {
    configure_tiles(tile_rows);
    const int thread = omp_get_thread_num();
    alignas(64) float acc[2][BLOCK_M * NR];
    PendingRows<Out> pending(out, ldc, residual, glu);
    int which = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t c0 = c * chunk, c1 = std::min<int64_t>(m, c0 + chunk);
      for (int64_t p = queue.next(c, thread); p >= 0; p = queue.next(c, thread)) {
        const int64_t col0 = p * NR, cols = std::min<int64_t>(NR, n - col0);
        const uint16_t* panel = packed + p * panel_elems;
        // NOTE: the panel this thread takes next streams in from memory while this one's
        // blocks multiply (a decode step reads every weight once); after its share's last,
        // the first of the product that follows.
        const uint16_t* next = queue.successor(c, thread, p, packed, panel_elems, then);
        const int64_t blocks = (c1 - c0 + BLOCK_M - 1) / BLOCK_M;
        for (int64_t r0 = c0; r0 < c1; r0 += BLOCK_M) {
          const int count = static_cast<int>(std::min<int64_t>(BLOCK_M, m - r0));
          const Ahead ahead(next, panel_elems * 2, (r0 - c0) / BLOCK_M, blocks, k_pad / TILE_K);
          if (glu) {
            prefetch_rows(out + r0 * ldc + p * NR / 2, count, ldc, NR / 2);
          } else {
            prefetch_rows(out + r0 * ldc + col0, count, ldc, cols);
            if (residual) prefetch_rows(residual + r0 * ldc + col0, count, ldc, cols);
          }
          float* sums = acc[which];
          if (count > 16) {
            block<2>(rows.at(r0), rows.stride(r0), panel, k_pad, sums, ahead, pending);
          } else {
            block<1>(rows.at(r0), rows.stride(r0), panel, k_pad, sums, ahead, pending);
          }
          pending.set(sums, count, r0, p, cols, bias);
          which ^= 1;
        }
      }
    }
    pending.finish();
    _tile_release();
  }
}

}  // namespace
#endif

extern "C" {

// Whether this build has the AMX kernel and the kernel may use the tiles: Linux hands a
// process the tile registers' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
int tm_amx_ready() {
#if defined(TOKENMILL_AMX)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const int ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ready;
#else
  return 0;
#endif
}

// tm_linear's bfloat16 cases on AMX tiles (same arguments; dtype must be 1). Returns 0, or -1
// where this build or process has no AMX or the combination is unsupported.
int tm_linear_amx(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed,
                  int64_t n, const float* bias, void* out, int64_t ldc, int dtype, int out_dtype,
                  const void* residual, int glu) {
  return tm_linear_amx_then(x, m, k, lda, packed, n, bias, out, ldc, dtype, out_dtype, residual,
                            glu, nullptr, 0, 0);
}

int tm_linear_amx_then(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed,
                       int64_t n, const float* bias, void* out, int64_t ldc, int dtype,
                       int out_dtype, const void* residual, int glu, const void* then_packed,
                       int64_t then_n, int64_t then_k) {
#if defined(TOKENMILL_AMX)
  if (dtype != 1 || !tm_amx_ready()) return -1;
  if (glu && (n % NR != 0 || residual != nullptr)) return -1;
  const tokenmill::NextProduct then{then_packed, then_n, then_k};
  const auto* xs = static_cast<const uint16_t*>(x);
  const auto* w = static_cast<const uint16_t*>(packed);
  if (out_dtype == 1) {
    linear_amx(xs, m, k, lda, w, n, bias, static_cast<uint16_t*>(out), ldc,
               static_cast<const uint16_t*>(residual), glu, then);
  } else if (out_dtype == 0) {
    linear_amx(xs, m, k, lda, w, n, bias, static_cast<float*>(out), ldc,
               static_cast<const float*>(residual), glu, then);
  } else {
    return -1;
  }
  return 0;
#else
  (void)x, (void)m, (void)k, (void)lda, (void)packed, (void)n, (void)bias, (void)out;
  (void)ldc, (void)dtype, (void)out_dtype, (void)residual, (void)glu;
  (void)then_packed, (void)then_n, (void)then_k;
  return -1;
#endif
}

}  // extern "C"
