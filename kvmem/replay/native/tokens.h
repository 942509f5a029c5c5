// The token ids of a trace's requests, read where they are needed instead of materialized.
//
// A request's sequence is its prompt followed by its output. Prompts are either Mooncake hash blocks (512
// tokens each, the tokens a hash of (hash id, position): kvmem/replay/traces.py's block_token_ids, ported
// exactly) or explicit token ids (a kvmem JSONL or synthetic trace: one int32 array with offsets). Outputs are
// explicit, or drawn from a seed as traces.py's _output_draws draws them (Python's Mersenne Twister seeded
// with the seed, randrange(10, 32000) per token), each once, when a replica first queues its request: a request
// that can never run is never drawn (a trace may claim a trillion output tokens).
//
// Every key of the radix tree is a run of some request's sequence at the same positions as in any other
// request that shares it, so two keys are compared position by position: a block of two prompts with the
// same hash id is equal without reading it, and real token ids are computed only where different runs meet.
#pragma once

#include <cstdint>
#include <vector>

namespace kvmem {

constexpr int64_t kBlockSize = 512;  // tokens per Mooncake hash id (traces.BLOCK_SIZE)

class TraceTokens {
 public:
  // Mooncake prompts: request r's hash ids are hash_ids[block_offsets[r]:block_offsets[r + 1]].
  void set_blocks(const int64_t* hash_ids, const int64_t* block_offsets, const int64_t* input_lens, int64_t n);
  // Explicit prompts: request r's tokens are tokens[offsets[r]:offsets[r + 1]].
  void set_prompts(const int32_t* tokens, const int64_t* offsets, int64_t n);
  // Outputs: request r's output_lens[r] tokens are explicit_tokens[explicit_offsets[r]:...] where that row is
  // not empty, else drawn from seeds[r]. The explicit arrays are read when a request's output is first needed:
  // the caller keeps them alive.
  void set_outputs(const int64_t* output_lens, const uint64_t* seeds, const int32_t* explicit_tokens,
                   const int64_t* explicit_offsets);
  // Makes request r's output tokens readable (once; later calls do nothing).
  void take_output(int32_t r);

  int64_t size() const { return static_cast<int64_t>(input_len_.size()); }
  int64_t input_len(int32_t r) const { return input_len_[r]; }
  int64_t output_len(int32_t r) const { return output_len_[r]; }

  int32_t token(int32_t r, int64_t pos) const {
    const int64_t n = input_len_[r];
    if (pos < n) {
      if (blocks_) return block_token(mixed_block(r, pos / kBlockSize), pos % kBlockSize);
      return prompt_tokens_[prompt_offsets_[r] + pos];
    }
    return out_tokens_[out_start_[r] + (pos - n)];  // take_output(r) came first
  }

  // The first position in [from, to) where requests a and b hold different tokens, or `to`.
  int64_t first_mismatch(int32_t a, int32_t b, int64_t from, int64_t to) const;

  // A hash of tokens [from, to) of request r (equal runs hash equal, whatever their origin).
  uint64_t content_hash(int32_t r, int64_t from, int64_t to) const;

  static int32_t block_token(uint64_t mixed, int64_t offset);
  static uint64_t mix64(uint64_t z);

 private:
  uint64_t mixed_block(int32_t r, int64_t block) const;

  bool blocks_ = false;
  const int64_t* hash_ids_ = nullptr;
  const int64_t* block_offsets_ = nullptr;
  const int32_t* prompt_tokens_ = nullptr;
  const int64_t* prompt_offsets_ = nullptr;
  std::vector<int64_t> input_len_;
  std::vector<int64_t> output_len_;
  std::vector<uint64_t> seeds_;
  const int32_t* explicit_tokens_ = nullptr;
  const int64_t* explicit_offsets_ = nullptr;
  std::vector<int32_t> out_tokens_;
  std::vector<int64_t> out_start_;  // where request r's output starts in out_tokens_ (-1: not taken yet)
};

// `n` draws of randrange(low, high) from Python's random.Random(seed) (seed >= 0), as traces._randrange_bulk
// takes them: the accepted top bits of successive 32-bit Mersenne Twister words.
void draw_outputs(uint64_t seed, int64_t n, int32_t* out);

}  // namespace kvmem
