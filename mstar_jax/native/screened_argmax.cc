// Greedy argmax over a tied output projection that reads an 8-bit copy of it, not the float32 one.
//
// For each row h of `hidden` [M, E] it returns the word v maximising exact(v), the float32 logit
// computed as one fused multiply-add chain over e = 0..E-1 of h[e] * table[e, v] (`table` is [E, V],
// float32). The screen holds each word's weights as int8 codes in two levels, row-major [V, E]:
//   w[v, e] ~ scales[v] * q[v, e]                      (level 1, |w - that| <= scales[v] / 2)
//   w[v, e] ~ scales[v] * (q[v, e] + r[v, e] / 254)    (level 2)
// with, per word and level, `slack[level, v]`: the largest |w - its level's value| over e plus a bound
// on the float32 chain's own rounding (made by `screen_of`). Each row is rounded to int16 codes,
// h ~ step * k, so that a level's sum over e is an exact integer, and
//   |level(v) - exact(v)| <= slack[level, v] * sum_e |h[e]| + 128 scales[v] * sum_e |h[e] - step k[e]|
// (128 scales[v] bounds the level's weights), plus 2^-50 of the level's value (its products in double)
// and E 2^-148 (underflow). Level 1 reads one byte a weight (a quarter of float32) for every word; a
// word whose upper bound is below the best lower bound cannot win. Level 2 reads the second byte of the
// few left; the still fewer left are computed exactly from `table`. Where too many are left, or a value
// or a bound is not finite (or the chain could overflow float32), every word is computed exactly, with
// IEEE subnormals (not XLA:CPU's flush-to-zero). Ties go to the lowest index; a NaN wins as
// in `jnp.argmax` (the first NaN).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kExactCandidates = 256;
constexpr int64_t kResidualSteps = 254;

// A level-1 sum: an exact integer (|q| <= 127 and |k| <= the code range, whose products summed over E
// stay below 2^31), so its order does not matter and the compiler vectorises it.
__attribute__((noinline)) int32_t LevelOne(const int16_t* __restrict codes, const int8_t* __restrict q,
                                           int64_t width) {
  int32_t total = 0;
  for (int64_t e = 0; e < width; ++e) total += static_cast<int32_t>(codes[e]) * q[e];
  return total;
}

// Level-1 sums of one word for several rows (`codes` [rows, E]): the word's codes widened once, then
// each row's sum a product of two int16 vectors.
__attribute__((noinline)) void LevelOneRows(const int16_t* __restrict codes, const int8_t* __restrict q,
                                            int16_t* __restrict wide, int32_t* __restrict sums, int64_t rows,
                                            int64_t width) {
  for (int64_t e = 0; e < width; ++e) wide[e] = q[e];
  for (int64_t m = 0; m < rows; ++m) {
    const int16_t* k = codes + m * width;
    int32_t total = 0;
    for (int64_t e = 0; e < width; ++e) total += static_cast<int32_t>(k[e]) * wide[e];
    sums[m] = total;
  }
}

int64_t LevelTwo(const int16_t* codes, const int8_t* q, const int8_t* r, int64_t width) {
  int64_t total = 0;
  for (int64_t e = 0; e < width; ++e) {
    total += static_cast<int64_t>(codes[e]) * (kResidualSteps * static_cast<int32_t>(q[e]) + r[e]);
  }
  return total;
}

inline float Exact(const float* h, const float* table, int64_t words, int64_t width, int64_t v) {
  float total = 0.0f;
  for (int64_t e = 0; e < width; ++e) total = std::fma(h[e], table[e * words + v], total);
  return total;
}

// The first index of the largest value seen in index order, or of the first NaN (as jnp.argmax).
struct Best {
  int64_t index = -1;
  float value = 0.0f;
  void Offer(int64_t v, float x) {
    if (index >= 0 && std::isnan(value)) return;
    if (index < 0 || std::isnan(x) || x > value) index = v, value = x;
  }
};

int32_t EveryWord(const float* h, const float* table, int64_t words, int64_t width) {
  std::vector<float> exact(words, 0.0f);
  for (int64_t e = 0; e < width; ++e) {
    const float he = h[e];
    const float* column = table + e * words;
    for (int64_t v = 0; v < words; ++v) exact[v] = std::fma(he, column[v], exact[v]);
  }
  Best best;
  for (int64_t v = 0; v < words; ++v) best.Offer(v, exact[v]);
  return static_cast<int32_t>(best.index);
}

