// Which thread computes which weight panel of a product (linear.cpp).
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
#include <vector>

namespace tokenmill {

class PanelQueue {
 public:
  // `passes` independent rounds over `panels` panels, each split into `threads` shares.
  PanelQueue(int64_t passes, int threads, int64_t panels)
      : threads_(threads), shares_(static_cast<size_t>(passes * threads)) {
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
  std::vector<Share> shares_;
};

}  // namespace tokenmill
