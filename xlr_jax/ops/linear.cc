// A weight product of a few rows on the CPU: out[r, o] = sum_k x[r, k] w[o, k], f32 (an
// XLA FFI custom call through ffi_bindings.cc).
//
// XLA:CPU's dot of 2-24 rows runs at a fraction of the machine's multiply-add rate and
// a multiply-and-sum reads the weights at 1.3-1.9x a matrix-vector product's time. This
// reads each block of 4 weight rows from memory once, while it is in the L1 cache folds
// it against every row of x, as many rows at a time as the target's registers hold
// accumulators for (6 with 32 vector registers, 2 with 16), and spreads blocks of output
// rows over XLA's intra-op threads. A step of 8 rows then costs about
// what reading the weights costs.
//
// Built with the other kernels by xlr_jax/ops/cpu_build.py (the host's C++ compiler, for
// the CPU it runs on unless told otherwise).
#include <cstdint>
#include <utility>

#include "cpu_kernels.h"

namespace {

using xlr::hsum;
using xlr::kLanes;
using xlr::load;
using xlr::vf;

constexpr int64_t kTaskRows = 32;  // the fewest output rows a task computes
constexpr int kBlockRows = 4;      // weight rows read together
// rows of x folded against a weight block at a time: its kBlockRows x kMaxGroup
// accumulators, the block's rows and one x row in registers (32: 24 + 4 + 1; 16: 8 + 4 + 1)
constexpr int kMaxGroup = xlr::kRegisters >= 32 ? 6 : 2;

// out[j, i] (row stride n) = x row j . w row i for RX rows of x and RW rows of w (d a
// multiple of kLanes).
template <int RW, int RX>
void fold_block(const float* x, const float* w, int64_t d, int64_t n, float* out) {
  vf acc[RW][RX] = {};
  for (int64_t k = 0; k < d; k += kLanes) {
    vf wv[RW];
    for (int i = 0; i < RW; ++i) {
      wv[i] = load(w + i * d + k);
      // the next block's row: the hardware prefetcher alone leaves the multiply-adds
      // waiting on memory (8 rows read the weights at 21-25 GB/s without this, 30-35
      // with it); past the matrix's end it is a hint that does not fault
      __builtin_prefetch(w + (i + RW) * d + k);
    }
    for (int j = 0; j < RX; ++j) {
      const vf xv = load(x + j * d + k);
      for (int i = 0; i < RW; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  for (int j = 0; j < RX; ++j)
    for (int i = 0; i < RW; ++i) out[j * n + i] = hsum(acc[i][j]);
}

using BlockFn = void (*)(const float*, const float*, int64_t, int64_t, float*);

template <int RW, int... Gs>
BlockFn block_for(int64_t group, std::integer_sequence<int, Gs...>) {
  static constexpr BlockFn table[] = {fold_block<RW, Gs + 1>...};
  return table[group - 1];
}

template <int RW>
BlockFn block_for(int64_t group) {
  return block_for<RW>(group, std::make_integer_sequence<int, kMaxGroup>{});
}

}  // namespace

void xlr::linear(Pool& pool, const float* xp, const float* wp, int64_t rows, int64_t d,
                 int64_t n, float* op) {
  // rows in groups of at most kMaxGroup, as even as they go (8 rows of 6: 4 and 4)
  const int64_t groups = (rows + kMaxGroup - 1) / kMaxGroup;
  const int64_t per_task = xlr::rows_per_task(pool, n, kTaskRows);
  const int64_t tasks = (n + per_task - 1) / per_task;

  auto run = [&](int64_t t) {
    const int64_t o1 = std::min(n, (t + 1) * per_task);
    for (int64_t o = t * per_task; o < o1;) {
      const bool whole = o + kBlockRows <= o1;  // else the task's last rows one by one
      for (int64_t g = 0, r = 0; g < groups; ++g) {
        const int64_t size = (rows - r) / (groups - g);  // the rest, shared evenly
        const BlockFn fold = whole ? block_for<kBlockRows>(size) : block_for<1>(size);
        fold(xp + r * d, wp + o * d, d, n, op + r * n + o);
        r += size;
      }
      o += whole ? kBlockRows : 1;
    }
  };

  xlr::run_tasks(pool, tasks, run);
}