// One row rounded to int16 codes: h ~ step * codes, with what that rounding can move a level's sum.
struct Codes {
  std::vector<int16_t> codes;
  double step = 1.0, size = 0.0, moved = 0.0;  // size: sum |h|; moved: sum |h - step * code|
  bool finite = true;
};

Codes Round(const float* h, int64_t width, int32_t range) {
  Codes row;
  row.codes.resize(width);
  double peak = 0.0;
  for (int64_t e = 0; e < width; ++e) {
    const double x = h[e];
    row.finite = row.finite && std::isfinite(x);
    peak = std::max(peak, std::fabs(x));
    row.size += std::fabs(x);
  }
  if (!row.finite) return row;
  row.step = peak > 0.0 ? peak / range : 1.0;
  for (int64_t e = 0; e < width; ++e) {
    const double code = std::clamp(std::nearbyint(h[e] / row.step), -static_cast<double>(range),
                                   static_cast<double>(range));
    row.codes[e] = static_cast<int16_t>(code);
    row.moved += std::fabs(h[e] - row.step * code);
  }
  return row;
}

struct Screen {
  const int8_t* q;
  const int8_t* r;
  const float* scales;
  const float* slack;  // [2, V]
  const float* table;
  int64_t words, width;
  double underflow;  // E 2^-148
};

// What a level's value of word v can differ by from its float32 chain, for one row.
inline double Bound(const Screen& s, const Codes& row, int level, int64_t v, double value) {
  // |every partial sum of the chain| <= sum_e |h[e] w[v, e]| <= 128 scales[v] sum_e |h[e]|: below 2^127 the
  // chain cannot overflow float32; above, no bound holds (an infinite one sends the row to every word).
  if (128.0 * s.scales[v] * row.size >= 0x1p127) return std::numeric_limits<double>::infinity();
  return s.slack[level * s.words + v] * row.size + 128.0 * s.scales[v] * row.moved + 0x1p-50 * std::fabs(value) +
         s.underflow;
}

inline double LevelOneValue(const Screen& s, const Codes& row, int32_t sum, int64_t v) {
  return static_cast<double>(sum) * row.step * s.scales[v];
}

// IEEE subnormals while alive: XLA:CPU runs a custom call with flush-to-zero and denormals-are-zero
// set, which would make the chain another function than the one promised, and break the underflow term.
class Subnormals {
 public:
#if defined(__SSE__)
  Subnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero)); }
  ~Subnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
  unsigned saved_;
#endif
};

// Runs fn(part, begin, end) over `count` items split into `parts` contiguous parts, one thread each
// (each with IEEE subnormals: a thread inherits its creator's flags, not a guard's).
template <typename Fn>
void Parallel(int64_t parts, int64_t count, Fn fn) {
  const int64_t share = (count + parts - 1) / parts;
  auto run = [&fn](int64_t part, int64_t begin, int64_t end) {
    const Subnormals ieee;
    fn(part, begin, end);
  };
  std::vector<std::thread> pool;
  for (int64_t p = 1; p < parts; ++p) {
    pool.emplace_back(run, p, std::min(count, p * share), std::min(count, (p + 1) * share));
  }
  run(0, 0, std::min(count, share));
  for (auto& thread : pool) thread.join();
}

// Level 2 over a row's level-1 survivors (in index order), then the float32 chain of those still in
// reach: the row's answer.
int32_t Finish(const float* h, const Codes& row, const std::vector<int64_t>& first, const Screen& s) {
  std::vector<double> value(first.size()), reach(first.size());
  double floor = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < first.size(); ++i) {
    const int64_t v = first[i];
    const int64_t sum = LevelTwo(row.codes.data(), s.q + v * s.width, s.r + v * s.width, s.width);
    value[i] = static_cast<double>(sum) * row.step * (s.scales[v] / static_cast<double>(kResidualSteps));
    reach[i] = Bound(s, row, 1, v, value[i]);
    if (!std::isfinite(reach[i])) return EveryWord(h, s.table, s.words, s.width);
    floor = std::max(floor, value[i] - reach[i]);
  }
  Best best;
  int64_t exact = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    if (value[i] + reach[i] < floor) continue;
    if (++exact > kExactCandidates) return EveryWord(h, s.table, s.words, s.width);
    best.Offer(first[i], Exact(h, s.table, s.words, s.width, first[i]));
  }
  return static_cast<int32_t>(best.index);
}

