// Decode attention over the paged KV cache on the CPU: an XLA FFI custom call.
//
// One query token per row (decode), f32 pages, GQA. XLA:CPU runs the pure-JAX walk as
// many small ops, one after another, each reading a few pages on one thread; this reads
// every page in place (no gather copy), folds it into an online softmax while it is in
// the cache, and spreads the (row, KV head, run of pages) pieces over XLA's intra-op
// threads. Semantics are paged_attention_xla's: row b's query at position qpos sees
// positions [first[b], last[b]); a row that sees nothing gets zeros.
//
// Built with linear.cc by xlr_jax/ops/cpu_kernels.py (the host's C++ compiler,
// -march=native).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

using xlr::hsum;
using xlr::load;
using xlr::store;
using xlr::vf;
using xlr::vi;

constexpr int64_t kPiecePages = 4;     // pages per task: enough pieces for every thread
constexpr int64_t kMaxPageSize = 256;  // slots a page's scores may hold

// exp(x) for x <= 0 on 16 lanes, 0 below -87 (where f32 exp underflows) and for -inf:
// 2^n p(r) with r = x - n ln2 and p a degree-7 polynomial (about 1 ulp). The compiler
// vectorizes this; it calls libm's scalar expf for std::exp.
inline vf exp_nonpositive(vf x) {
  const vf round = vf{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf c = x < -87.f ? vf{} - 87.f : x;
  const vf n = (c * 1.44269504088896341f + round) - round;
  const vf r = c - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi bits = (vi)p + (__builtin_convertvector(n, vi) << 23);
  return x < -87.f ? vf{} : (vf)bits;
}

// Fold `slots` consecutive slots of one page of one KV head (K and V rows of D floats)
// into the online softmax (peak, total, acc) of its G query heads.
template <int G, int D>
void fold_slots(const float* q, const float* k, const float* v, int64_t slots, float scale,
                float* peak, float* total, float* acc) {
  constexpr int kV = D / 16;
  vf qv[G][kV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kV; ++i) qv[g][i] = load(q + g * D + i * 16) * scale;
  alignas(64) float w[G][kMaxPageSize + 16];
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = peak[g];
  for (int64_t s = 0; s < slots; ++s) {  // scores: the slot's K row once for all G heads
    vf kr[kV];
    for (int i = 0; i < kV; ++i) kr[i] = load(k + s * D + i * 16);
    for (int g = 0; g < G; ++g) {
      vf p = qv[g][0] * kr[0];
      for (int i = 1; i < kV; ++i) p += qv[g][i] * kr[i];
      const float dot = hsum(p);
      w[g][s] = dot;
      m[g] = std::max(m[g], dot);
    }
  }
  const int64_t padded = (slots + 15) / 16 * 16;
  vf a[G][kV];
  for (int g = 0; g < G; ++g) {
    for (int64_t s = slots; s < padded; ++s) w[g][s] = -std::numeric_limits<float>::infinity();
    vf sum = vf{};
    for (int64_t s = 0; s < padded; s += 16) {
      const vf e = exp_nonpositive(load(w[g] + s) - m[g]);
      store(w[g] + s, e);
      sum += e;
    }
    // 0 while nothing was seen (peak -inf): the first page starts the sums afresh
    const float rescale = std::isinf(peak[g]) ? 0.f : std::exp(peak[g] - m[g]);
    total[g] = total[g] * rescale + hsum(sum);
    peak[g] = m[g];
    for (int i = 0; i < kV; ++i) a[g][i] = load(acc + g * D + i * 16) * rescale;
  }
  for (int64_t s = 0; s < slots; ++s) {  // values: the slot's V row once for all G heads
    vf vr[kV];
    for (int i = 0; i < kV; ++i) vr[i] = load(v + s * D + i * 16);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < kV; ++i) a[g][i] += w[g][s] * vr[i];
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kV; ++i) store(acc + g * D + i * 16, a[g][i]);
}

using FoldFn = void (*)(const float*, const float*, const float*, int64_t, float, float*,
                        float*, float*);

template <int D>
FoldFn fold_for_group(int64_t group) {
  static constexpr FoldFn table[] = {fold_slots<1, D>, fold_slots<2, D>, fold_slots<3, D>,
                                     fold_slots<4, D>, fold_slots<5, D>, fold_slots<6, D>,
                                     fold_slots<7, D>, fold_slots<8, D>};
  return group >= 1 && group <= 8 ? table[group - 1] : nullptr;
}

