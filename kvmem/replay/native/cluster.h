// kvmem/replay/cluster.py's ClusterReplay: N replicas, each on its own clock, behind a router (kvmem/router.py)
// that sees only their KV events and the loads it keeps itself. A step's results (its events, the requests it
// finished and prefilled, the pages its running requests pin) reach the router when the step ends on the replica's
// clock; a run of decode steps hands them over at its end, as one batch. Replicas step in simulated-time order up to
// each arrival, which is routed after every result that ended by then has been delivered.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <queue>
#include <utility>
#include <vector>

#include "events.h"
#include "replica.h"
#include "view.h"

namespace kvmem {

enum class RoutePolicy { kRoundRobin, kLeastLoad, kCacheAware, kKvOverlap };

// kvmem.router's policy parameters (their defaults are SGLang's and Dynamo's).
struct RouterParams {
  double cache_threshold = 0.3;
  int64_t balance_abs_threshold = 64;
  double balance_rel_threshold = 1.5;
  double overlap_score_weight = 1.0;
};

// cluster_report.EventCounts
struct EventCounts {
  int64_t batches = 0, stored_blocks = 0, removed_blocks = 0, cleared = 0;
};

class ClusterReplay {
 public:
  struct Member {
    std::unique_ptr<Replica> replica;
    EventLog log;
    PageView view;
    double busy_s = 0, prefill_s = 0;
    int64_t routed = 0;
    bool started = false;
    double start_s = 0;  // the first arrival routed there (ReplayReport.start_s)
    // What a step hands the router (cluster._StepResult).
    struct Result {
      double ts;
      bool batch;
      int64_t stored_blocks, removed_blocks;
      std::vector<PageRun> runs;
      int64_t finished;
      std::vector<int32_t> prefilled;
      int64_t pinned_pages;
    };
    std::deque<Result> results;
    Member(const ReplicaConfig& config, TraceTokens* tokens, bool reads_index, SimStore* store);
  };

  // order: the trace indices in arrival order; arrivals: each one's arrival (0 for all when they are not honoured).
  ClusterReplay(const ReplicaConfig& config, TraceTokens* tokens, int32_t replicas, RoutePolicy policy,
                const RouterParams& params, std::vector<int32_t> order, std::vector<double> arrivals);

  // Routes up to `max_routes` arrivals (running the steps before each); true once the trace is done.
  bool advance(int64_t max_routes);

  std::vector<Member> members;
  EventCounts events;
  int64_t index_cached_tokens = 0;
  double routing_seconds = 0;
  std::vector<std::pair<int32_t, std::pair<int32_t, Rejection>>> rejections;  // (replica, (rid, why)), in order
  bool reads_index() const { return reads_index_; }
  int64_t finished() const;

 private:
  void advance_time(double until);
  void step(int32_t rank, double until);
  void deliver(double now);
  void route(int32_t rid, double arrival);
  int32_t choose(int32_t rid, int64_t num_tokens, std::vector<int64_t>& overlaps);

  ReplicaConfig config_;
  TraceTokens* tokens_;
  std::unique_ptr<SimStore> store_;  // the replicas share one simulated store, as they would a real store's pages
  RoutePolicy policy_;
  RouterParams params_;
  bool reads_index_;
  std::vector<int32_t> order_;
  std::vector<double> arrivals_;
  size_t next_ = 0;
  bool drained_ = false;
  int64_t next_replica_ = 0;  // round-robin
  std::vector<int64_t> running_, prefill_tokens_, active_blocks_;
  std::vector<int64_t> queued_prefill_;  // rid -> the prefill tokens its routing added
  // (clock, rank) of the replicas with work, earliest first
  std::priority_queue<std::pair<double, int32_t>, std::vector<std::pair<double, int32_t>>,
                      std::greater<std::pair<double, int32_t>>>
      clocks_;
  StepOutcome outcome_;
};

}  // namespace kvmem
