// A weight product with the weights kept quantized (xlr_jax/model/quantized.py's
// layouts): out[r, o] = sum_k x[r, k] w[o, k], each weight dequantized in registers as
// it is read, never written out. w is in groups of 32 along k with a float16 scale (and
// for 4 bits a minimum) a group:
//   4 bits  q [n, d / 2] bytes: byte j of a group holds value j (low nibble) and value
//           j + 16 (high nibble); w = scale * q + minimum
//   8 bits  q [n, d] signed bytes; w = scale * q
// A weight row is read once for all the rows of x (up to kMaxRows at a time, one vector
// accumulator each), and output rows are spread over XLA's intra-op threads. Decode (one
// row) reads a quarter (4 bits) or a little over a quarter (8 bits) of f32's bytes.
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_kernels.h"

namespace {

using xlr::hsum;
using xlr::kLanes;
using xlr::load;
using xlr::vf;

constexpr int64_t kGroup = 32;
constexpr int64_t kTaskRows = 16;  // output rows a task computes
// rows of x folded against a weight row at a time: an accumulator each, beside the
// group's dequantized vectors
constexpr int kMaxRows = xlr::kRegisters >= 32 ? 8 : 4;

using xlr::vi;
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));

// unsigned bytes to floats through 32-bit integers: GCC widens and converts a vector at
// a time that way, where a direct byte-to-float conversion is done lane by lane
inline vf to_float(vu8 b) {
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

// A finite IEEE half as a float, without branches: its bits moved into a float's
// places read 2^-112 of its value (subnormals too), so a product by 2^112 restores it
// exactly. (No _Float16: every compiler and target takes this; scales are finite.)
inline float half_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  f *= 0x1p112f;
  return h & 0x8000u ? -f : f;
}

// out[j * n] = x row j . w row (4 bits) for RX rows of x
template <int RX>
void q4_row(const float* x, int64_t d, const uint8_t* q, const uint16_t* scales,
            const uint16_t* minimums, int64_t n, float* out) {
  vf acc[RX] = {}, acc2[RX] = {};  // two chains of multiply-adds a row of x
  for (int64_t g = 0; g < d / kGroup; ++g) {
    const vf scale = vf{} + half_to_float(scales[g]);
    const vf minimum = vf{} + half_to_float(minimums[g]);
    const uint8_t* bytes = q + g * kGroup / 2;
    const float* xg = x + g * kGroup;
    for (int c = 0; c < kGroup / 2 / kLanes; ++c) {
      vu8 b;
      std::memcpy(&b, bytes + c * kLanes, sizeof b);
      const vf lo = to_float(b & 15) * scale + minimum;
      const vf hi = to_float(b >> 4) * scale + minimum;
      for (int j = 0; j < RX; ++j) {
        acc[j] += lo * load(xg + j * d + c * kLanes);
        acc2[j] += hi * load(xg + j * d + kGroup / 2 + c * kLanes);
      }
    }
  }
  for (int j = 0; j < RX; ++j) out[j * n] = hsum(acc[j] + acc2[j]);
}

// the same for 8 bits (minimums unused)
template <int RX>
void q8_row(const float* x, int64_t d, const uint8_t* q, const uint16_t* scales,
            const uint16_t*, int64_t n, float* out) {
  vf acc[RX] = {}, acc2[RX] = {};  // two chains of multiply-adds a row of x
  for (int64_t g = 0; g < d / kGroup; ++g) {
    // a signed byte q is (q ^ 0x80) - 128 read unsigned: GCC widens unsigned bytes a
    // vector at a time but sign-extends lane by lane, so w = scale (q ^ 0x80) - 128 scale
    const float s = half_to_float(scales[g]);
    const vf scale = vf{} + s, offset = vf{} - 128 * s;
    const uint8_t* values = q + g * kGroup;
    const float* xg = x + g * kGroup;
    for (int c = 0; c < kGroup / kLanes; c += 2) {  // kGroup / kLanes is 2, 4 or 8
      vu8 b, b2;
      std::memcpy(&b, values + c * kLanes, sizeof b);
      std::memcpy(&b2, values + (c + 1) * kLanes, sizeof b2);
      const vf w = to_float(b ^ 0x80) * scale + offset;
      const vf w2 = to_float(b2 ^ 0x80) * scale + offset;
      for (int j = 0; j < RX; ++j) {
        acc[j] += w * load(xg + j * d + c * kLanes);
        acc2[j] += w2 * load(xg + j * d + (c + 1) * kLanes);
      }
    }
  }
  for (int j = 0; j < RX; ++j) out[j * n] = hsum(acc[j] + acc2[j]);
}

using RowFn = void (*)(const float*, int64_t, const uint8_t*, const uint16_t*,
                       const uint16_t*, int64_t, float*);

template <int... Rs>
RowFn row_for(int bits, int64_t rows, std::integer_sequence<int, Rs...>) {
  static constexpr RowFn q4[] = {q4_row<Rs + 1>...};
  static constexpr RowFn q8[] = {q8_row<Rs + 1>...};
  return (bits == 4 ? q4 : q8)[rows - 1];
}

}  // namespace

void xlr::quantized_linear(Pool& pool, const QuantizedProduct& p) {
  const int64_t passes = (p.rows + kMaxRows - 1) / kMaxRows;
  const int64_t tasks = (p.n + kTaskRows - 1) / kTaskRows;
  const int64_t groups = p.d / kGroup;
  const int64_t row_bytes = p.bits == 4 ? p.d / 2 : p.d;

  auto run = [&](int64_t t) {
    const int64_t o1 = std::min(p.n, (t + 1) * kTaskRows);
    for (int64_t pass = 0, r = 0; pass < passes; ++pass) {
      const int64_t size = (p.rows - r) / (passes - pass);  // the rest, shared evenly
      const RowFn fold = row_for(p.bits, size, std::make_integer_sequence<int, kMaxRows>{});
      for (int64_t o = t * kTaskRows; o < o1; ++o)
        fold(p.x + r * p.d, p.d, p.q + o * row_bytes, p.scales + o * groups,
             p.minimums ? p.minimums + o * groups : nullptr, p.n, p.out + r * p.n + o);
      r += size;
    }
  };

  xlr::run_tasks(pool, tasks, run);
}
