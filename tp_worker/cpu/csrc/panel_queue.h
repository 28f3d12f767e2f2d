// Which thread computes which weight panel of a product (linear.cpp, linear_amx.cpp), and
// which panel it streams in while it computes one.
//
// Each thread owns the contiguous share of the panels that schedule(static) would give it and
// takes it front to back, so that its weights stream from memory in order; a thread whose
// share is done takes panels from the back of another thread's share instead of waiting at the
// region's end. On two cores that share them with the server's other processes, a model thread
// that one of them preempts no longer holds the other idle at the barrier for the rest of its
// share (with a static schedule, each of their CPU seconds cost the model up to two).
//
// Changes no result: a panel's outputs are computed by one microkernel call per row block with
// the reduction order linear.cpp fixes, whichever thread makes that call.

#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace tokenmill {

// The product that runs next on the same threads (layer_stack.cpp chains a layer's four), so
// that a thread streams in its first panel of it under its last panel of this one: at one
// decode row a thread's share of a product is a few panels, and the first of each came from
// memory with nothing asked ahead. A null `packed`: none known.
struct NextProduct {
  const void* packed;
  int64_t n, k;

  // Thread t's first panel of it (the front of the share PanelQueue gives t), or null: T is
  // the weights' element, laid out as linear.cpp packs them (panels of 32 features, bfloat16
  // K padded to a multiple of 32).
  template <typename T>
  const T* first_panel(int t, int threads) const {
    if (packed == nullptr) return nullptr;
    constexpr int64_t NR = 32;
    const int64_t panels = (n + NR - 1) / NR;
    const int64_t depth = std::is_same<T, float>::value ? k : (k + 31) / 32 * 32;
    return static_cast<const T*>(packed) + panels * t / threads * depth * NR;
  }
};

class PanelQueue {
 public:
  // `passes` independent rounds over `panels` panels, each split into `threads` shares.
  PanelQueue(int64_t passes, int threads, int64_t panels)
      : threads_(threads), passes_(passes), panels_(panels),
        shares_(static_cast<size_t>(passes * threads)) {
    for (int64_t pass = 0; pass < passes; ++pass)
      for (int t = 0; t < threads; ++t) {
        const uint64_t first = panels * t / threads, end = panels * (t + 1) / threads;
        shares_[pass * threads + t].range.store(first << 32 | end, std::memory_order_relaxed);
      }
  }

  // The next panel of `pass` for thread `t` (its own first, then another's), or -1 when none
  // is left. A thread id past the shares (a region with more threads than planned) only takes
  // from others; shares whose threads never came are taken by the ones that did.
  int64_t next(int64_t pass, int t) {
    Share* shares = &shares_[pass * threads_];
    if (t < threads_) {
      const int64_t own = take_front(shares[t]);
      if (own >= 0) return own;
    }
    for (int i = 1; i <= threads_; ++i) {
      const int64_t stolen = take_back(shares[(t + i) % threads_]);
      if (stolen >= 0) return stolen;
    }
    return -1;
  }

  // Where thread t's weights stream on after panel p of `pass`, to be asked for under p: the
  // panel it most likely takes next (the next of its own share, its first of the next pass,
  // after its last its first of `then`), or null after a panel taken from another's share.
  // T: the packed weights' element, `panel_elems` a panel's.
  template <typename T>
  const T* successor(int64_t pass, int t, int64_t p, const T* packed, int64_t panel_elems,
                     const NextProduct& then) const {
    if (t >= threads_) return nullptr;
    const int64_t first = panels_ * t / threads_, end = panels_ * (t + 1) / threads_;
    if (p < first || p >= end) return nullptr;
    if (p + 1 < end) return packed + (p + 1) * panel_elems;
    if (pass + 1 < passes_) return packed + first * panel_elems;
    return then.first_panel<T>(t, threads_);
  }

 private:
  // [first, end) packed in one word, so that its owner and a thief never take the same panel.
  struct alignas(64) Share {
    std::atomic<uint64_t> range{0};
  };

  static int64_t take_front(Share& share) {
    uint64_t r = share.range.load(std::memory_order_relaxed);
    while ((r >> 32) < (r & 0xffffffffu))
      if (share.range.compare_exchange_weak(r, r + (uint64_t{1} << 32), std::memory_order_relaxed))
        return static_cast<int64_t>(r >> 32);
    return -1;
  }

  static int64_t take_back(Share& share) {
    uint64_t r = share.range.load(std::memory_order_relaxed);
    while ((r >> 32) < (r & 0xffffffffu))
      if (share.range.compare_exchange_weak(r, r - 1, std::memory_order_relaxed))
        return static_cast<int64_t>(r & 0xffffffffu) - 1;
    return -1;
  }

  int threads_;
  int64_t passes_, panels_;
  std::vector<Share> shares_;
};

}  // namespace tokenmill
