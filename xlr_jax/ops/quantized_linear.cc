// A weight product with the weights kept quantized (xlr_jax/model/quantized.py's
// layouts): out[r, o] = sum_k x[r, k] w[o, k], each weight dequantized in registers as
// it is read, never written out. w is in groups of `group` values along k, each with a
// scale (and for 4 bits a minimum), float16 or float32:
//   4 bits  q [n, d / 2] bytes: byte j of a group holds value j (low nibble) and value
//           j + group / 2 (high nibble); w = scale * q + minimum
//   8 bits  q [n, d] signed bytes; w = scale * q
//   fp8     q [n, d] e4m3 bytes; w = scale * q
// Up to kMaxRows rows of x (decode, verify rows) a weight row is read once for all of
// them, one vector accumulator each; more rows (a prefill chunk) run down a dequantized
// tile (tile_rows). Output rows are spread over XLA's intra-op threads. Decode reads a
// quarter (4 bits) or a little over a quarter (8 bits) of f32's bytes.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

using xlr::hsum;
using xlr::kLanes;
using xlr::load;
using xlr::Values;
using xlr::vf;
using xlr::vi;

constexpr int64_t kTaskRows = 16;  // the fewest output rows a task computes
// rows of x folded against a weight row at a time: an accumulator each, beside the
// group's dequantized vectors
// (past it a weight row would be dequantized again for each pass: tile_rows instead)
constexpr int kMaxRows = xlr::kRegisters >= 32 ? 8 : 4;

typedef uint8_t vu8 __attribute__((vector_size(kLanes)));

// unsigned bytes to floats through 32-bit integers: GCC widens and converts a vector at
// a time that way, where a direct byte-to-float conversion is done lane by lane
inline vf to_float(vu8 b) {
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

inline vf bits_as_float(vi bits) {
  vf f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fp8 e4m3 bytes as floats, exactly: a normal value's exponent and mantissa moved to a
// float's places with the exponent's bias raised from 7 to 127, a subnormal one (exponent
// 0) as its mantissa times 2^-9, then the sign. Bit operations only, so no float
// subnormal arises (a CPU flushing them would zero the smallest weights).
inline vf fp8_to_float(vu8 b) {
  // bytes to 32-bit integers by way of floats, flipped and back: GCC widens and
  // converts bytes a vector at a time only after a vector operation on them
  const vi v = __builtin_convertvector(to_float(b ^ 0x80), vi) ^ 0x80;
  const vi magnitude = v & 0x7f;
  const vi normal = (magnitude << 20) + ((127 - 7) << 23);
  vi subnormal;
  const vf small = __builtin_convertvector(magnitude, vf) * 0x1p-9f;
  std::memcpy(&subnormal, &small, sizeof subnormal);
  const vi is_normal = magnitude >= 8;  // all ones where the exponent is not 0
  return bits_as_float((normal & is_normal) | (subnormal & ~is_normal) | ((v & 0x80) << 24));
}

// A finite IEEE half as a float, without branches: its bits moved into a float's
// places read 2^-112 of its value (subnormals too), so a product by 2^112 restores it
// exactly. (No _Float16: every compiler and target takes this; scales are finite.)
inline float to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  f *= 0x1p112f;
  return h & 0x8000u ? -f : f;
}

inline float to_float(float s) { return s; }

// kLanes bytes of a 4-bit group as floats: the low nibbles' values and the high ones'
inline void nibble_values(const uint8_t* p, vf scale, vf minimum, vf& lo, vf& hi) {
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  lo = to_float(b & 15) * scale + minimum;
  hi = to_float(b >> 4) * scale + minimum;
}

// out[j * n] = x row j . w row (4 bits) for RX rows of x; S the scales' type
template <int RX, typename S>
void q4_row(const float* x, int64_t d, int64_t group, const uint8_t* q, const S* scales,
            const S* minimums, int64_t n, float* out) {
  vf acc[RX] = {}, acc2[RX] = {};  // two chains of multiply-adds a row of x
  const int64_t half = group / 2;
  for (int64_t g = 0; g < d / group; ++g) {
    const vf scale = xlr::splat(to_float(scales[g]));
    const vf minimum = xlr::splat(to_float(minimums[g]));
    const uint8_t* bytes = q + g * half;
    const float* xg = x + g * group;
    for (int64_t c = 0; c < half; c += kLanes) {
      vf lo, hi;
      nibble_values(bytes + c, scale, minimum, lo, hi);
      for (int j = 0; j < RX; ++j) {
        acc[j] += lo * load(xg + j * d + c);
        acc2[j] += hi * load(xg + j * d + half + c);
      }
    }
  }
  for (int j = 0; j < RX; ++j) out[j * n] = hsum(acc[j] + acc2[j]);
}

// kLanes bytes of an 8-bit row as floats: scale * q
template <Values V>
inline vf byte_values(const uint8_t* p, vf scale, vf offset) {
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  if constexpr (V == Values::kFp8) {
    return fp8_to_float(b) * scale;
  } else {
    // a signed byte q is (q ^ 0x80) - 128 read unsigned: GCC widens unsigned bytes a
    // vector at a time but sign-extends lane by lane; offset is -128 scale
    return to_float(b ^ 0x80) * scale + offset;
  }
}

// the same for 8-bit values, integers or fp8 (minimums unused)
template <Values V, int RX, typename S>
void q8_row(const float* x, int64_t d, int64_t group, const uint8_t* q, const S* scales,
            const S*, int64_t n, float* out) {
  vf acc[RX] = {}, acc2[RX] = {};  // two chains of multiply-adds a row of x
  for (int64_t g = 0; g < d / group; ++g) {
    const float s = to_float(scales[g]);
    const vf scale = xlr::splat(s), offset = xlr::splat(-128 * s);
    const uint8_t* values = q + g * group;
    const float* xg = x + g * group;
    int64_t c = 0;
    for (; c + 2 * kLanes <= group; c += 2 * kLanes) {
      const vf w = byte_values<V>(values + c, scale, offset);
      const vf w2 = byte_values<V>(values + c + kLanes, scale, offset);
      for (int j = 0; j < RX; ++j) {
        acc[j] += w * load(xg + j * d + c);
        acc2[j] += w2 * load(xg + j * d + c + kLanes);
      }
    }
    if (c < group) {  // a group of an odd number of vectors: its last one, then the
      const vf w = byte_values<V>(values + c, scale, offset);  // chains trade places
      for (int j = 0; j < RX; ++j) {
        acc[j] += w * load(xg + j * d + c);
        std::swap(acc[j], acc2[j]);
      }
    }
  }
  for (int j = 0; j < RX; ++j) out[j * n] = hsum(acc[j] + acc2[j]);
}

template <typename S>
using RowFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, const S*, const S*,
                       int64_t, float*);

