// The CPU kernels as XLA FFI custom calls: each handler checks its buffers' shapes and
// calls its kernel (cpu_kernels.h) with XLA's intra-op threads as the pool.
//
// Built with the kernels by xlr_jax/ops/cpu_build.py; the only file that includes XLA's
// FFI header.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// XLA's intra-op threads, as many as leave the calling thread a core (all of them where
// the core count is unknown): XLA's pool has a thread a core, so all of them beside the
// caller put three threads on two cores, and the tasks of a descheduled one held up the
// call's end (a decode step's products took 8.4-11.6 ms with two helpers, 5.5-8.0 with
// one; 2-core Zen 5).
class XlaPool final : public xlr::Pool {
 public:
  explicit XlaPool(ffi::ThreadPool& pool) : pool_(pool) {}
  int64_t threads() const override {
    static const int64_t cores = std::thread::hardware_concurrency();  // 0: unknown
    return cores > 0 ? std::min<int64_t>(pool_.num_threads(), cores - 1) : pool_.num_threads();
  }
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

// Checks x [rows, d], values [n, d / 2] (4 bits) or [n, d], and scales (and minimums,
// alike) [n, groups] in float16 or float32 with `group` = d / groups as the layout asks.
ffi::Error QuantizedLinear(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, xlr::Values values,
                          const uint8_t* q, ffi::AnyBuffer::Dimensions qd,
                          ffi::AnyBuffer& scales, const ffi::AnyBuffer* minimums,
                          ffi::ResultBuffer<ffi::F32>& out) {
  const auto xd = x.dimensions(), sd = scales.dimensions();
  const bool four = values == xlr::Values::kInt4;
  const auto type = scales.element_type();
  const auto md = minimums ? minimums->dimensions() : sd;
  const bool typed = (type == ffi::DataType::F16 || type == ffi::DataType::F32) &&
                     (!minimums || minimums->element_type() == type) &&
                     std::equal(sd.begin(), sd.end(), md.begin(), md.end());
  const int64_t group = sd.size() == 2 && sd[1] > 0 && xd.size() == 2 ? xd[1] / sd[1] : 0;
  if (!typed || qd.size() != 2 || group == 0 || group * sd[1] != xd[1] || sd[0] != qd[0] ||
      group % (four ? 32 : 16) != 0 || qd[1] != (four ? xd[1] / 2 : xd[1]))
    return ffi::Error::InvalidArgument(
        "quantized linear: x [rows, d], values [out, d / 2] (4 bits) or [out, d], scales "
        "(and minimums) float16 or float32 [out, d / group], the group a multiple of 32 "
        "(4 bits) or 16");
  XlaPool threads(pool);
  xlr::quantized_linear(threads, {x.typed_data(), xd[0], xd[1], qd[0], values, group, q,
                                  type == ffi::DataType::F32, scales.untyped_data(),
                                  minimums ? minimums->untyped_data() : nullptr,
                                  out->typed_data()});
  return ffi::Error::Success();
}

ffi::Error LinearQ4(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::AnyBuffer scales, ffi::AnyBuffer minimums,
                    ffi::ResultBuffer<ffi::F32> out) {
  return QuantizedLinear(pool, x, xlr::Values::kInt4, q.typed_data(), q.dimensions(), scales,
                         &minimums, out);
}

ffi::Error LinearQ8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> out) {
  return QuantizedLinear(pool, x, xlr::Values::kInt8,
                         reinterpret_cast<const uint8_t*>(q.typed_data()), q.dimensions(),
                         scales, nullptr, out);
}

// fp8 values as any buffer: XLA's FFI header has no typed buffer of F8E4M3FN
ffi::Error LinearF8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                    ffi::AnyBuffer scales, ffi::ResultBuffer<ffi::F32> out) {
  if (q.element_type() != ffi::DataType::F8E4M3FN)
    return ffi::Error::InvalidArgument("quantized linear: fp8 values are float8_e4m3fn");
  return QuantizedLinear(pool, x, xlr::Values::kFp8,
                         reinterpret_cast<const uint8_t*>(q.untyped_data()), q.dimensions(),
                         scales, nullptr, out);
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
                                  .Arg<ffi::AnyBuffer>()          // scales [out, groups]
                                  .Arg<ffi::AnyBuffer>()          // minimums [out, groups]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrLinearQ8, LinearQ8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, d]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // values [out, d]
                                  .Arg<ffi::AnyBuffer>()          // scales [out, groups]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrLinearF8, LinearF8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [rows, d]
                                  .Arg<ffi::AnyBuffer>()          // values [out, d]
                                  .Arg<ffi::AnyBuffer>()          // scales [out, groups]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [rows, out]

// the floats a vector of this build holds (16 AVX-512, 8 AVX2, 4 otherwise): what the
// target gave the kernels
extern "C" int XlrVectorLanes() { return xlr::kLanes; }