ffi::Error ScreenedArgmaxImpl(ffi::Buffer<ffi::F32> hidden, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::S8> r,
                              ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> slack,
                              ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<ffi::S32> out, int64_t threads) {
  const auto hidden_dims = hidden.dimensions();
  const auto table_dims = table.dimensions();
  if (hidden_dims.size() != 2 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("screened_argmax: hidden and table must be 2-D");
  }
  const int64_t rows = hidden_dims[0], width = hidden_dims[1], words = table_dims[1];
  const auto count = [](const auto& buffer) { return static_cast<int64_t>(buffer.element_count()); };
  if (table_dims[0] != width || count(q) != words * width || count(r) != words * width ||
      count(scales) != words || count(slack) != 2 * words ||
      count(*out) != rows || width < 1 || width > (1 << 20)) {
    return ffi::Error::InvalidArgument("screened_argmax: shapes disagree");
  }
  if (rows == 0 || words == 0) return ffi::Error::Success();
  const Subnormals ieee;
  const Screen s{q.typed_data(), r.typed_data(), scales.typed_data(), slack.typed_data(), table.typed_data(),
                 words, width, width * 0x1p-148};
  // The largest code whose products with q (|q| <= 127) sum over E below 2^31.
  const int32_t range = static_cast<int32_t>(std::min<int64_t>(32767, 2147483647 / (127 * width)));
  std::vector<Codes> codes;
  for (int64_t m = 0; m < rows; ++m) codes.push_back(Round(hidden.typed_data() + m * width, width, range));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, words / 4096 + 1));
  // Level 1, every word once for all rows (a word's codes stay in cache across the rows): its sums,
  // and each part's largest lower bound per row.
  std::vector<int32_t> sums(rows * words);
  std::vector<double> floors(parts * rows, -std::numeric_limits<double>::infinity());
  std::vector<char> finite(parts * rows, 1);
  std::vector<int16_t> all_codes(rows * width);
  for (int64_t m = 0; m < rows; ++m) std::copy(codes[m].codes.begin(), codes[m].codes.end(), &all_codes[m * width]);
  Parallel(parts, words, [&](int64_t part, int64_t begin, int64_t end) {
    // Kept on this thread's stack, written once: neighbouring parts' entries share a cache line.
    std::vector<double> floor(rows, -std::numeric_limits<double>::infinity());
    std::vector<char> ok(rows, 1);
    std::vector<int16_t> wide(width);
    std::vector<int32_t> word(rows);
    for (int64_t v = begin; v < end; ++v) {
      const int8_t* w = s.q + v * width;
      if (rows == 1) {
        word[0] = LevelOne(all_codes.data(), w, width);
      } else {
        LevelOneRows(all_codes.data(), w, wide.data(), word.data(), rows, width);
      }
      for (int64_t m = 0; m < rows; ++m) {
        sums[m * words + v] = word[m];
        const double value = LevelOneValue(s, codes[m], word[m], v), reach = Bound(s, codes[m], 0, v, value);
        ok[m] &= std::isfinite(reach);
        floor[m] = std::max(floor[m], value - reach);
      }
    }
    std::copy(floor.begin(), floor.end(), floors.begin() + part * rows);
    std::copy(ok.begin(), ok.end(), finite.begin() + part * rows);
  });
  // Who reaches the row's largest lower bound (each part's survivors in index order), then the rest.
  std::vector<double> floor(rows, -std::numeric_limits<double>::infinity());
  std::vector<char> screened(rows);
  for (int64_t m = 0; m < rows; ++m) {
    screened[m] = codes[m].finite;
    for (int64_t p = 0; p < parts; ++p) {
      floor[m] = std::max(floor[m], floors[p * rows + m]);
      screened[m] = screened[m] && finite[p * rows + m];
    }
  }
  std::vector<std::vector<int64_t>> kept(parts * rows);
  Parallel(parts, words, [&](int64_t part, int64_t begin, int64_t end) {
    for (int64_t m = 0; m < rows; ++m) {
      if (!screened[m]) continue;
      for (int64_t v = begin; v < end; ++v) {
        const double value = LevelOneValue(s, codes[m], sums[m * words + v], v);
        if (value + Bound(s, codes[m], 0, v, value) >= floor[m]) kept[part * rows + m].push_back(v);
      }
    }
  });
  Parallel(std::min<int64_t>(parts, rows), rows, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* h = hidden.typed_data() + m * width;
      std::vector<int64_t> first;
      for (int64_t p = 0; p < parts && screened[m]; ++p) {
        first.insert(first.end(), kept[p * rows + m].begin(), kept[p * rows + m].end());
      }
      const bool narrowed = screened[m] && static_cast<int64_t>(first.size()) <= words / 4 + 1;
      out->typed_data()[m] = narrowed ? Finish(h, codes[m], first, s) : EveryWord(h, s.table, words, width);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MstarScreenedArgmax, ScreenedArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("threads"));
