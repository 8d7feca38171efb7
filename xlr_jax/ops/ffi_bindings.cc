// The CPU kernels as XLA FFI custom calls: each handler checks its buffers' shapes and
// calls its kernel (cpu_kernels.h) with XLA's intra-op threads as the pool.
//
// Built with the kernels by xlr_jax/ops/cpu_build.py; the only file that includes XLA's
// FFI header.
#include <algorithm>
#include <cstdint>
#include <functional>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

class XlaPool final : public xlr::Pool {
 public:
  explicit XlaPool(ffi::ThreadPool& pool) : pool_(pool) {}
  int64_t threads() const override { return pool_.num_threads(); }
  void schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool& pool_;
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> first,
                          ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();        // [rows, q_len, heads, dim]
  const auto kd = k_pages.dimensions();  // [layers, pages, kv heads, page size, dim]
  const auto td = tables.dimensions();   // [rows, width]
  const auto vd = v_pages.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || kd[4] != qd[3] || td[0] != qd[0] ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("paged attention: q [rows, q_len, heads, dim], pages "
                                       "[layers, pages, kv heads, page size, dim] and block "
                                       "tables [rows, width]");
  const int64_t layer_floats = kd[1] * kd[2] * kd[3] * kd[4];
  const int64_t at = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1) * layer_floats;
  const xlr::Attention a{q.typed_data(), qd[0], qd[1], qd[2], qd[3],
                         k_pages.typed_data() + at, v_pages.typed_data() + at,
                         kd[1], kd[2], kd[3], tables.typed_data(), td[1],
                         first.typed_data(), last.typed_data(), out->typed_data()};
  XlaPool threads(pool);
  const char* why = xlr::paged_attention(threads, a);
  return why ? ffi::Error::InvalidArgument(why) : ffi::Error::Success();
}

ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[1] % 16 != 0)
    return ffi::Error::InvalidArgument("linear: x [rows, d] and w [out, d] with d a "
                                       "multiple of 16");
  XlaPool threads(pool);
  xlr::linear(threads, x.typed_data(), w.typed_data(), xd[0], xd[1], wd[0], out->typed_data());
  return ffi::Error::Success();
}

ffi::Error QuantizedLinear(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, int bits,
                          const uint8_t* q, int64_t q_cols, int64_t n,
                          ffi::Buffer<ffi::F16>& scales, const uint16_t* minimums,
                          ffi::ResultBuffer<ffi::F32>& out) {
  const auto xd = x.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || sd.size() != 2 || xd[1] % 32 != 0 || sd[0] != n ||
      sd[1] * 32 != xd[1] || q_cols != (bits == 4 ? xd[1] / 2 : xd[1]))
    return ffi::Error::InvalidArgument("quantized linear: x [rows, d], values [out, d / 2] "
                                       "(4 bits) or [out, d] (8 bits), scales [out, d / 32]; "
                                       "d a multiple of 32");
  XlaPool threads(pool);
  xlr::quantized_linear(threads, {x.typed_data(), xd[0], xd[1], n, bits, q,
                                  reinterpret_cast<const uint16_t*>(scales.typed_data()),
                                  minimums, out->typed_data()});
  return ffi::Error::Success();
}

ffi::Error LinearQ4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F16> scales, ffi::Buffer<ffi::F16> minimums,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), md = minimums.dimensions(), sd = scales.dimensions();
  if (qd.size() != 2 || !std::equal(md.begin(), md.end(), sd.begin(), sd.end()))
    return ffi::Error::InvalidArgument("quantized linear: 4-bit values [out, d / 2] and "
                                       "minimums shaped as the scales");
  return QuantizedLinear(pool, x, 4, q.typed_data(), qd[1], qd[0], scales,
                         reinterpret_cast<const uint16_t*>(minimums.typed_data()), out);
}

ffi::Error LinearQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F16> scales, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  if (qd.size() != 2)
    return ffi::Error::InvalidArgument("quantized linear: 8-bit values [out, d]");
  return QuantizedLinear(pool, x, 8, reinterpret_cast<const uint8_t*>(q.typed_data()), qd[1],
                         qd[0], scales, nullptr, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [rows, q_len, heads, dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // each query's first position seen
                                  .Arg<ffi::Buffer<ffi::S32>>()   // one past the last
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrLinear, Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, d]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [out, d]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrLinearQ4, LinearQ4,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, d]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // values [out, d / 2]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scales [out, d / 32]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // minimums [out, d / 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrLinearQ8, LinearQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, d]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // values [out, d]
                                  .Arg<ffi::Buffer<ffi::F16>>()   // scales [out, d / 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]

// the floats a vector of this build holds (16 AVX-512, 8 AVX2, 4 otherwise): what the
// target gave the kernels
extern "C" int XlrVectorLanes() { return xlr::kLanes; }
