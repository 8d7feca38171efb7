// Paged attention on the CPU (an XLA FFI custom call through ffi_bindings.cc).
//
// Queries [rows, q_len, heads, dim] (decode: one a row; a prefill chunk or verify rows:
// several of one sequence), f32 pages, GQA. XLA:CPU runs the pure-JAX walk as many small
// ops, one after another, each reading a few pages on one thread, and gathers a chunk's
// pages into copies; this reads every page in place, folds it into an online softmax
// while it is in the cache, and spreads (row, block of query vectors, KV head, run of
// pages) tasks over XLA's intra-op threads.
//
// A row of few query vectors a KV head (decode, short verify rows) folds each K and V
// row once for all of them, a dot product and a horizontal sum per vector; with several
// queries, the slots only some of them see (the causal diagonal, a window's edge) are
// folded query by query. A row of many (a chunk) goes in tiles of query vectors, one a
// lane (16 with AVX-512, 8 with AVX2, 4 elsewhere), against 12 slots at a time: every
// product is a vector multiply-add against one broadcast K or V element, and each lane
// masks the slots it does not see. Semantics are
// paged_attention_xla's: the query at row b, index t sees positions [first[b, t],
// last[b, t]); one that sees nothing gets zeros.
//
// Built with the other kernels by xlr_jax/ops/cpu_build.py (the host's C++ compiler, for
// the CPU it runs on unless told otherwise).
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

using xlr::hsum;
using xlr::kLanes;
using xlr::load;
using xlr::store;
using xlr::vf;
using xlr::vi;

constexpr int64_t kPiecePages = 4;     // pages per task while tasks are few
constexpr int64_t kMaxPageSize = 256;  // slots a page's scores may hold

// exp(x) for x <= 0 on every lane, 0 below -87 (where f32 exp underflows) and for -inf:
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
  constexpr int kV = D / kLanes;
  vf qv[G][kV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kV; ++i) qv[g][i] = load(q + g * D + i * kLanes) * scale;
  alignas(64) float w[G][kMaxPageSize + kLanes];
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = peak[g];
  for (int64_t s = 0; s < slots; ++s) {  // scores: the slot's K row once for all G heads
    vf kr[kV];
    for (int i = 0; i < kV; ++i) kr[i] = load(k + s * D + i * kLanes);
    for (int g = 0; g < G; ++g) {
      vf p = qv[g][0] * kr[0];
      for (int i = 1; i < kV; ++i) p += qv[g][i] * kr[i];
      const float dot = hsum(p);
      w[g][s] = dot;
      m[g] = std::max(m[g], dot);
    }
  }
  const int64_t padded = (slots + kLanes - 1) / kLanes * kLanes;
  vf a[G][kV];
  for (int g = 0; g < G; ++g) {
    for (int64_t s = slots; s < padded; ++s) w[g][s] = -std::numeric_limits<float>::infinity();
    vf sum = vf{};
    for (int64_t s = 0; s < padded; s += kLanes) {
      const vf e = exp_nonpositive(load(w[g] + s) - m[g]);
      store(w[g] + s, e);
      sum += e;
    }
    // 0 while nothing was seen (peak -inf): the first page starts the sums afresh
    const float rescale = std::isinf(peak[g]) ? 0.f : std::exp(peak[g] - m[g]);
    total[g] = total[g] * rescale + hsum(sum);
    peak[g] = m[g];
    for (int i = 0; i < kV; ++i) a[g][i] = load(acc + g * D + i * kLanes) * rescale;
  }
  for (int64_t s = 0; s < slots; ++s) {  // values: the slot's V row once for all G heads
    vf vr[kV];
    for (int i = 0; i < kV; ++i) vr[i] = load(v + s * D + i * kLanes);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < kV; ++i) a[g][i] += w[g][s] * vr[i];
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kV; ++i) store(acc + g * D + i * kLanes, a[g][i]);
}

// A tile: up to 16 query vectors of one KV head (a chunk's or verify rows' queries times
// their group's heads), one per lane of kTileVecs vectors (1 with AVX-512, 2 with AVX2, 4
// elsewhere), each with the positions it sees [lo, hi). Lanes hold queries so that
// scores, the softmax and the values' products are all vector multiply-adds against one K
// or V element broadcast: no horizontal sums. A tile reads each K and V row it sees once
// for all 16 queries, whatever the vector width (tiles of 8 on AVX2 read K and V twice as
// often: chunks ran 1.1-2.8x the walk's time). Its online softmax state: peak and total
// per lane, and the output transposed, ot[D][kTile].
constexpr int kTile = 16;
constexpr int kTileVecs = kTile / kLanes;
struct TileF {
  vf v[kTileVecs];
};
struct TileI {
  vi v[kTileVecs];
};

