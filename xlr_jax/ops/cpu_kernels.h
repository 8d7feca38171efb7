// What the CPU kernels (paged_attention.cc, linear.cc) share: 16-float vectors and a
// task loop over XLA's intra-op threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace xlr {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

inline float hsum(vf v) {
  v += __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

struct Progress {  // shared with helper tasks that may start after the call returned
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// run(t) for t in [0, tasks) on this thread and XLA's intra-op threads; returns when
// every task is done. Helpers take tasks while this thread does too; one that starts
// after every task is taken returns at once (it touches only `progress`, which it
// co-owns), so `run` may go out of scope when this returns.
template <typename Run>
void run_tasks(xla::ffi::ThreadPool& pool, int64_t tasks, const Run& run) {
  auto progress = std::make_shared<Progress>();
  auto work = [&run, tasks](Progress* state) {
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      run(t);
      state->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([progress, work] { work(progress.get()); });
  work(progress.get());
  while (progress->done.load() < tasks) std::this_thread::yield();
}

}  // namespace xlr
