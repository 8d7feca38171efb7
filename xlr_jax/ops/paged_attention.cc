// Paged attention on the CPU: an XLA FFI custom call.
//
// Queries [rows, q_len, heads, dim] (decode: one a row; a prefill chunk or verify rows:
// several of one sequence), f32 pages, GQA. XLA:CPU runs the pure-JAX walk as many small
// ops, one after another, each reading a few pages on one thread; this reads every page
// in place (no gather copy), folds it into an online softmax while it is in the cache,
// and spreads (row, block of queries, KV head, run of pages) tasks over XLA's intra-op
// threads. A block's queries fold each K and V row once for all of them and all their
// query heads; the slots only some of them see (the causal diagonal, a window's edge)
// are folded query by query. Semantics are paged_attention_xla's: the query at row b,
// index t sees positions [first[b, t], last[b, t]); one that sees nothing gets zeros.
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

constexpr int64_t kPiecePages = 4;     // pages per task while tasks are few
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

// query vectors folded together: a KV head's group (1-8 query heads) times the queries
// of a block
constexpr int64_t kFoldSizes[] = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16};

template <int D>
FoldFn fold_for_size(int64_t n) {
  switch (n) {
    case 1: return fold_slots<1, D>;
    case 2: return fold_slots<2, D>;
    case 3: return fold_slots<3, D>;
    case 4: return fold_slots<4, D>;
    case 5: return fold_slots<5, D>;
    case 6: return fold_slots<6, D>;
    case 7: return fold_slots<7, D>;
    case 8: return fold_slots<8, D>;
    case 12: return fold_slots<12, D>;
    case 16: return fold_slots<16, D>;
    default: return nullptr;
  }
}

FoldFn fold_for(int64_t n, int64_t dim) {
  switch (dim) {
    case 32: return fold_for_size<32>(n);
    case 64: return fold_for_size<64>(n);
    case 128: return fold_for_size<128>(n);
    case 256: return fold_for_size<256>(n);
    default: return nullptr;
  }
}