// The most accumulators of kTileVecs vectors that fit the registers beside one such row
// and a broadcast element, at most `cap`.
constexpr int tile_fit(int cap) {
  const int n = (xlr::kRegisters - kTileVecs - 1) / kTileVecs;
  return n < cap ? n : cap;
}
constexpr int floor_pow2(int n) { return n < 2 ? 1 : 2 * floor_pow2(n / 2); }

constexpr int kTileSlots = tile_fit(12);  // slots a scores pass takes (AVX-512 12, AVX2 6)
// dims of the output a values pass takes (a power of two: it divides every head dim)
constexpr int kTileDims = floor_pow2(tile_fit(16));

// scores[s] (a lane each) = qt . K row s for R slots at a time: R accumulator rows while
// qt's D rows stream past them
template <int D, int R>
void tile_scores(const float* qt, const float* k, float* scores) {
  vf acc[R][kTileVecs] = {};
  for (int d = 0; d < D; ++d) {
    vf qv[kTileVecs];
    for (int j = 0; j < kTileVecs; ++j) qv[j] = load(qt + d * kTile + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const float kd = k[i * D + d];
      for (int j = 0; j < kTileVecs; ++j) acc[i][j] += qv[j] * kd;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < kTileVecs; ++j) store(scores + i * kTile + j * kLanes, acc[i][j]);
}

template <int D, int... Rs>
void tile_scores_tail(const float* qt, const float* k, float* scores, int64_t n,
                      std::integer_sequence<int, Rs...>) {
  using Fn = void (*)(const float*, const float*, float*);
  static constexpr Fn table[] = {tile_scores<D, Rs + 1>...};
  table[n - 1](qt, k, scores);
}

// A row's query vectors a KV head from which tiles pay: at 12 and more a tile took
// 0.51-0.83x the time of blocks of whole queries folding each slot with a horizontal sum
// per query vector; at 6 (2 queries of 3 heads) 1.65x.
constexpr int64_t kTileVectors = 12;

// Fold `slots` consecutive slots of one page (K and V rows of D floats, the first at
// position pos0) into the tile's online softmax.
// Every lane sees positions [all_lo, all_hi): slots inside it skip the mask.
template <int D>
void fold_tile(const float* qt, const float* k, const float* v, int64_t slots, int64_t pos0,
               const TileI& lo, const TileI& hi, int64_t all_lo, int64_t all_hi, TileF& peak,
               TileF& total, float* ot) {
  alignas(64) float w[kMaxPageSize * kTile];
  int64_t s = 0;
  for (; s + kTileSlots <= slots; s += kTileSlots)
    tile_scores<D, kTileSlots>(qt, k + s * D, w + s * kTile);
  if (s < slots)
    tile_scores_tail<D>(qt, k + s * D, w + s * kTile, slots - s,
                        std::make_integer_sequence<int, kTileSlots - 1>{});
  const vf none = vf{} - std::numeric_limits<float>::infinity();
  const bool masked = pos0 < all_lo || pos0 + slots > all_hi;
  vf rescale[kTileVecs];
  for (int j = 0; j < kTileVecs; ++j) {
    float* wj = w + j * kLanes;
    vf m = peak.v[j];
    for (s = 0; s < slots; ++s) {  // a lane's slots outside its range count for nothing
      vf x = load(wj + s * kTile);
      if (masked) {
        const vi pos = vi{} + static_cast<int32_t>(pos0 + s);
        x = (pos >= lo.v[j]) & (pos < hi.v[j]) ? x : none;
        store(wj + s * kTile, x);
      }
      m = m > x ? m : x;
    }
    // a lane that has seen nothing yet keeps a base of 0: its exps are then exp(-inf) = 0
    const vf base = m == none ? vf{} : m;
    rescale[j] = exp_nonpositive(peak.v[j] - base);
    vf sum = vf{};
    for (s = 0; s < slots; ++s) {
      const vf e = exp_nonpositive(load(wj + s * kTile) - base);
      store(wj + s * kTile, e);
      sum += e;
    }
    total.v[j] = total.v[j] * rescale[j] + sum;
    peak.v[j] = m;
  }
  for (int d0 = 0; d0 < D; d0 += kTileDims) {  // ot[d] += sum_s w[s] V[s, d]
    vf acc[kTileDims][kTileVecs];
    for (int i = 0; i < kTileDims; ++i)
      for (int j = 0; j < kTileVecs; ++j)
        acc[i][j] = load(ot + (d0 + i) * kTile + j * kLanes) * rescale[j];
    for (s = 0; s < slots; ++s) {
      vf ws[kTileVecs];
      for (int j = 0; j < kTileVecs; ++j) ws[j] = load(w + s * kTile + j * kLanes);
      for (int i = 0; i < kTileDims; ++i) {
        const float vd = v[s * D + d0 + i];
        for (int j = 0; j < kTileVecs; ++j) acc[i][j] += ws[j] * vd;
      }
    }
    for (int i = 0; i < kTileDims; ++i)
      for (int j = 0; j < kTileVecs; ++j) store(ot + (d0 + i) * kTile + j * kLanes, acc[i][j]);
  }
}

using TileFn = void (*)(const float*, const float*, const float*, int64_t, int64_t,
                        const TileI&, const TileI&, int64_t, int64_t, TileF&, TileF&, float*);

TileFn tile_for(int64_t dim) {
  switch (dim) {
    case 32: return fold_tile<32>;
    case 64: return fold_tile<64>;
    case 128: return fold_tile<128>;
    case 256: return fold_tile<256>;
    default: return nullptr;
  }
}

using FoldFn = void (*)(const float*, const float*, const float*, int64_t, float, float*,
                        float*, float*);

// query vectors folded together: a KV head's group (1-8 query heads) times the queries
// of a block. A block has fewer than kTileVectors (past that, tiles take the row), so 8
// at most.
constexpr int kMaxFold = 8;

template <int D, int... Ns>
FoldFn fold_for_size(int64_t n, std::integer_sequence<int, Ns...>) {
  static constexpr FoldFn table[] = {fold_slots<Ns + 1, D>...};
  return n >= 1 && n <= kMaxFold ? table[n - 1] : nullptr;
}

template <int D>
FoldFn fold_for_size(int64_t n) {
  return fold_for_size<D>(n, std::make_integer_sequence<int, kMaxFold>{});
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

// queries a block folds together: the most, up to q_len, whose query heads make a fold
// size
int64_t block_queries(int64_t group, int64_t q_len) {
  return std::max<int64_t>(std::min<int64_t>(kMaxFold / group, q_len), 1);
}

}  // namespace

const char* xlr::paged_attention(Pool& pool, const Attention& a) {
  const int64_t rows = a.rows, q_len = a.q_len, heads = a.heads, dim = a.dim;
  const int64_t num_pages = a.pages, kv_heads = a.kv_heads, page_size = a.page_size;
  const int64_t width = a.width;
  const int64_t group = kv_heads > 0 ? heads / kv_heads : 0;
  const int64_t per_row = q_len * group;  // a row's query vectors per KV head
  const bool tiled = per_row >= kTileVectors;  // never decode: a group is at most 8
  const int64_t block = block_queries(std::max<int64_t>(group, 1), q_len);
  const FoldFn fold_row = group * kv_heads == heads ? fold_for(group, dim) : nullptr;
  const FoldFn fold_block = fold_row ? fold_for(block * group, dim) : nullptr;
  const TileFn fold_tiles = fold_row ? tile_for(dim) : nullptr;
  if ((tiled ? fold_tiles == nullptr : fold_block == nullptr) || page_size > kMaxPageSize)
    return "paged attention: unsupported shape (head dim 32, 64, 128 or 256, at most 8 query "
           "heads per KV head, pages of at most 256 slots)";
  const float *kp = a.k, *vp = a.v, *qp = a.q;
  const int32_t* tp = a.tables;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));

  // each query's positions seen [lo, hi), inside its row's block table (empty: none)
  const int64_t queries = rows * q_len;
  std::vector<int64_t> lo(queries), hi(queries);
  for (int64_t i = 0; i < queries; ++i) {
    hi[i] = std::min<int64_t>(std::max(a.last[i], 0), width * page_size);
    lo[i] = std::clamp<int64_t>(a.first[i], 0, hi[i]);
  }
  // A block: `folded` consecutive query vectors of a row and KV head, in [query][group
  // head] order: a tile of kTile, or `block` whole queries. Each (block, KV head) walks the
  // union of its queries' ranges in pieces: of kPiecePages pages while there are few
  // blocks, so that every thread has work, else whole.
  const int64_t folded = tiled ? kTile : block * group;
  const int64_t blocks_per_row = (per_row + folded - 1) / folded, blocks = rows * blocks_per_row;
  const int64_t piece_pages = blocks * kv_heads >= 16 ? width : kPiecePages;
  std::vector<int64_t> seen_lo(blocks), seen_hi(blocks), pieces(blocks), block_task(blocks + 1);
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t b = k / blocks_per_row, v0 = (k % blocks_per_row) * folded;
    int64_t u0 = width * page_size, u1 = 0;
    const int64_t t1 = (std::min(v0 + folded, per_row) - 1) / group;  // its last query
    for (int64_t i = b * q_len + v0 / group; i <= b * q_len + t1; ++i) {
      if (hi[i] > lo[i]) u0 = std::min(u0, lo[i]), u1 = std::max(u1, hi[i]);
    }
    seen_lo[k] = u1 > u0 ? u0 : 0, seen_hi[k] = std::max(u1, seen_lo[k]);
    const int64_t pages = (seen_hi[k] + page_size - 1) / page_size - seen_lo[k] / page_size;
    pieces[k] = std::max<int64_t>((pages + piece_pages - 1) / piece_pages, 1);
    block_task[k + 1] = block_task[k] + kv_heads * pieces[k];
  }
  const int64_t tasks = block_task[blocks];
  const int64_t stride = folded * (dim + 2);  // a task's peak, total, acc[folded][dim]
  std::vector<float> partial(tasks * stride);

  // positions [from, to) on the pages of a block's piece, page by page, to fold(K and
  // V at the first position's slot, count, the first position); only the pages the
  // range touches are visited (a decode row's per-query ranges are mostly empty)
  auto walk = [&](int64_t k, int64_t b, int64_t h, int64_t piece, int64_t from, int64_t to,
                  auto&& fold) {
    const int64_t p0 = seen_lo[k] / page_size + piece * piece_pages;
    const int64_t p1 = std::min({p0 + piece_pages, width, (to + page_size - 1) / page_size});
    for (int64_t p = std::max(p0, from / page_size); p < p1; ++p) {
      const int64_t page = tp[b * width + p];
      if (page < 0 || page >= num_pages) continue;  // out of the pool: nothing to read
      const int64_t start = p * page_size, at = (page * kv_heads + h) * page_size;
      const int64_t s0 = std::max(from, start), s1 = std::min(to, start + page_size);
      if (s1 > s0) fold(kp + (at + s0 - start) * dim, vp + (at + s0 - start) * dim, s1 - s0, s0);
    }
  };

  auto run_tile = [&](int64_t k, int64_t b, int64_t h, int64_t piece, float* part) {
    const int64_t v0 = (k % blocks_per_row) * folded, n = std::min(folded, per_row - v0);
    alignas(64) float qt[256 * kTile], ot[256 * kTile];
    // a short tile's spare lanes repeat its last vector (folded, never merged)
    TileI tile_lo, tile_hi;
    int64_t all_lo = 0, all_hi = width * page_size;
    for (int64_t l = 0; l < kTile; ++l) {
      const int64_t v = v0 + std::min(l, n - 1), i = b * q_len + v / group;
      const float* qv = qp + (i * heads + h * group + v % group) * dim;
      for (int64_t d = 0; d < dim; ++d) qt[d * kTile + l] = qv[d] * scale;
      tile_lo.v[l / kLanes][l % kLanes] = static_cast<int32_t>(lo[i]);
      tile_hi.v[l / kLanes][l % kLanes] = static_cast<int32_t>(hi[i]);
      all_lo = std::max(all_lo, lo[i]), all_hi = std::min(all_hi, hi[i]);
    }
    std::fill(ot, ot + dim * kTile, 0.f);
    TileF peak, total;
    for (int j = 0; j < kTileVecs; ++j)
      peak.v[j] = vf{} - std::numeric_limits<float>::infinity(), total.v[j] = vf{};
    walk(k, b, h, piece, seen_lo[k], seen_hi[k],
         [&](const float* kr, const float* vr, int64_t count, int64_t pos) {
           fold_tiles(qt, kr, vr, count, pos, tile_lo, tile_hi, all_lo, all_hi, peak, total,
                      ot);
         });
    for (int64_t l = 0; l < kTile; ++l) {
      part[l] = peak.v[l / kLanes][l % kLanes], part[folded + l] = total.v[l / kLanes][l % kLanes];
      for (int64_t d = 0; d < dim; ++d) part[2 * folded + l * dim + d] = ot[d * kTile + l];
    }
  };

  auto run_block = [&](int64_t k, int64_t b, int64_t h, int64_t piece, float* part) {
    const int64_t q0 = b * q_len + (k % blocks_per_row) * block;
    const int64_t n = std::min(block, (b + 1) * q_len - q0);  // the block's queries
    float *peak = part, *total = part + folded, *acc = part + 2 * folded;
    // the block's query vectors, [query][group head][dim]; a short block repeats its
    // last query (folded, never merged)
    alignas(64) float qbuf[16 * 256];
    for (int64_t j = 0; j < block; ++j)
      std::copy_n(qp + ((q0 + std::min(j, n - 1)) * heads + h * group) * dim, group * dim,
                  qbuf + j * group * dim);
    // slots every query of the block sees: folded once for all of them
    int64_t c0 = 0, c1 = width * page_size;
    for (int64_t j = 0; j < n; ++j) c0 = std::max(c0, lo[q0 + j]), c1 = std::min(c1, hi[q0 + j]);
    if (c1 > c0)
      walk(k, b, h, piece, c0, c1, [&](const float* kr, const float* vr, int64_t count, int64_t) {
        fold_block(qbuf, kr, vr, count, scale, peak, total, acc);
      });
    for (int64_t j = 0; j < n; ++j) {  // each query's slots outside the shared ones
      const int64_t g = j * group;
      auto fold = [&](int64_t from, int64_t to) {
        walk(k, b, h, piece, from, to, [&](const float* kr, const float* vr, int64_t count,
                                           int64_t) {
          fold_row(qbuf + g * dim, kr, vr, count, scale, peak + g, total + g, acc + g * dim);
        });
      };
      if (c1 > c0) {
        fold(lo[q0 + j], std::min(c0, hi[q0 + j]));
        fold(std::max(c1, lo[q0 + j]), hi[q0 + j]);
      } else {
        fold(lo[q0 + j], hi[q0 + j]);
      }
    }
  };

  xlr::run_tasks(pool, tasks, [&](int64_t t) {
    const int64_t k = std::upper_bound(block_task.begin(), block_task.end(), t) -
                      block_task.begin() - 1;
    const int64_t h = (t - block_task[k]) / pieces[k], piece = (t - block_task[k]) % pieces[k];
    float* part = partial.data() + t * stride;
    std::fill(part, part + folded, -std::numeric_limits<float>::infinity());
    std::fill(part + folded, part + stride, 0.f);
    if (tiled)
      run_tile(k, k / blocks_per_row, h, piece, part);
    else
      run_block(k, k / blocks_per_row, h, piece, part);
  });

  // each query vector: its block's pieces' softmaxes merged
  float* op = a.out;
  for (int64_t i = 0; i < queries; ++i) {
    const int64_t b = i / q_len;
    for (int64_t hq = 0; hq < heads; ++hq) {
      const int64_t h = hq / group, v = (i % q_len) * group + hq % group;
      const int64_t k = b * blocks_per_row + v / folded, j = v % folded;
      const float* part = partial.data() + (block_task[k] + h * pieces[k]) * stride;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t x = 0; x < pieces[k]; ++x) m = std::max(m, part[x * stride + j]);
      float* o = op + (i * heads + hq) * dim;
      std::fill(o, o + dim, 0.f);
      if (std::isinf(m)) continue;  // sees nothing: zeros
      float sum = 0.f;
      for (int64_t x = 0; x < pieces[k]; ++x) {
        const float* pk = part + x * stride;
        const float w = std::exp(pk[j] - m);
        sum += pk[folded + j] * w;
        const float* acc = pk + 2 * folded + j * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] += w * acc[d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= sum;
    }
  }
  return nullptr;
}
