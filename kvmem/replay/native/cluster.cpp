#include "cluster.h"

#include <chrono>
#include <limits>

namespace kvmem {

namespace {

inline double py_max(double a, double b) { return b > a ? b : a; }  // Python's max(a, b)

template <typename Key>
int32_t argmin(int32_t n, Key key) {  // Python's min(range(n), key=key): the first lowest
  int32_t best = 0;
  for (int32_t r = 1; r < n; ++r) {
    if (key(r) < key(best)) best = r;
  }
  return best;
}

}  // namespace

ClusterReplay::Member::Member(const ReplicaConfig& config, TraceTokens* tokens, bool reads_index, SimStore* store)
    : replica(std::make_unique<Replica>(config, tokens, store)), view(tokens, config.page_size) {
  log.keep_runs = reads_index;
}

ClusterReplay::ClusterReplay(const ReplicaConfig& config, TraceTokens* tokens, int32_t replicas, RoutePolicy policy,
                             const RouterParams& params, std::vector<int32_t> order, std::vector<double> arrivals)
    : config_(config), tokens_(tokens), policy_(policy), params_(params),
      reads_index_(policy == RoutePolicy::kCacheAware || policy == RoutePolicy::kKvOverlap),
      order_(std::move(order)), arrivals_(std::move(arrivals)), running_(replicas), prefill_tokens_(replicas),
      active_blocks_(replicas), queued_prefill_(tokens->size()) {
  if (config.storage) store_ = std::make_unique<SimStore>(config.storage_capacity_tokens, config.page_size);
  members.reserve(replicas);  // the replicas' trees keep pointers to their logs: no reallocation
  for (int32_t r = 0; r < replicas; ++r) members.emplace_back(config, tokens, reads_index_, store_.get());
  for (Member& m : members) m.replica->set_event_log(&m.log);
}

int64_t ClusterReplay::finished() const {
  int64_t n = 0;
  for (const Member& m : members) n += m.replica->report.finished;
  return n;
}

bool ClusterReplay::advance(int64_t max_routes) {
  for (int64_t routes = 0; routes < max_routes && next_ < order_.size(); ++routes) {
    const double arrival = arrivals_[next_];
    advance_time(arrival);
    deliver(arrival);
    route(order_[next_++], arrival);
  }
  if (next_ < order_.size()) return false;
  if (!drained_) {
    const double end = std::numeric_limits<double>::infinity();
    advance_time(end);
    deliver(end);
    drained_ = true;
  }
  return true;
}

// Runs, in clock order, every step that starts before `until`.
void ClusterReplay::advance_time(double until) {
  while (!clocks_.empty() && clocks_.top().first < until) {
    const int32_t rank = clocks_.top().second;
    clocks_.pop();
    step(rank, until);
    const Replica& replica = *members[rank].replica;
    if (!replica.is_idle()) clocks_.emplace(replica.clock, rank);
  }
}

// cluster._Replica.step: the replica's next step (or run of decode steps), its results queued for the router.
void ClusterReplay::step(int32_t rank, double until) {
  Member& m = members[rank];
  Replica& replica = *m.replica;
  const double start = replica.clock;
  replica.step(until, &outcome_);
  if (!outcome_.prefilled.empty()) m.prefill_s += replica.clock - start;
  m.busy_s += replica.clock - start;
  const int64_t pinned = (replica.tokens_used() - replica.tree().evictable_size()) / replica.page_size();
  EventLog& log = m.log;
  m.results.push_back({replica.clock, log.events > 0, log.stored_blocks, log.removed_blocks, std::move(log.runs),
                       static_cast<int64_t>(outcome_.finished.size()), outcome_.prefilled, pinned});
  log.clear();
}

// Hands the router every step result that has ended by `now`.
void ClusterReplay::deliver(double now) {
  for (size_t rank = 0; rank < members.size(); ++rank) {
    Member& m = members[rank];
    while (!m.results.empty() && m.results.front().ts <= now) {
      const Member::Result& result = m.results.front();
      if (result.batch) {
        if (reads_index_) m.view.apply(result.runs);
        ++events.batches;
        events.stored_blocks += result.stored_blocks;
        events.removed_blocks += result.removed_blocks;
      }
      for (int32_t rid : result.prefilled) {
        prefill_tokens_[rank] -= queued_prefill_[rid];
        queued_prefill_[rid] = 0;
      }
      running_[rank] -= result.finished;
      active_blocks_[rank] = result.pinned_pages;
      m.results.pop_front();
    }
  }
}

// kvmem.router's policies over the loads the router keeps and, for the policies that read it, the index.
int32_t ClusterReplay::choose(int32_t rid, int64_t num_tokens, std::vector<int64_t>& overlaps) {
  const int32_t n = static_cast<int32_t>(members.size());
  switch (policy_) {
    case RoutePolicy::kRoundRobin: {
      const int32_t r = static_cast<int32_t>(next_replica_ % n);
      next_replica_ = r + 1;
      return r;
    }
    case RoutePolicy::kLeastLoad:
      return argmin(n, [&](int32_t r) { return running_[r]; });
    case RoutePolicy::kCacheAware: {
      int64_t most = running_[0], least = running_[0];
      for (int64_t x : running_) {
        most = std::max(most, x);
        least = std::min(least, x);
      }
      if (most - least > params_.balance_abs_threshold &&
          static_cast<double>(most) > static_cast<double>(least) * params_.balance_rel_threshold) {
        return argmin(n, [&](int32_t r) { return running_[r]; });
      }
      const int32_t best = argmin(n, [&](int32_t r) { return std::make_pair(-overlaps[r], running_[r]); });
      if (num_tokens && static_cast<double>(overlaps[best] * config_.page_size) / static_cast<double>(num_tokens) >
                            params_.cache_threshold) {
        return best;
      }
      return argmin(n, [&](int32_t r) { return std::make_pair(members[r].view.num_pages(), running_[r]); });
    }
    case RoutePolicy::kKvOverlap: {
      const int64_t bs = config_.page_size;
      const double request_blocks = static_cast<double>((num_tokens + bs - 1) / bs);
      return argmin(n, [&](int32_t r) {
        const double prefill = static_cast<double>(prefill_tokens_[r] + num_tokens - overlaps[r] * bs);
        return params_.overlap_score_weight * prefill / static_cast<double>(bs) +
               static_cast<double>(active_blocks_[r]) + request_blocks;
      });
    }
  }
  (void)rid;
  return 0;
}

void ClusterReplay::route(int32_t rid, double arrival) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t prompt = tokens_->input_len(rid);
  const int64_t pages = reads_index_ ? (prompt - 1) / config_.page_size : 0;  // the pages a replica can hit
  std::vector<int64_t> overlaps(members.size(), 0);
  if (pages) {
    for (size_t r = 0; r < members.size(); ++r) overlaps[r] = members[r].view.overlap(rid, pages * config_.page_size);
  }
  const int32_t rank = choose(rid, prompt, overlaps);
  const int64_t cached = overlaps[rank] * config_.page_size;
  routing_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Member& m = members[rank];
  Replica& replica = *m.replica;
  const bool was_idle = replica.is_idle();
  replica.clock = py_max(replica.clock, arrival);  // a replica that was idle starts when the request arrives
  if (!m.started) {
    m.started = true;
    m.start_s = arrival;
  }
  const Rejection why = replica.add_request(rid, arrival);
  if (why != Rejection::kNone) {
    rejections.push_back({rank, {rid, why}});
    return;
  }
  ++m.routed;
  index_cached_tokens += cached;
  ++running_[rank];
  queued_prefill_[rid] = prompt - cached;
  prefill_tokens_[rank] += prompt - cached;
  if (was_idle) clocks_.emplace(replica.clock, rank);
}

}  // namespace kvmem
