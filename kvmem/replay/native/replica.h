// One simulated server (kvmem/replay/simulator.py's ReplicaSim): a scheduler over its own tree and slot count, a
// fake model that samples each request's known output, and a clock advanced by a cost model.
//
// The scheduler is kvmem/scheduler.py's Scheduler taken one step at a time (the step-by-step semantics that its
// decode runs, Scheduler.run_decode, reproduce in bulk): admission with the LPM ranking of the waiting window and
// its kept walks, the match (with a running request's output pages taken into the tree when the key goes on with
// them), the charge and new_token_ratio, chunked prefill, in-batch prefix caching, decode with retraction, and
// requests entering the tree as they prefill, retract and finish. Every double is computed in the order Python
// computes it, so clocks and ratios are bit-identical.
//
// A replica is stepped on its own clock (`run_until`), so that a driver can interleave several replicas and a
// router, as kvmem/replay/cluster.py does with ReplicaSims.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "tokens.h"
#include "tree.h"

namespace kvmem {

// kvmem.replay.cost's StepCost (fixed) or RooflineCost (roofline), by their constants.
struct CostModel {
  bool roofline = false;
  double decode_step_s = 0.03, prefill_tokens_per_s = 50000.0;
  double flops_per_s = 0, bytes_per_s = 0, weight_bytes = 0, pair_flops = 0, token_flops = 0, kv_bytes = 0;

  double extend_seconds(const std::vector<int64_t>& prefix, const std::vector<int64_t>& seq) const;
  double decode_seconds(int64_t batch_size, int64_t kv_tokens) const;
  double prefill_seconds_saved(int64_t cached) const;
};

struct ReplicaConfig {
  int64_t capacity_tokens = 0;  // whole pages
  int64_t context_len = 0;      // the longest request that can run (ReplayConfig.context_len)
  int64_t page_size = 1;
  Policy eviction_policy = Policy::kLru;
  bool lpm = true;
  int64_t max_running = 256;
  int64_t chunked_prefill_size = 0;  // 0: no chunking
  bool cache_decode_pages = true;
  bool in_batch_prefix_caching = false;
  int64_t pin_prefix_tokens = 0;
  double pin_budget = 0.2;
  // SchedulerConfig's admission constants
  int64_t lpm_window = 128;
  double init_new_token_ratio = 0.7, min_new_token_ratio = 0.1, new_token_ratio_decay = 0.001;
  CostModel cost;
};

enum class Status : uint8_t { kWaiting, kRunning, kRetracted, kFinished };

struct Request {
  int32_t rid = 0;  // the trace's index: whose tokens
  int64_t input_len = 0, max_new_tokens = 0, num_output = 0;
  Status status = Status::kWaiting;
  int64_t kv_len = 0, prefix_len = 0, cache_protected_len = 0, extend_end = 0;
  int32_t last_node = -1;  // -1: none
  int32_t tail_node = -1;  // where it is listed among the running requests' tails (-1: not listed)
  // The last ranking walk (Scheduler._walks): the walk, the key's length, whether the key has a page after it,
  // the rank (-tokens), and the node's child_version when its next page was last known not to be a child.
  bool has_walk = false;
  bool next_page = false;
  Walk walk;
  int64_t walk_key_len = 0, rank = 0;
  uint32_t walk_version = 0;
  double arrival = 0;
  bool waiting_first_token = true, live = false, admitted = false;

  int64_t fill_len() const { return input_len + num_output; }
};

enum class Rejection : uint8_t { kNone, kCapacity, kContext };

// What ReplayReport records, kept as the simulator appends it.
struct ReplicaReport {
  int64_t requests = 0, prompt_tokens = 0, cached_tokens = 0, evicted_tokens = 0, retractions = 0, rejected = 0;
  int64_t output_tokens = 0, finished = 0;
  double prefill_seconds_saved = 0;
  std::vector<double> time_s, cumulative_hit_rate, ttft_s;
  std::vector<int64_t> tokens_used, evictable_tokens, running;
  // wall seconds inside the scheduler and the tree, and the parts of it (see ReplayReport.record_cache_phases)
  double cache_op_seconds = 0, match_seconds = 0, evict_seconds = 0, insert_release_seconds = 0;

  double hit_rate() const {
    return prompt_tokens ? static_cast<double>(cached_tokens) / static_cast<double>(prompt_tokens) : 0.0;
  }
};

class Replica {
 public:
  Replica(const ReplicaConfig& config, TraceTokens* tokens);

  double clock = 0.0;
  ReplicaReport report;

  bool is_idle() const { return waiting_.empty() && running_.empty() && chunked_ < 0; }
  // Queues trace request `rid`, arrived at `arrival` (<= clock); kNone, or why it can never run here.
  Rejection add_request(int32_t rid, double arrival);
  // Steps while the clock is before `t` and there is work.
  void run_until(double t);
  // One scheduler step: an extend batch if anything can be admitted, else a decode step.
  void step();
  int64_t capacity_tokens() const { return slots_.size; }

 private:
  struct Batch {
    bool extend = false;
    std::vector<int32_t> reqs;
    std::vector<int64_t> prefix, seq;  // extend: tokens before and after the step
    std::vector<int32_t> retracted;
  };

  // Scheduler
  bool schedule(Batch& b);
  bool extend_batch(Batch& b);
  void decode_batch(Batch& b);
  void retract(Batch& b);
  void release(int32_t i);
  void process(const Batch& b, std::vector<int32_t>& finished);
  void finish(int32_t i, std::vector<int32_t>& finished);
  void sort_waiting_by_prefix();
  int64_t rank(int32_t i);
  void keep_walk(Request& r, int64_t key_len, const Walk& w);
  bool take_decode_pages(int32_t q, int64_t key_len, int32_t node, int64_t matched);
  void match(int32_t i);
  bool next_page_in_batch(int32_t i, const std::vector<int32_t>& batch) const;
  int64_t charge(const Request& r, int64_t start) const;
  int64_t reserved_tokens() const;
  void plan_extend(int32_t i, int64_t& budget, int64_t& reserved);
  void cache_req(int32_t i, bool finished);
  void track_tail(int32_t i);
  void untrack_tail(int32_t i);
  bool in_tails(int32_t node) const { return node < static_cast<int32_t>(tails_.size()) && !tails_[node].empty(); }
  int64_t decode_need(const std::vector<int32_t>& reqs) const;
  int64_t evict(int64_t tokens);
  int64_t pages_for(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  int64_t round_up(int64_t tokens) const { return pages_for(tokens) * page_size_; }

  ReplicaConfig config_;
  TraceTokens* tokens_;  // a request's output is taken when it is queued
  int64_t page_size_;
  SlotCount slots_;
  RadixTree tree_;
  std::vector<Request> reqs_;
  std::deque<int32_t> waiting_;
  std::vector<int32_t> running_;
  int32_t chunked_ = -1;
  double new_token_ratio_;
  int64_t tokens_left_ = 0;
  std::vector<std::vector<int32_t>> tails_;  // node -> the running requests whose cached prefix ends there
};

}  // namespace kvmem
