// A team that stays together for a whole decode step, and parallel(): at::parallel_for, or the team's.
//
// Team: one parallel region around a whole decode step (decoder.cpp). The main thread runs the step's ops
// one after another; each share() it calls is posted to the team's other threads, which spin between
// jobs, instead of opening a region of its own (~1-2 us a region on a 2-core VM; ~120 of them a
// step). A job's chunks are dealt out as one run of consecutive chunks a thread, each taking its own from the
// front; a thread done with its own takes the others' last chunks, one at a time (the first thread is not left
// waiting for the second at the end of fixed halves). A thread's chunks follow one another in memory, so the
// weights it reads are one stream that its prefetches lead (chunks taken in turn from one counter broke the
// streams at every chunk and shared one contended line: a one-row int8 step 1.03-1.06x this way, 8 rows 1.045x).
// Which thread runs a chunk never changes the chunks' bounds. While the main thread runs the small ops (norms,
// rope, attention, the activations' rounding), the other threads read ahead the weights of the next products
// into the caches: a one-row step is bound by reading its weights, and otherwise memory sits idle for that
// part of the step.
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
  void chunks(int64_t self);  // the posted job's chunks: thread self's run from its front, then the others' from their backs
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }

  int64_t ahead_;
  const Products* products_;
  std::vector<int64_t> start_;  // product i's first byte, counted from the first product's
  int64_t helpers_ = 0;
  // the job: posted_ counts jobs; each helper adds to acked_ when it is done with one
  std::atomic<uint64_t> posted_{0}, acked_{0};
  void (*fn_)(const void*, int64_t, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t count_ = 0, grain_ = 1, chunks_ = 0, run_count_ = 0;
  // thread i's run of the job's chunks, [front, back) packed in one word (each on its own line: its owner
  // takes from it alone until it is done)
  struct alignas(64) Run {
    std::atomic<uint64_t> span{0};
  };
  static constexpr int64_t kRuns = 16;  // threads past it take the others' chunks only
  static constexpr int64_t kMaxChunks = int64_t{1} << 31;
  Run runs_[kRuns];
  std::atomic<int64_t> done_{0}, joined_{0};
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
  grain = std::max(grain, (count + kMaxChunks - 1) / kMaxChunks);  // (a run's bounds are 32 bits each)
  count_ = count, grain_ = grain, chunks_ = (count + grain - 1) / grain;
  run_count_ = std::min(helpers_ + 1, kRuns);
  for (int64_t i = 0; i < run_count_; ++i)
    runs_[i].span.store(pack(chunks_ * i / run_count_, chunks_ * (i + 1) / run_count_), std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  failed_.store(false, std::memory_order_relaxed);
  posted_.store(job + 1, std::memory_order_release);
  chunks(0);
  while (done_.load(std::memory_order_acquire) < chunks_) relax();  // (f lives in the caller's frame)
  if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
}

inline void Team::chunks(int64_t self) {
  int64_t ran = 0;
  for (int64_t k = 0; k < run_count_; ++k) {
    const bool own = k == 0 && self < run_count_;  // (a thread past kRuns has none)
    std::atomic<uint64_t>& span = runs_[(self + k) % run_count_].span;
    uint64_t now = span.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(now & 0xffffffffu), back = static_cast<int64_t>(now >> 32);
      if (front >= back) break;
      const int64_t c = own ? front : back - 1;
      if (!span.compare_exchange_weak(now, own ? pack(front + 1, back) : pack(front, back - 1),
                                      std::memory_order_acq_rel, std::memory_order_relaxed))
        continue;  // (now reloaded)
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          fn_(ctx_, c * grain_, std::min(count_, (c + 1) * grain_));
        } catch (...) {
          bool expected = false;
          if (failed_.compare_exchange_strong(expected, true)) error_ = std::current_exception();
        }
      }
      ++ran;
      now = span.load(std::memory_order_relaxed);
    }
  }
  done_.fetch_add(ran, std::memory_order_release);
}

inline void Team::help(bool read_ahead) {
  const int64_t self = 1 + joined_.fetch_add(1, std::memory_order_relaxed);  // (the main thread is 0)
  uint64_t seen = 0;  // jobs done
  int64_t product = 0, range = 0, offset = 0, at = -1;  // the next byte to read: (product, range, offset)
  int64_t pos = 0;  // ... counted from the step's first product
  uint64_t sum = 0;
  const int64_t last = static_cast<int64_t>(products_->size());
  while (!stop_.load(std::memory_order_acquire)) {
    if (posted_.load(std::memory_order_acquire) != seen) {
      ++seen;
      chunks(self);
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

// at::parallel_for(0, count, grain, f), or within a team's step its chunks of `grain` shared out among
// the team's threads (Team::share). (Only where f's bits do not depend on which thread runs which range.)
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
