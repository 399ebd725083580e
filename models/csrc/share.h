// A team that stays together for a whole decode step, and parallel(): at::parallel_for, or the team's.
//
// Team: one parallel region around a whole decode step (decoder.cpp). The main thread runs the step's ops
// one after another; each share() it calls is posted to the team's other threads, which spin between
// jobs, instead of opening a region of its own (~1-2 us a region on a 2-core VM; ~120 of them a
// step), its chunks taken in turn (the first thread is not left waiting for the second at the end of fixed
// halves). While the main thread runs the small ops (norms, rope, attention, the activations' rounding),
// the other threads read ahead the weights of the next products into the caches: a one-row step is
// bound by reading its weights, and otherwise memory sits idle for that part of the step.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tercet {

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class Team {
 public:
  struct Bytes {  // a range the products will read
    const uint8_t* data;
    int64_t size;
  };

  using Products = std::vector<std::vector<Bytes>>;  // each product's weights, in the order the step multiplies

  // `ahead`: bytes the helpers read past the product the main thread is at (`products` outlives the team)
  Team(const Products* products, int64_t ahead) : ahead_(ahead), products_(products) {
    int64_t total = 0;
    for (const auto& ranges : *products) {
      start_.push_back(total);
      for (const Bytes& b : ranges) total += b.size;
    }
    start_.push_back(total);
  }

  // The step (the main thread, `step()`) and `threads` - 1 helpers in one parallel region; every
  // share() the main thread calls meanwhile is this team's. Without helpers, step() alone.
  template <typename Step>
  void run(int64_t threads, const Step& step);

  int64_t threads() const { return helpers_ + 1; }

  // the main thread is at product i (the helpers read ahead from product i + 1)
  void at_product(int64_t i) { at_.store(i, std::memory_order_release); }

  // main thread: f over chunks of [0, count) with the helpers
  template <typename F>
  void share(int64_t count, int64_t grain, const F& f);

  static Team*& current() {  // the team of the calling thread's step, if any
    static thread_local Team* team = nullptr;
    return team;
  }

 private:
  void help(bool read_ahead);
  void chunks();  // the posted job's chunks, as many as this thread gets

  int64_t ahead_;
  const Products* products_;
  std::vector<int64_t> start_;  // product i's first byte, counted from the first product's
  int64_t helpers_ = 0;
  // the job: posted_ counts jobs; each helper adds to acked_ when it is done with one
  std::atomic<uint64_t> posted_{0}, acked_{0};
  void (*fn_)(const void*, int64_t, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t count_ = 0, grain_ = 1, chunks_ = 0;
  std::atomic<int64_t> next_{0}, done_{0};
  std::exception_ptr error_;  // the job's first (set by the thread that sets failed_)
  std::atomic<bool> failed_{false}, stop_{false};
  std::atomic<int64_t> at_{-1};
};

template <typename F>
void Team::share(int64_t count, int64_t grain, const F& f) {
  // every helper done with the last job (they never touch a job's fields while it is theirs)
  const uint64_t job = posted_.load(std::memory_order_relaxed);
  while (acked_.load(std::memory_order_acquire) != job * static_cast<uint64_t>(helpers_)) relax();
  fn_ = [](const void* ctx, int64_t begin, int64_t end) { (*static_cast<const F*>(ctx))(begin, end); };
  ctx_ = &f;
  count_ = count, grain_ = grain, chunks_ = (count + grain - 1) / grain;
  next_.store(0, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  failed_.store(false, std::memory_order_relaxed);
  posted_.store(job + 1, std::memory_order_release);
  chunks();
  while (done_.load(std::memory_order_acquire) < chunks_) relax();  // (f lives in the caller's frame)
  if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
}

inline void Team::chunks() {
  for (int64_t c = next_++; c < chunks_; c = next_++) {
    if (!failed_.load(std::memory_order_relaxed)) {
      try {
        fn_(ctx_, c * grain_, std::min(count_, (c + 1) * grain_));
      } catch (...) {
        bool expected = false;
        if (failed_.compare_exchange_strong(expected, true)) error_ = std::current_exception();
      }
    }
    done_.fetch_add(1, std::memory_order_release);
  }
}

inline void Team::help(bool read_ahead) {
  uint64_t seen = 0;  // jobs done
  int64_t product = 0, range = 0, offset = 0, at = -1;  // the next byte to read: (product, range, offset)
  int64_t pos = 0;  // ... counted from the step's first product
  uint64_t sum = 0;
  const int64_t last = static_cast<int64_t>(products_->size());
  while (!stop_.load(std::memory_order_acquire)) {
    if (posted_.load(std::memory_order_acquire) != seen) {
      ++seen;
      chunks();
      acked_.fetch_add(1, std::memory_order_release);
      continue;
    }
    const int64_t now = at_.load(std::memory_order_acquire);
    if (now != at) {  // the main thread moved on: read from the product after it, if not there yet
      at = now;
      if (product <= now) product = now + 1, range = 0, offset = 0, pos = start_[std::min(product, last)];
    }
    if (!read_ahead || product >= last || pos - start_[std::min(at + 1, last)] >= ahead_) {
      relax();
      continue;
    }
    const auto& ranges = (*products_)[product];
    if (range >= static_cast<int64_t>(ranges.size())) {
      ++product, range = 0, offset = 0;
      continue;
    }
    const Bytes& bytes = ranges[range];
    const int64_t end = std::min(bytes.size, offset + 4096);  // then look for a job again
    for (int64_t o = offset; o < end; o += 64) sum += bytes.data[o];
    pos += end - offset;
    offset = end;
    if (offset >= bytes.size) ++range, offset = 0;
  }
  asm volatile("" : : "r"(sum));  // (the reads are what counts)
}

template <typename Step>
void Team::run(int64_t threads, const Step& step) {
  if (threads <= 1 || at::in_parallel_region()) {
    step();
    return;
  }
  std::exception_ptr error;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    if (begin != 0) {
      help(at::get_thread_num() == 1);  // (one helper reads ahead: the others would read the same bytes)
      return;
    }
    // this thread's share of [0, threads) tells how many threads the region has (ATen's chunks)
    helpers_ = (threads + (end - begin) - 1) / (end - begin) - 1;
    Team*& current = Team::current();
    Team* outer = current;
    current = this;
    try {
      step();
    } catch (...) {
      error = std::current_exception();
    }
    current = outer;
    stop_.store(true, std::memory_order_release);
  });
  if (error) std::rethrow_exception(error);
}

// at::parallel_for(0, count, grain, f), or within a team's step its chunks of `grain` taken in turn by
// the team's threads. (Only where f's bits do not depend on which thread runs which range.)
template <typename F>
void parallel(int64_t count, int64_t grain, const F& f) {
  if (count <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (Team* team = Team::current(); team != nullptr && count > grain) {
    team->share(count, grain, f);
    return;
  }
  at::parallel_for(0, count, grain, f);
}

}  // namespace tercet