// A weight row as floats (out [d]), each value as the row functions compute it
template <typename S>
void dequantize_row(Values values, const uint8_t* q, const S* scales, const S* minimums,
                    int64_t d, int64_t group, float* out) {
  for (int64_t g = 0; g < d / group; ++g) {
    const float s = to_float(scales[g]);
    const vf scale = xlr::splat(s);
    float* og = out + g * group;
    if (values == Values::kInt4) {
      const vf minimum = xlr::splat(to_float(minimums[g]));
      const int64_t half = group / 2;
      for (int64_t c = 0; c < half; c += kLanes) {
        vf lo, hi;
        nibble_values(q + g * half + c, scale, minimum, lo, hi);
        xlr::store(og + c, lo);
        xlr::store(og + half + c, hi);
      }
    } else {
      const vf offset = xlr::splat(-128 * s);
      for (int64_t c = 0; c < group; c += kLanes)
        xlr::store(og + c, values == Values::kFp8
                               ? byte_values<Values::kFp8>(q + g * group + c, scale, offset)
                               : byte_values<Values::kInt8>(q + g * group + c, scale, offset));
    }
  }
}

template <typename S, int... Rs>
RowFn<S> row_for(Values values, int64_t rows, std::integer_sequence<int, Rs...>) {
  static constexpr RowFn<S> q4[] = {q4_row<Rs + 1, S>...};
  static constexpr RowFn<S> q8[] = {q8_row<Values::kInt8, Rs + 1, S>...};
  static constexpr RowFn<S> f8[] = {q8_row<Values::kFp8, Rs + 1, S>...};
  return (values == Values::kInt4 ? q4 : values == Values::kInt8 ? q8 : f8)[rows - 1];
}

