#include "tokens.h"

#include <algorithm>
#include <array>

namespace kvmem {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kMix2 = 0x94D049BB133111EBULL;
constexpr uint32_t kMul1 = 0x9E3779B1U;
constexpr uint32_t kMul2 = 0x85EBCA77U;
constexpr int32_t kOutputLow = 10, kOutputHigh = 32000;  // traces.OUTPUT_ID_LOW, OUTPUT_ID_HIGH

std::array<uint32_t, kBlockSize> position_keys() {
  std::array<uint32_t, kBlockSize> keys{};
  for (int64_t k = 0; k < kBlockSize; ++k) keys[k] = static_cast<uint32_t>(TraceTokens::mix64(k + kMix2) >> 32);
  return keys;
}

const std::array<uint32_t, kBlockSize> kPositionKeys = position_keys();

// Python's random.Random: MT19937 seeded by init_by_array with the seed's 32-bit digits, least significant first.
class MersenneTwister {
 public:
  explicit MersenneTwister(uint64_t seed) {
    uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
    init_by_array(key, (seed >> 32) ? 2 : 1);
  }

  uint32_t next() {
    if (index_ >= kN) generate();
    uint32_t y = state_[index_++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9D2C5680U;
    y ^= (y << 15) & 0xEFC60000U;
    y ^= y >> 18;
    return y;
  }

 private:
  static constexpr int kN = 624, kM = 397;

  void init_genrand(uint32_t s) {
    state_[0] = s;
    for (int i = 1; i < kN; ++i) state_[i] = 1812433253U * (state_[i - 1] ^ (state_[i - 1] >> 30)) + i;
    index_ = kN;
  }

  void init_by_array(const uint32_t* key, int length) {
    init_genrand(19650218U);
    int i = 1, j = 0;
    for (int k = std::max(kN, length); k; --k) {
      state_[i] = (state_[i] ^ ((state_[i - 1] ^ (state_[i - 1] >> 30)) * 1664525U)) + key[j] + j;
      ++i;
      ++j;
      if (i >= kN) {
        state_[0] = state_[kN - 1];
        i = 1;
      }
      if (j >= length) j = 0;
    }
    for (int k = kN - 1; k; --k) {
      state_[i] = (state_[i] ^ ((state_[i - 1] ^ (state_[i - 1] >> 30)) * 1566083941U)) - i;
      ++i;
      if (i >= kN) {
        state_[0] = state_[kN - 1];
        i = 1;
      }
    }
    state_[0] = 0x80000000U;
  }

  void generate() {
    static const uint32_t mag01[2] = {0U, 0x9908B0DFU};
    int k = 0;
    uint32_t y;
    for (; k < kN - kM; ++k) {
      y = (state_[k] & 0x80000000U) | (state_[k + 1] & 0x7FFFFFFFU);
      state_[k] = state_[k + kM] ^ (y >> 1) ^ mag01[y & 1U];
    }
    for (; k < kN - 1; ++k) {
      y = (state_[k] & 0x80000000U) | (state_[k + 1] & 0x7FFFFFFFU);
      state_[k] = state_[k + (kM - kN)] ^ (y >> 1) ^ mag01[y & 1U];
    }
    y = (state_[kN - 1] & 0x80000000U) | (state_[0] & 0x7FFFFFFFU);
    state_[kN - 1] = state_[kM - 1] ^ (y >> 1) ^ mag01[y & 1U];
    index_ = 0;
  }

  uint32_t state_[kN];
  int index_ = kN;
};

}  // namespace

uint64_t TraceTokens::mix64(uint64_t z) {
  z ^= z >> 30;
  z *= kMix1;
  z ^= z >> 27;
  z *= kMix2;
  z ^= z >> 31;
  return z;
}

int32_t TraceTokens::block_token(uint64_t mixed, int64_t offset) {
  uint32_t z = static_cast<uint32_t>(mixed) ^ kPositionKeys[offset];
  z *= kMul1;
  z ^= static_cast<uint32_t>(mixed >> 32);
  z *= kMul2;
  return static_cast<int32_t>(z >> 2);
}

uint64_t TraceTokens::mixed_block(int32_t r, int64_t block) const {
  return mix64(static_cast<uint64_t>(hash_ids_[block_offsets_[r] + block]) + kGolden);
}

void TraceTokens::set_blocks(const int64_t* hash_ids, const int64_t* block_offsets, const int64_t* input_lens,
                             int64_t n) {
  blocks_ = true;
  hash_ids_ = hash_ids;
  block_offsets_ = block_offsets;
  input_len_.assign(input_lens, input_lens + n);
}

void TraceTokens::set_prompts(const int32_t* tokens, const int64_t* offsets, int64_t n) {
  blocks_ = false;
  prompt_tokens_ = tokens;
  prompt_offsets_ = offsets;
  input_len_.resize(n);
  for (int64_t r = 0; r < n; ++r) input_len_[r] = offsets[r + 1] - offsets[r];
}

void TraceTokens::set_outputs(const int64_t* output_lens, const uint64_t* seeds, const int32_t* explicit_tokens,
                              const int64_t* explicit_offsets) {
  const int64_t n = size();
  output_len_.assign(output_lens, output_lens + n);
  seeds_.assign(seeds, seeds + n);
  explicit_tokens_ = explicit_tokens;
  explicit_offsets_ = explicit_offsets;
  out_tokens_.clear();
  out_start_.assign(n, -1);
}

void TraceTokens::take_output(int32_t r) {
  if (out_start_[r] >= 0) return;
  const int64_t start = static_cast<int64_t>(out_tokens_.size());
  out_tokens_.resize(start + output_len_[r]);
  int32_t* out = out_tokens_.data() + start;
  if (explicit_offsets_[r + 1] > explicit_offsets_[r]) {
    std::copy(explicit_tokens_ + explicit_offsets_[r], explicit_tokens_ + explicit_offsets_[r + 1], out);
  } else {
    draw_outputs(seeds_[r], output_len_[r], out);
  }
  out_start_[r] = start;
}

int64_t TraceTokens::first_mismatch(int32_t a, int32_t b, int64_t from, int64_t to) const {
  if (a == b) return to;
  const int64_t na = input_len_[a], nb = input_len_[b];
  int64_t p = from;
  while (p < to) {
    // A run where each side stays in one region: a prompt block (or the whole explicit prompt), or the output.
    int64_t end = to;
    for (int64_t n : {na, nb}) {
      if (p < n) end = std::min(end, blocks_ ? std::min(n, (p / kBlockSize + 1) * kBlockSize) : n);
    }
    if (blocks_ && p < na && p < nb) {
      const int64_t block = p / kBlockSize;
      const int64_t ha = hash_ids_[block_offsets_[a] + block], hb = hash_ids_[block_offsets_[b] + block];
      if (ha == hb) {  // the same block: equal tokens (a partial last block is a prefix of them)
        p = end;
        continue;
      }
      const uint64_t ma = mix64(static_cast<uint64_t>(ha) + kGolden), mb = mix64(static_cast<uint64_t>(hb) + kGolden);
      for (; p < end; ++p) {
        if (block_token(ma, p % kBlockSize) != block_token(mb, p % kBlockSize)) return p;
      }
      continue;
    }
    if (!blocks_ && p < na && p < nb) {
      const int32_t* ta = prompt_tokens_ + prompt_offsets_[a];
      const int32_t* tb = prompt_tokens_ + prompt_offsets_[b];
      for (; p < end; ++p) {
        if (ta[p] != tb[p]) return p;
      }
      continue;
    }
    for (; p < end; ++p) {
      if (token(a, p) != token(b, p)) return p;
    }
  }
  return to;
}

uint64_t TraceTokens::content_hash(int32_t r, int64_t from, int64_t to) const {
  uint64_t h = mix64(static_cast<uint64_t>(to - from) + kGolden);
  for (int64_t p = from; p < to; ++p) h = mix64(h ^ static_cast<uint32_t>(token(r, p)));
  return h;
}

void draw_outputs(uint64_t seed, int64_t n, int32_t* out) {
  MersenneTwister rng(seed);
  const uint32_t width = kOutputHigh - kOutputLow;
  int bits = 0;
  while ((width >> bits) != 0) ++bits;
  const int shift = 32 - bits;
  for (int64_t i = 0; i < n;) {
    const uint32_t v = rng.next() >> shift;
    if (v < width) out[i++] = static_cast<int32_t>(v) + kOutputLow;
  }
}

}  // namespace kvmem
