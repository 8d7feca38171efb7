// A weight product of a few rows on the CPU: out[r, o] = sum_k x[r, k] w[o, k], f32, an
// XLA FFI custom call.
//
// XLA:CPU's dot of 2-24 rows runs at a fraction of the machine's multiply-add rate and
// a multiply-and-sum reads the weights at 1.3-1.9x a matrix-vector product's time. This
// reads each block of 4 weight rows from memory once, while it is in the L1 cache folds
// it against every row of x, 6 rows at a time (24 accumulators in registers), and spreads
// blocks of output rows over XLA's intra-op threads. A step of 8 rows then costs about
// what reading the weights costs.
//
// Built with paged_attention.cc by xlr_jax/ops/cpu_kernels.py (the host's C++
// compiler, -march=native).
#include <cstdint>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

using xlr::hsum;
using xlr::load;
using xlr::vf;

constexpr int64_t kTaskRows = 32;  // output rows a task computes: 18+ tasks per layer
constexpr int kMaxGroup = 6;       // rows of x folded against a weight block at a time

// out[j, i] (row stride n) = x row j . w row i for RX rows of x and RW rows of w (d a
// multiple of 16).
template <int RW, int RX>
void fold_block(const float* x, const float* w, int64_t d, int64_t n, float* out) {
  vf acc[RW][RX] = {};
  for (int64_t k = 0; k < d; k += 16) {
    vf wv[RW];
    for (int i = 0; i < RW; ++i) {
      wv[i] = load(w + i * d + k);
      // the next block's row: the hardware prefetcher alone leaves the multiply-adds
      // waiting on memory (8 rows read the weights at 21-25 GB/s without this, 30-35
      // with it); past the matrix's end it is a hint that does not fault
      __builtin_prefetch(w + (i + RW) * d + k);
    }
    for (int j = 0; j < RX; ++j) {
      vf xv = load(x + j * d + k);
      // keep the x row in a register: folded into each multiply-add as a memory operand,
      // it costs a load per multiply-add and the loads become the bound
      asm("" : "+v"(xv));
      for (int i = 0; i < RW; ++i) acc[i][j] += wv[i] * xv;
    }
  }
  for (int j = 0; j < RX; ++j)
    for (int i = 0; i < RW; ++i) out[j * n + i] = hsum(acc[i][j]);
}

using BlockFn = void (*)(const float*, const float*, int64_t, int64_t, float*);

template <int RW>
BlockFn block_for(int64_t group) {
  static constexpr BlockFn table[] = {fold_block<RW, 1>, fold_block<RW, 2>, fold_block<RW, 3>,
                                      fold_block<RW, 4>, fold_block<RW, 5>, fold_block<RW, 6>};
  return table[group - 1];
}

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[1] % 16 != 0)
    return ffi::Error::InvalidArgument("linear: x [rows, d] and w [out, d] with d a "
                                       "multiple of 16");
  const int64_t rows = xd[0], d = xd[1], n = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  // rows in groups of at most kMaxGroup, as even as they go (8 rows: 4 and 4)
  const int64_t groups = (rows + kMaxGroup - 1) / kMaxGroup;
  const int64_t tasks = (n + kTaskRows - 1) / kTaskRows;

  auto run = [&](int64_t t) {
    const int64_t o1 = std::min(n, (t + 1) * kTaskRows);
    for (int64_t o = t * kTaskRows; o < o1;) {
      const bool four = o + 4 <= o1;
      for (int64_t g = 0, r = 0; g < groups; ++g) {
        const int64_t size = (rows - r) / (groups - g);  // the rest, shared evenly
        const BlockFn fold = four ? block_for<4>(size) : block_for<1>(size);
        fold(xp + r * d, wp + o * d, d, n, op + r * n + o);
        r += size;
      }
      o += four ? 4 : 1;
    }
  };

  xlr::run_tasks(pool, tasks, run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrLinear, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [out, d]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]