FoldFn fold_for(int64_t group, int64_t dim) {
  switch (dim) {
    case 32: return fold_for_group<32>(group);
    case 64: return fold_for_group<64>(group);
    case 128: return fold_for_group<128>(group);
    case 256: return fold_for_group<256>(group);
    default: return nullptr;
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                           ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> first,
                           ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();        // [rows, heads, dim]
  const auto kd = k_pages.dimensions();  // [layers, pages, kv heads, page size, dim]
  if (qd.size() != 3 || kd.size() != 5 || tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("decode attention: q [rows, heads, dim] and pages "
                                       "[layers, pages, kv heads, page size, dim]");
  const int64_t rows = qd[0], heads = qd[1], dim = qd[2];
  const int64_t layers = kd[0], num_pages = kd[1], kv_heads = kd[2], page_size = kd[3];
  const int64_t width = tables.dimensions()[1];
  const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
  const FoldFn fold = group * kv_heads == heads ? fold_for(group, dim) : nullptr;
  if (fold == nullptr || kd[4] != dim || page_size > kMaxPageSize)
    return ffi::Error::InvalidArgument("decode attention: unsupported shape (head dim 32, "
                                       "64, 128 or 256, at most 8 query heads per KV head, "
                                       "pages of at most 256 slots)");
  const int64_t lyr = std::clamp<int64_t>(layer.typed_data()[0], 0, layers - 1);
  const int64_t layer_floats = num_pages * kv_heads * page_size * dim;
  const float* kp = k_pages.typed_data() + lyr * layer_floats;
  const float* vp = v_pages.typed_data() + lyr * layer_floats;
  const float* qp = q.typed_data();
  const int32_t* tp = tables.typed_data();
  const int32_t* lo = first.typed_data();
  const int32_t* hi = last.typed_data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));

  // each row's positions seen [begin, end), inside its block table; tasks: (row, KV
  // head, piece of kPiecePages pages from the row's first seen page)
  std::vector<int64_t> begin(rows), end(rows), pieces(rows), row_task(rows + 1, 0);
  for (int64_t b = 0; b < rows; ++b) {
    end[b] = std::min<int64_t>(std::max(hi[b], 0), width * page_size);
    begin[b] = std::clamp<int64_t>(lo[b], 0, end[b]);
    const int64_t pages = (end[b] + page_size - 1) / page_size - begin[b] / page_size;
    pieces[b] = std::max<int64_t>((pages + kPiecePages - 1) / kPiecePages, 1);
    row_task[b + 1] = row_task[b] + kv_heads * pieces[b];
  }
  const int64_t tasks = row_task[rows];
  const int64_t stride = group * (dim + 2);  // a task's peak[G], total[G], acc[G][dim]
  std::vector<float> partial(tasks * stride);

  auto run = [&](int64_t t) {
    const int64_t b = std::upper_bound(row_task.begin(), row_task.end(), t) - row_task.begin() - 1;
    const int64_t h = (t - row_task[b]) / pieces[b], piece = (t - row_task[b]) % pieces[b];
    float* peak = partial.data() + t * stride;
    float* total = peak + group;
    float* acc = total + group;
    std::fill(peak, peak + group, -std::numeric_limits<float>::infinity());
    std::fill(total, total + group + group * dim, 0.f);
    const float* qrow = qp + (b * heads + h * group) * dim;
    const int64_t p0 = begin[b] / page_size + piece * kPiecePages;
    for (int64_t p = p0; p < p0 + kPiecePages && p * page_size < end[b]; ++p) {
      const int64_t page = tp[b * width + p];
      if (page < 0 || page >= num_pages) continue;  // out of the pool: nothing to read
      const int64_t s0 = std::max(begin[b] - p * page_size, int64_t{0});
      const int64_t s1 = std::min(end[b] - p * page_size, page_size);
      if (s1 <= s0) continue;
      const int64_t at = ((page * kv_heads + h) * page_size + s0) * dim;
      fold(qrow, kp + at, vp + at, s1 - s0, scale, peak, total, acc);
    }
  };

  xlr::run_tasks(pool, tasks, run);

  // each (row, KV head): its pieces' softmaxes merged
  float* op = out->typed_data();
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* part = partial.data() + (row_task[b] + h * pieces[b]) * stride;
      for (int64_t g = 0; g < group; ++g) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < pieces[b]; ++i) m = std::max(m, part[i * stride + g]);
        float* o = op + (b * heads + h * group + g) * dim;
        std::fill(o, o + dim, 0.f);
        if (std::isinf(m)) continue;  // sees nothing: zeros
        float total = 0.f;
        for (int64_t i = 0; i < pieces[b]; ++i) {
          const float* pk = part + i * stride;
          const float w = std::exp(pk[g] - m);
          total += pk[group + g] * w;
          const float* a = pk + 2 * group + g * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] += w * a[d];
        }
        for (int64_t d = 0; d < dim; ++d) o[d] /= total;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlrDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // first position seen
                                  .Arg<ffi::Buffer<ffi::S32>>()   // one past the last
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());
