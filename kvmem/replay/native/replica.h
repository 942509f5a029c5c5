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
// A step is ReplicaSim.step's: one scheduler step, or a run of pure decode steps taken at once
// (kvmem/replay/decode_runs.py's ReplayScheduler.run_decode, decode_run.cpp), with the same ranking, match and
// eviction calls at the same steps; a cluster's router sees a run's events when it ends, so its bounds are the
// Python engine's. A replica is stepped on its own clock (`run_until`), so that a driver can interleave several
// replicas and a router, as kvmem/replay/cluster.py does with ReplicaSims.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "store.h"
#include "tokens.h"
#include "tree.h"

namespace kvmem {

// Adds the wall seconds of its scope to `*total` (the report's timings).
class Stopwatch {
 public:
  explicit Stopwatch(double* total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Stopwatch() { *total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double* total_;
  std::chrono::steady_clock::time_point start_;
};

// kvmem.replay.cost's StepCost (fixed) or RooflineCost (roofline), by their constants.
struct CostModel {
  bool roofline = false;
  double decode_step_s = 0.03, prefill_tokens_per_s = 50000.0;
  double flops_per_s = 0, bytes_per_s = 0, weight_bytes = 0, pair_flops = 0, token_flops = 0;
  // A hybrid model's layer kinds (RooflineCost's): a (query, key) pair's FLOPs in the window layers, a token's in
  // the linear layers' recurrences, a token's KV bytes in the full and in the window layers, the state bytes a
  // request moves in a step, and the window (0: no window layers), chunked for Llama 4's chunks.
  double window_pair_flops = 0, linear_flops = 0, full_kv_bytes = 0, window_kv_bytes = 0, state_bytes = 0;
  int64_t window = 0;
  bool chunked = false;
  // Loads from lower tiers, on either clock (cost.load_seconds): a token's KV on all the GPUs, the host links
  // it crosses (one per GPU), their bandwidth and the storage tier's, GB/s, and a storage read's latency.
  double kv_bytes = 0, links = 1, h2d_gbps = 50.0, storage_gbps = 10.0, storage_latency_us = 100.0;

  // A prefill step; `loaded` tokens of its cached prefixes came back from the host tier, `stored` of them read
  // from the storage tier first.
  double extend_seconds(const std::vector<int64_t>& prefix, const std::vector<int64_t>& seq, int64_t loaded = 0,
                        int64_t stored = 0) const;
  double load_seconds(int64_t loaded, int64_t stored) const;
  // `window_tokens`: the keys each window layer reads (window_keys of the requests' lengths).
  double decode_seconds(int64_t batch_size, int64_t kv_tokens, int64_t window_tokens) const;
  double prefill_seconds_saved(int64_t cached) const;
  // cost._window_pairs and cost._window_reads (the window layers' pairs among the first n tokens, the keys they
  // read for queries prefix+1..seq), and the keys they read for a decode step of a request of `seq` tokens.
  int64_t window_pairs(int64_t n) const;
  int64_t window_reads(int64_t prefix, int64_t seq) const;
  int64_t window_keys(int64_t seq) const { return window ? window_reads(seq - 1, seq) : 0; }
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
  int64_t load_back_threshold = 16;
  HostTier host;
  bool storage = false;               // a simulated store under the host tier
  int64_t storage_capacity_tokens = 0;  // whole pages; 0: unbounded
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
  int64_t host_hit_len = 0;     // of its last match, the tokens loaded back from the host tier
  int64_t storage_hit_len = 0;  // of those, the tokens read from storage for it
  Prefetch prefetch;
  bool waiting_first_token = true, live = false, admitted = false;

  int64_t fill_len() const { return input_len + num_output; }
};

enum class Rejection : uint8_t { kNone, kCapacity, kContext };

// What ReplayReport records, kept as the simulator appends it.
struct ReplicaReport {
  int64_t requests = 0, prompt_tokens = 0, cached_tokens = 0, evicted_tokens = 0, retractions = 0, rejected = 0;
  int64_t host_cached_tokens = 0, storage_cached_tokens = 0;
  int64_t output_tokens = 0, finished = 0;
  double prefill_seconds_saved = 0;
  std::vector<double> time_s, cumulative_hit_rate, ttft_s;
  std::vector<double> first_token_s;  // the clock at each first token, ttft_s's companion
  std::vector<int64_t> tokens_used, evictable_tokens, running;
  // wall seconds inside the scheduler and the tree, and the parts of it (see ReplayReport.record_cache_phases)
  double cache_op_seconds = 0, match_seconds = 0, evict_seconds = 0, insert_release_seconds = 0;

  double hit_rate() const {
    return prompt_tokens ? static_cast<double>(cached_tokens) / static_cast<double>(prompt_tokens) : 0.0;
  }
};

// What a step ended (simulator.StepOutcome): the trace requests it finished, and those whose prompt it finished
// prefilling.
struct StepOutcome {
  std::vector<int32_t> finished, prefilled;
  void clear() {
    finished.clear();
    prefilled.clear();
  }
};

class Replica {
 public:
  // `store`: a storage tier shared with other replicas (else the replica opens its own where `config` has one).
  Replica(const ReplicaConfig& config, TraceTokens* tokens, SimStore* store = nullptr);

  double clock = 0.0;
  ReplicaReport report;

  bool is_idle() const { return waiting_.empty() && running_.empty() && chunked_ < 0; }
  // Queues trace request `rid`, arrived at `arrival` (<= clock); kNone, or why it can never run here.
  Rejection add_request(int32_t rid, double arrival);
  // Steps while the clock is before `t` and there is work.
  void run_until(double t);
  // ReplicaSim.step: the next scheduler step, or a run of pure decode steps (those after the first ending by
  // `until`); what it ended goes to `out` (cleared first).
  void step(double until, StepOutcome* out);
  int64_t capacity_tokens() const { return slots_.size; }
  int64_t tokens_used() const { return slots_.used(); }
  int64_t page_size() const { return page_size_; }
  const RadixTree& tree() const { return tree_; }
  // Where the tree reports its KV events (a cluster's router reads them).
  void set_event_log(EventLog* log) { tree_.set_event_log(log); }

 private:
  struct Batch {
    bool extend = false;
    std::vector<int32_t> reqs;
    std::vector<int64_t> prefix, seq;  // extend: tokens before and after the step
    std::vector<int32_t> retracted;
  };

  // Scheduler
  void one_step(StepOutcome* out);
  bool schedule(Batch& b);
  bool extend_batch(Batch& b);
  void decode_batch(Batch& b);
  void retract(Batch& b);
  void release(int32_t i);
  void process(const Batch& b, std::vector<int32_t>& finished);
  void finish(int32_t i, std::vector<int32_t>& finished);
  void finished_requests(const std::vector<int32_t>& finished, StepOutcome* out);
  void record_step();
  bool sort_waiting_by_prefix(bool take_decode_pages);
  bool kept_walk_is_current(Request& r);
  int64_t rank(int32_t i);
  bool rank_without_decode_pages(int32_t i);
  void keep_walk(Request& r, int64_t key_len, const Walk& w);
  bool take_decode_pages(int32_t q, int64_t key_len, int32_t node, int64_t matched);
  bool continues(const Request& q, int32_t node, int64_t matched) const;
  void match(int32_t i, int64_t room);
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
  void decay_new_token_ratio();
  // decode runs (decode_run.cpp)
  int64_t pure_decode_steps();
  int64_t fewest_left() const;
  bool may_admit() const { return !waiting_.empty() && static_cast<int64_t>(running_.size()) < config_.max_running; }
  int64_t fitting_decode_steps(int64_t steps) const;
  bool head_waits(int64_t available, int64_t reserved, bool attempt, bool ranked, bool stale_tails);
  bool window_meets_tails() const;
  void decode_run(int64_t steps, double until, StepOutcome* out);
  int64_t run_decode(int64_t num_steps, std::vector<int64_t>& used, std::vector<int64_t>& evictable);
  void advance_run(int64_t steps, std::vector<int32_t>& finished);
  int64_t pages_for(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  int64_t round_up(int64_t tokens) const { return pages_for(tokens) * page_size_; }

  ReplicaConfig config_;
  TraceTokens* tokens_;  // a request's output is taken when it is queued
  std::unique_ptr<SimStore> own_store_;  // the store it opened itself (none when a cluster shares one)
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