// queries a block folds together: the most, up to q_len, whose query heads make a
// fold size (16 query vectors at most: their scores and sums stay in the L1 cache)
int64_t block_queries(int64_t group, int64_t q_len) {
  int64_t best = 1;
  for (int64_t n : kFoldSizes)
    if (n % group == 0 && n / group <= q_len) best = std::max(best, n / group);
  return best;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> first,
                          ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();        // [rows, q_len, heads, dim]
  const auto kd = k_pages.dimensions();  // [layers, pages, kv heads, page size, dim]
  if (qd.size() != 4 || kd.size() != 5 || tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q [rows, q_len, heads, dim] and "
                                       "pages [layers, pages, kv heads, page size, dim]");
  const int64_t rows = qd[0], q_len = qd[1], heads = qd[2], dim = qd[3];
  const int64_t layers = kd[0], num_pages = kd[1], kv_heads = kd[2], page_size = kd[3];
  const int64_t width = tables.dimensions()[1];
  const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
  const int64_t block = block_queries(std::max<int64_t>(group, 1), q_len);
  const FoldFn fold_row = group * kv_heads == heads ? fold_for(group, dim) : nullptr;
  const FoldFn fold_block = fold_row ? fold_for(block * group, dim) : nullptr;
  if (fold_block == nullptr || kd[4] != dim || page_size > kMaxPageSize)
    return ffi::Error::InvalidArgument("paged attention: unsupported shape (head dim 32, "
                                       "64, 128 or 256, at most 8 query heads per KV head, "
                                       "pages of at most 256 slots)");
  const int64_t lyr = std::clamp<int64_t>(layer.typed_data()[0], 0, layers - 1);
  const int64_t layer_floats = num_pages * kv_heads * page_size * dim;
  const float* kp = k_pages.typed_data() + lyr * layer_floats;
  const float* vp = v_pages.typed_data() + lyr * layer_floats;
  const float* qp = q.typed_data();
  const int32_t* tp = tables.typed_data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));

  // each query's positions seen [lo, hi), inside its row's block table (empty: none)
  const int64_t queries = rows * q_len;
  std::vector<int64_t> lo(queries), hi(queries);
  for (int64_t i = 0; i < queries; ++i) {
    hi[i] = std::min<int64_t>(std::max(last.typed_data()[i], 0), width * page_size);
    lo[i] = std::clamp<int64_t>(first.typed_data()[i], 0, hi[i]);
  }
  // blocks of `block` queries of one row; each (block, KV head) walks the union of its
  // queries' pages in pieces: of kPiecePages pages while there are few blocks, so that
  // every thread has work, else whole
  const int64_t blocks_per_row = (q_len + block - 1) / block, blocks = rows * blocks_per_row;
  const int64_t piece_pages = blocks * kv_heads >= 16 ? width : kPiecePages;
  std::vector<int64_t> first_page(blocks), pieces(blocks), block_task(blocks + 1, 0);
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t q0 = (k / blocks_per_row) * q_len + (k % blocks_per_row) * block;
    const int64_t q1 = std::min(q0 + block, (k / blocks_per_row + 1) * q_len);
    int64_t u0 = width * page_size, u1 = 0;  // the union of the queries' ranges
    for (int64_t i = q0; i < q1; ++i)
      if (hi[i] > lo[i]) u0 = std::min(u0, lo[i]), u1 = std::max(u1, hi[i]);
    const int64_t pages = u1 > u0 ? (u1 + page_size - 1) / page_size - u0 / page_size : 0;
    first_page[k] = u1 > u0 ? u0 / page_size : 0;
    pieces[k] = std::max<int64_t>((pages + piece_pages - 1) / piece_pages, 1);
    block_task[k + 1] = block_task[k] + kv_heads * pieces[k];
  }
  const int64_t tasks = block_task[blocks];
  const int64_t folded = block * group;             // query vectors a task folds
  const int64_t stride = folded * (dim + 2);       // a task's peak, total, acc[folded][dim]
  std::vector<float> partial(tasks * stride);

  auto run = [&](int64_t t) {
    const int64_t k = std::upper_bound(block_task.begin(), block_task.end(), t) -
                      block_task.begin() - 1;
    const int64_t h = (t - block_task[k]) / pieces[k], piece = (t - block_task[k]) % pieces[k];
    const int64_t b = k / blocks_per_row;
    const int64_t q0 = b * q_len + (k % blocks_per_row) * block;
    const int64_t n = std::min(block, (b + 1) * q_len - q0);  // the block's queries
    float* peak = partial.data() + t * stride;
    float* total = peak + folded;
    float* acc = total + folded;
    std::fill(peak, peak + folded, -std::numeric_limits<float>::infinity());
    std::fill(total, total + folded + folded * dim, 0.f);
    // the block's query vectors, [query][group head][dim]; a short block repeats its
    // last query (folded, never merged)
    alignas(64) float qbuf[16 * 256];
    for (int64_t j = 0; j < block; ++j)
      std::copy_n(qp + ((q0 + std::min(j, n - 1)) * heads + h * group) * dim, group * dim,
                  qbuf + j * group * dim);
    // slots every query of the block sees: folded once for all of them
    int64_t c0 = 0, c1 = width * page_size;
    for (int64_t j = 0; j < n; ++j) c0 = std::max(c0, lo[q0 + j]), c1 = std::min(c1, hi[q0 + j]);
    const int64_t p0 = first_page[k] + piece * piece_pages;
    for (int64_t p = p0; p < p0 + piece_pages && p < width; ++p) {
      const int64_t page = tp[b * width + p];
      if (page < 0 || page >= num_pages) continue;  // out of the pool: nothing to read
      const int64_t start = p * page_size, at = (page * kv_heads + h) * page_size;
      const int64_t s0 = std::max(c0, start), s1 = std::min(c1, start + page_size);
      if (s1 > s0)
        fold_block(qbuf, kp + (at + s0 - start) * dim, vp + (at + s0 - start) * dim, s1 - s0,
                   scale, peak, total, acc);
      for (int64_t j = 0; j < n; ++j) {  // each query's slots outside the shared ones
        const int64_t r0 = std::max(lo[q0 + j], start);
        const int64_t r1 = std::min(hi[q0 + j], start + page_size);
        const int64_t g = j * group;
        auto fold = [&](int64_t from, int64_t to) {
          if (to > from)
            fold_row(qbuf + g * dim, kp + (at + from - start) * dim,
                     vp + (at + from - start) * dim, to - from, scale, peak + g, total + g,
                     acc + g * dim);
        };
        if (s1 > s0) {
          fold(r0, s0);
          fold(s1, r1);
        } else {
          fold(r0, r1);
        }
      }
    }
  };

  xlr::run_tasks(pool, tasks, run);

  // each query head: its block's pieces' softmaxes merged
  float* op = out->typed_data();
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t b = i / q_len, k = b * blocks_per_row + (i % q_len) / block;
    const int64_t j = (i % q_len) % block;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* part = partial.data() + (block_task[k] + h * pieces[k]) * stride;
      for (int64_t g = j * group; g < (j + 1) * group; ++g) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t x = 0; x < pieces[k]; ++x) m = std::max(m, part[x * stride + g]);
        float* o = op + (i * heads + h * group + g - j * group) * dim;
        std::fill(o, o + dim, 0.f);
        if (std::isinf(m)) continue;  // sees nothing: zeros
        float sum = 0.f;
        for (int64_t x = 0; x < pieces[k]; ++x) {
          const float* pk = part + x * stride;
          const float w = std::exp(pk[g] - m);
          sum += pk[folded + g] * w;
          const float* a = pk + 2 * folded + g * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] += w * a[d];
        }
        for (int64_t d = 0; d < dim; ++d) o[d] /= sum;
      }
    }
  }
  return ffi::Error::Success();
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
