// kvmem/replay/simulator.py's replay(): one replica through a trace in arrival order, each request queued once
// the clock reaches its arrival, taken a bounded number of steps at a time so that the caller can show progress
// and take Ctrl-C between calls.
#pragma once

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "replica.h"

namespace kvmem {

class SingleReplay {
 public:
  // order: the trace indices in arrival order; arrivals: each one's arrival (0 for all when they are not honoured).
  SingleReplay(const ReplicaConfig& config, TraceTokens* tokens, std::vector<int32_t> order,
               std::vector<double> arrivals)
      : replica(config, tokens), order_(std::move(order)), arrivals_(std::move(arrivals)) {}

  Replica replica;
  bool started = false;
  double start_s = 0.0;  // the first arrival's time (ReplayReport.start_s)
  std::vector<std::pair<int32_t, Rejection>> rejections;  // in arrival order

  // Takes up to `max_steps` steps (and queues the arrivals between them); true once the trace is done.
  bool advance(int64_t max_steps) {
    for (int64_t steps = 0; steps < max_steps;) {
      if (next_ < order_.size()) {
        const double arrival = arrivals_[next_];
        if (replica.clock < arrival && !replica.is_idle()) {
          replica.step(arrival, &outcome_);
          ++steps;
          continue;
        }
        if (arrival > replica.clock) replica.clock = arrival;  // idle until it arrives
        if (!started) {
          started = true;
          start_s = arrival;
        }
        const int32_t rid = order_[next_++];
        const Rejection why = replica.add_request(rid, arrival);
        if (why != Rejection::kNone) rejections.emplace_back(rid, why);
        continue;
      }
      if (replica.is_idle()) return true;
      replica.step(std::numeric_limits<double>::infinity(), &outcome_);
      ++steps;
    }
    return next_ >= order_.size() && replica.is_idle();
  }

 private:
  std::vector<int32_t> order_;
  std::vector<double> arrivals_;
  size_t next_ = 0;
  StepOutcome outcome_;
};

}  // namespace kvmem
