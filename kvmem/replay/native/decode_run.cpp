// Decode runs (kvmem/replay/decode_runs.py's ReplayScheduler and simulator.ReplicaSim._decode_run): a run of decode
// steps in which nothing is admitted, nothing is retracted and nothing finishes before the last is taken at once,
// with the same calls at the same steps as one by one (the eviction of each step's shortfall, the failed admission
// attempt at the head of the queue), its requests advanced when it ends. The bounds of a run are the Python
// engine's, check for check (a cluster's router sees a run's events when it ends), and so is every ranking it
// makes or skips.
#include <algorithm>
#include <stdexcept>

#include "replica.h"

namespace kvmem {

int64_t Replica::fewest_left() const {
  int64_t fewest = INT64_MAX;
  for (int32_t i : running_) fewest = std::min(fewest, reqs_[i].max_new_tokens - reqs_[i].num_output);
  return fewest;
}

// ReplayScheduler.pure_decode_steps: how many of the next steps a run may take (0: the next step is not one).
int64_t Replica::pure_decode_steps() {
  if (chunked_ >= 0 || running_.empty()) return 0;
  const int64_t steps = fitting_decode_steps(fewest_left());
  if (steps && may_admit() && !head_waits(slots_.available(), reserved_tokens(), false, false, false)) return 0;
  return steps;
}

// How many of the next `steps` decode steps find their slots in free + evictable memory.
int64_t Replica::fitting_decode_steps(int64_t steps) const {
  const int64_t room = slots_.available() + tree_.evictable_size();
  const int64_t bs = static_cast<int64_t>(running_.size());
  if (page_size_ == 1) return std::min(steps, room / bs);
  auto fits = [&](int64_t k) {
    int64_t pages = 0;
    for (int32_t i : running_) pages += pages_for(reqs_[i].kv_len + k) - pages_for(reqs_[i].kv_len);
    return pages * page_size_ <= room;
  };
  if (fits(steps)) return steps;
  int64_t low = 0, high = steps;  // the first `low` steps fit, `high` do not
  while (high - low > 1) {
    const int64_t mid = (low + high) / 2;
    (fits(mid) ? low : high) = mid;
  }
  return low;
}

// ReplayScheduler._head_waits: whether admission fails at the head of the queue, known from walks that change nothing
// (false too where only the real match can tell); with `attempt`, when it fails, it then makes that failed attempt.
// ReplayScheduler._window_meets_tails: whether a request of the ranking window has no kept walk, or one that ends
// where a running request's cached prefix ends (its output pages, written in this run, may continue it).
bool Replica::window_meets_tails() const {
  int64_t n = 0;
  for (int32_t i : waiting_) {
    if (n++ == config_.lpm_window) break;
    const Request& r = reqs_[i];
    if (!r.has_walk) return true;
    if (r.walk.child < 0 && tree_.alive(r.walk.node, r.walk.node_gen) && in_tails(r.walk.node)) return true;
  }
  return false;
}

bool Replica::head_waits(int64_t available, int64_t reserved, bool attempt, bool ranked, bool stale_tails) {
  if (tree_.has_host()) return false;  // a tiered match may load pages back
  const int64_t room = available - reserved + tree_.evictable_size();
  int32_t head = waiting_.front();
  Walk walk;
  if (config_.lpm) {
    const Request& r = reqs_[head];
    if (!attempt && r.has_walk && charge(r, r.walk.num_tokens()) <= room) return false;
    if (!ranked) {
      Stopwatch watch(&report.match_seconds);
      if (!sort_waiting_by_prefix(false)) return false;
    }
    if (stale_tails && config_.cache_decode_pages && window_meets_tails()) return false;
    head = waiting_.front();
    walk = reqs_[head].walk;
  } else {
    walk = tree_.prefix_walk(reqs_[head].rid, reqs_[head].fill_len() - 1);
  }
  if (walk.child < 0 && tree_.alive(walk.node, walk.node_gen) && in_tails(walk.node)) return false;
  const int64_t prefix = walk.num_tokens();
  if (charge(reqs_[head], prefix) <= room) return false;
  if (attempt) {
    Stopwatch watch(&report.match_seconds);
    match(head, room);
    Request& r = reqs_[head];
    if (r.cache_protected_len != prefix) {  // the walk and the match are the same descent
      throw std::runtime_error("decode run: a match and its walk disagree");
    }
    tree_.lock_below(r.last_node, RadixTree::kRoot);
    tree_.unlock(r.last_node);
  }
  return true;
}

// ReplicaSim._decode_run: up to `steps` decode steps, the first and those after it that end by `until`.
void Replica::decode_run(int64_t steps, double until, StepOutcome* out) {
  const int64_t bs = static_cast<int64_t>(running_.size());
  int64_t kv_tokens = 0;
  for (int32_t i : running_) kv_tokens += reqs_[i].kv_len;
  std::vector<double> times;
  double t = clock;
  const CostModel& cost = config_.cost;
  for (int64_t j = 0; j < steps; ++j) {
    kv_tokens += bs;  // every request attends to its kv_len tokens and the one it decodes
    int64_t window_tokens = 0;
    if (cost.window) {
      for (int32_t i : running_) window_tokens += cost.window_keys(reqs_[i].kv_len + j + 1);
    }
    const double end = t + cost.decode_seconds(bs, kv_tokens, window_tokens);
    if (j && end > until) break;
    t = end;
    times.push_back(t);
  }
  std::vector<int64_t> used, evictable;
  int64_t taken;
  {
    Stopwatch watch(&report.cache_op_seconds);
    taken = run_decode(static_cast<int64_t>(times.size()), used, evictable);
  }
  if (taken == 0) {  // the first step must retract: a step of its own does that
    one_step(out);
    return;
  }
  std::vector<int32_t> finished;
  {
    Stopwatch watch(&report.cache_op_seconds);
    advance_run(taken, finished);
  }
  used[taken - 1] = slots_.used();  // the last step's finishes released memory
  evictable[taken - 1] = tree_.evictable_size();
  clock = times[taken - 1];
  const double hit_rate = report.hit_rate();
  for (int64_t j = 0; j < taken; ++j) {
    report.time_s.push_back(times[j]);
    report.tokens_used.push_back(used[j]);
    report.evictable_tokens.push_back(evictable[j]);
    report.running.push_back(j + 1 < taken ? bs : static_cast<int64_t>(running_.size()));
    report.cumulative_hit_rate.push_back(hit_rate);
  }
  finished_requests(finished, out);
}

// ReplayScheduler._decode_steps: per step the room check, the failed admission attempt, the eviction of any
// shortfall and the slots taken; the requests themselves advance when the run ends (advance_run).
int64_t Replica::run_decode(int64_t num_steps, std::vector<int64_t>& used, std::vector<int64_t>& evictable) {
  const int64_t bs = static_cast<int64_t>(running_.size());
  const bool admit = may_admit();
  bool ranked = false;  // the waiting window is in the order a ranking would give now
  // Requests whose kv_len is r modulo the page size open a new page at the steps j with (r + j) % ps == 0.
  std::vector<int64_t> per_residue;
  if (page_size_ > 1) {
    per_residue.assign(page_size_, 0);
    for (int32_t i : running_) per_residue[reqs_[i].kv_len % page_size_] += page_size_;
  }
  int64_t steps = 0;
  for (int64_t j = 0; j < num_steps; ++j) {
    const int64_t need = page_size_ == 1 ? bs : per_residue[(page_size_ - j % page_size_) % page_size_];
    const int64_t available = slots_.available();
    if (need > available + tree_.evictable_size()) break;  // this step retracts: a step of its own takes it
    if (admit) {
      // The output tokens of the steps before this one count as generated, as a step's results count them.
      const int64_t reserved = static_cast<int64_t>(static_cast<double>(tokens_left_ - j * bs) * new_token_ratio_);
      if (!head_waits(available, reserved, true, ranked, j > 0)) break;  // this step admits (or only a match can tell)
      // Within a run only an eviction changes a waiting request's cached prefix: until one, a ranking would give
      // the same order.
      ranked = config_.lpm;
    }
    const int64_t short_by = need - available;
    if (short_by > 0) {
      ranked = false;
      report.evicted_tokens += evict(short_by);
    }
    slots_.free -= need;
    used.push_back(slots_.used());
    evictable.push_back(tree_.evictable_size());
    decay_new_token_ratio();
    ++steps;
  }
  return steps;
}

// ReplayScheduler._advance: the run's tokens into the running requests; those it finished enter the tree, in batch
// order.
void Replica::advance_run(int64_t steps, std::vector<int32_t>& finished) {
  const int64_t bs = static_cast<int64_t>(running_.size());
  std::vector<int32_t> still;
  still.reserve(running_.size());
  for (int32_t i : running_) {
    Request& r = reqs_[i];
    r.num_output += steps;
    r.kv_len += steps;
  }
  tokens_left_ -= steps * bs;
  for (int32_t i : running_) {
    if (reqs_[i].num_output >= reqs_[i].max_new_tokens) {
      finish(i, finished);
    } else {
      still.push_back(i);
    }
  }
  running_.swap(still);
}

}  // namespace kvmem
