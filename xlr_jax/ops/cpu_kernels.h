// What the CPU kernels (paged_attention.cc, linear.cc, quantized_linear.cc) share:
// vectors as wide as the target's registers, a task loop over a pool of threads, and
// their entry points, which ffi_bindings.cc binds to XLA's FFI (XLA's intra-op threads as
// the pool). Only that file includes XLA's header: parsing it takes 1.7 s of every file
// that does.
//
// The width is the compiler's choice from the target it builds for (-march): 16 floats
// with AVX-512, 8 with AVX/AVX2, 4 elsewhere (SSE2, NEON, or scalar code where the target
// has no vectors). Everything is GCC/Clang vector extensions: no intrinsics and no inline
// asm, so one source builds for any target either compiler supports.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

namespace xlr {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
#elif defined(__aarch64__)
constexpr int kLanes = 4;
constexpr int kRegisters = 32;
#else
constexpr int kLanes = 4;
constexpr int kRegisters = 16;
#endif

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

// f in every lane. (Not vf{} + f: 0 + f is not f for f = -0, so the compiler adds before
// it broadcasts; f - 0 is f for every f and folds away.)
inline vf splat(float f) { return f - vf{}; }

// the sum of a vector's lanes: halves added until 4 lanes are left (the compiler turns
// the copies of a half into register extracts)
template <int N>
inline float hsum_of(const float* lanes) {
  if constexpr (N == 4) {
    return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  } else {
    typedef float half __attribute__((vector_size(2 * N)));
    half lo, hi;
    __builtin_memcpy(&lo, lanes, sizeof lo);
    __builtin_memcpy(&hi, lanes + N / 2, sizeof hi);
    const half sum = lo + hi;
    float out[N / 2];
    __builtin_memcpy(out, &sum, sizeof sum);
    return hsum_of<N / 2>(out);
  }
}

inline float hsum(vf v) {
  float lanes[kLanes];
  __builtin_memcpy(lanes, &v, sizeof v);
  return hsum_of<kLanes>(lanes);
}

// The threads a kernel spreads its tasks over.
class Pool {
 public:
  virtual ~Pool() = default;
  virtual int64_t threads() const = 0;               // besides the caller's
  virtual void schedule(std::function<void()> task) = 0;
};

struct Progress {  // shared with helper tasks that may start after the call returned
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Output rows per task when a product's n rows are split over the pool: at least
// `minimum`, else about 8 tasks per thread. Every task costs two atomic adds on a line
// the threads share; with tasks of a few microseconds (16 rows of the embedded model's
// 8-bit LM head are 9 KB) that traffic cost as much as the work, and two threads ran no
// faster than one.
inline int64_t rows_per_task(const Pool& pool, int64_t n, int64_t minimum) {
  const int64_t tasks = 8 * (pool.threads() + 1);
  return std::max(minimum, (n + tasks - 1) / tasks);
}

// run(t) for t in [0, tasks) on this thread and the pool's threads; returns when
// every task is done. Helpers take tasks while this thread does too; one that starts
// after every task is taken returns at once (it touches only `progress`, which it
// co-owns), so `run` may go out of scope when this returns.
template <typename Run>
void run_tasks(Pool& pool, int64_t tasks, const Run& run) {
  auto progress = std::make_shared<Progress>();
  auto work = [&run, tasks](Progress* state) {
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      run(t);
      state->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.threads(), tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.schedule([progress, work] { work(progress.get()); });
  work(progress.get());
  while (progress->done.load() < tasks) std::this_thread::yield();
}

// Paged attention (paged_attention.cc): queries [rows, q_len, heads, dim], one layer's
// K and V pages [pages, kv heads, page size, dim], block tables [rows, width], and the
// positions each query sees, [first, last) [rows, q_len]; out as the queries.
struct Attention {
  const float* q;
  int64_t rows, q_len, heads, dim;
  const float *k, *v;
  int64_t pages, kv_heads, page_size;
  const int32_t* tables;
  int64_t width;
  const int32_t *first, *last;
  float* out;
};

// nullptr when done, else why the shape is not taken (nothing written)
const char* paged_attention(Pool& pool, const Attention& a);

// out[r, o] = x[r] . w[o] (linear.cc): x [rows, d], w [n, d], out [rows, n], d a multiple
// of 16
void linear(Pool& pool, const float* x, const float* w, int64_t rows, int64_t d, int64_t n,
            float* out);

// out[r, o] = x[r] . w[o] with w kept quantized (quantized_linear.cc): x [rows, d] f32; q
// the values, [n, d / 2] bytes for 4 bits, [n, d] for 8-bit integers and fp8 e4m3; one
// scale (and for 4 bits a minimum) for each `group` values along d, float16 bits or
// float32 [n, d / group]. `group` divides d and is a multiple of 32 for 4 bits, of 16
// otherwise.
enum class Values { kInt4, kInt8, kFp8 };

struct QuantizedProduct {
  const float* x;
  int64_t rows, d, n;
  Values values;
  int64_t group;
  const uint8_t* q;
  bool f32_scales;                // scales and minimums are float32, else float16 bits
  const void *scales, *minimums;  // minimums: 4 bits only, else nullptr
  float* out;
};

void quantized_linear(Pool& pool, const QuantizedProduct& p);

}  // namespace xlr