// Many rows of x (a prefill chunk): a task's kTile weight rows are dequantized once into
// a tile stored k-major (wt [d][kTile]: the rows' k-th values side by side), and each row
// of x runs down it: out[r, kTile columns] += x[r, k] * wt[k], kTileRows rows of x at a
// time, one accumulator per row and vector of columns. No horizontal sums, no stride.
// At least two vectors across: with one (16 columns of AVX-512) a k step loads as many
// values as it multiplies; 32 columns there prefilled 1,024 tokens in 0.87-0.96x f32's
// time against 1.09x with 16 (Zen 5, experiments/quantized_weights.py).
constexpr int kTile = std::max(16, 2 * kLanes);  // weight rows (output columns) a tile holds
constexpr int kTileVectors = kTile / kLanes;  // vectors across a tile's row
constexpr int kTileRows = std::min(12, (xlr::kRegisters - kTileVectors - 2) / kTileVectors);

// out[r * n + c] (c < columns) = x row r . tile column c for R rows of x
template <int R>
void tile_rows(const float* x, int64_t d, const float* wt, int64_t n, int64_t columns,
               float* out) {
  vf acc[R][kTileVectors] = {};
  for (int64_t k = 0; k < d; ++k) {
    vf w[kTileVectors];
    for (int v = 0; v < kTileVectors; ++v) w[v] = load(wt + k * kTile + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const vf xv = xlr::splat(x[r * d + k]);
      for (int v = 0; v < kTileVectors; ++v) acc[r][v] += xv * w[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kTile];
    std::memcpy(row, acc[r], sizeof row);
    std::memcpy(out + r * n, row, columns * sizeof(float));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);

template <int... Rs>
TileFn tile_for(int64_t rows, std::integer_sequence<int, Rs...>) {
  static constexpr TileFn table[] = {tile_rows<Rs + 1>...};
  return table[rows - 1];
}

template <typename S>
void product(xlr::Pool& pool, const xlr::QuantizedProduct& p) {
  const int64_t groups = p.d / p.group;
  const int64_t row_bytes = p.values == Values::kInt4 ? p.d / 2 : p.d;
  const S* scales = static_cast<const S*>(p.scales);
  const S* minimums = static_cast<const S*>(p.minimums);

  if (p.rows > kMaxRows) {  // see tile_rows
    xlr::run_tasks(pool, (p.n + kTile - 1) / kTile, [&](int64_t t) {
      const int64_t o0 = t * kTile, columns = std::min(p.n - o0, int64_t{kTile});
      // the tile's rows as dequantized (zeros past the last), then k-major
      std::vector<float> rows(kTile * p.d), wt(kTile * p.d);
      for (int64_t c = 0; c < columns; ++c)
        dequantize_row(p.values, p.q + (o0 + c) * row_bytes, scales + (o0 + c) * groups,
                       minimums ? minimums + (o0 + c) * groups : nullptr, p.d, p.group,
                       rows.data() + c * p.d);
      for (int64_t k = 0; k < p.d; ++k)
        for (int c = 0; c < kTile; ++c) wt[k * kTile + c] = rows[c * p.d + k];
      for (int64_t r = 0; r < p.rows; r += kTileRows) {
        const int64_t size = std::min<int64_t>(kTileRows, p.rows - r);
        tile_for(size, std::make_integer_sequence<int, kTileRows>{})(
            p.x + r * p.d, p.d, wt.data(), p.n, columns, p.out + r * p.n + o0);
      }
    });
    return;
  }

  const RowFn<S> fold =
      row_for<S>(p.values, p.rows, std::make_integer_sequence<int, kMaxRows>{});
  const int64_t per_task = xlr::rows_per_task(pool, p.n, kTaskRows);
  xlr::run_tasks(pool, (p.n + per_task - 1) / per_task, [&](int64_t t) {
    for (int64_t o = t * per_task; o < std::min(p.n, (t + 1) * per_task); ++o)
      fold(p.x, p.d, p.group, p.q + o * row_bytes, scales + o * groups,
           minimums ? minimums + o * groups : nullptr, p.n, p.out + o);
  });
}

}  // namespace

void xlr::quantized_linear(Pool& pool, const QuantizedProduct& p) {
  if (p.f32_scales)
    product<float>(pool, p);
  else
    product<uint16_t>(pool, p);
}
