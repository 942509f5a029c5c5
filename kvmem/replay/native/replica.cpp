#include "replica.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvmem {

namespace {

constexpr int64_t kUnbounded = int64_t{1} << 62;  // a prefill budget without chunking (Python's float("inf"))

// Python's max(a, b): a unless b is greater.
inline double py_max(double a, double b) { return b > a ? b : a; }

}  // namespace

// ---- CostModel --------------------------------------------------------------------------------------------------

double CostModel::extend_seconds(const std::vector<int64_t>& prefix, const std::vector<int64_t>& seq, int64_t loaded,
                                 int64_t stored) const {
  int64_t new_tokens = 0, pairs = 0, seq_sum = 0, win_pairs = 0, win_reads = 0;
  for (size_t i = 0; i < seq.size(); ++i) {
    new_tokens += seq[i] - prefix[i];
    pairs += seq[i] * (seq[i] + 1) - prefix[i] * (prefix[i] + 1);
    seq_sum += seq[i];
    if (window) {
      win_pairs += window_pairs(seq[i]) - window_pairs(prefix[i]);
      win_reads += window_reads(prefix[i], seq[i]);
    }
  }
  if (!roofline) {
    return py_max(decode_step_s + static_cast<double>(new_tokens) / prefill_tokens_per_s, load_seconds(loaded, stored));
  }
  const double flops = token_flops * static_cast<double>(new_tokens) + pair_flops * static_cast<double>(pairs / 2) +
                       window_pair_flops * static_cast<double>(win_pairs) +
                       linear_flops * static_cast<double>(new_tokens);
  const double moved = weight_bytes + full_kv_bytes * static_cast<double>(seq_sum) +
                       window_kv_bytes * static_cast<double>(win_reads) +
                       state_bytes * static_cast<double>(seq.size());
  const double compute = py_max(flops / flops_per_s, moved / bytes_per_s);
  return py_max(compute, load_seconds(loaded, stored));
}

double CostModel::load_seconds(int64_t loaded, int64_t stored) const {
  double load = kv_bytes * (static_cast<double>(loaded) / (links * h2d_gbps * 1e9) +
                            static_cast<double>(stored) / (storage_gbps * 1e9));
  if (stored) load += storage_latency_us * 1e-6;
  return load;
}

double CostModel::decode_seconds(int64_t batch_size, int64_t kv_tokens, int64_t window_tokens) const {
  if (!roofline) return decode_step_s;
  const double bs = static_cast<double>(batch_size), win = static_cast<double>(window_tokens);
  const double flops = token_flops * bs + pair_flops * static_cast<double>(kv_tokens) + window_pair_flops * win +
                       linear_flops * bs;
  const double moved = weight_bytes + full_kv_bytes * static_cast<double>(kv_tokens) + window_kv_bytes * win +
                       state_bytes * bs;
  return py_max(flops / flops_per_s, moved / bytes_per_s);
}

double CostModel::prefill_seconds_saved(int64_t cached) const {
  const double c = static_cast<double>(cached);
  if (!roofline) return c / prefill_tokens_per_s;
  const double win_pairs = static_cast<double>(window ? window_pairs(cached) : 0);
  return (token_flops * c + pair_flops * c * static_cast<double>(cached + 1) / 2 + window_pair_flops * win_pairs +
          linear_flops * c) / flops_per_s;
}

int64_t CostModel::window_pairs(int64_t n) const {
  if (chunked) {
    const int64_t rest = n % window;
    return n / window * (window * (window + 1) / 2) + rest * (rest + 1) / 2;
  }
  return n <= window ? n * (n + 1) / 2 : window * (window + 1) / 2 + (n - window) * window;
}

int64_t CostModel::window_reads(int64_t prefix, int64_t seq) const {
  return seq - (chunked ? prefix / window * window : std::max<int64_t>(prefix + 1 - window, 0));
}

// ---- Replica ----------------------------------------------------------------------------------------------------

Replica::Replica(const ReplicaConfig& config, TraceTokens* tokens, SimStore* store)
    : config_(config), tokens_(tokens), page_size_(config.page_size),
      slots_{config.capacity_tokens, config.capacity_tokens},
      tree_(tokens, &slots_, config.page_size, config.eviction_policy,
            static_cast<int64_t>(config.pin_budget * static_cast<double>(config.capacity_tokens)), config.host),
      new_token_ratio_(config.init_new_token_ratio) {
  if (config.storage && store == nullptr) {
    own_store_ = std::make_unique<SimStore>(config.storage_capacity_tokens, config.page_size);
    store = own_store_.get();
  }
  tree_.set_store(store);
}

Rejection Replica::add_request(int32_t rid, double arrival) {
  const int64_t input_len = tokens_->input_len(rid), output_len = tokens_->output_len(rid);
  const int64_t total = input_len + output_len;
  if (round_up(total) > slots_.size) {
    ++report.rejected;
    return Rejection::kCapacity;
  }
  if (total > config_.context_len) {
    ++report.rejected;
    return Rejection::kContext;
  }
  tokens_->take_output(rid);
  Request r;
  r.rid = rid;
  r.input_len = input_len;
  r.max_new_tokens = output_len;
  r.arrival = arrival;
  // A storage tier starts reading the prompt's pages now, while the request waits to be admitted.
  r.prefetch = tree_.prefetch(rid, input_len - 1);
  reqs_.push_back(r);
  waiting_.push_back(static_cast<int32_t>(reqs_.size() - 1));
  return Rejection::kNone;
}

void Replica::run_until(double t) {
  StepOutcome out;
  while (clock < t && !is_idle()) step(t, &out);
}

void Replica::step(double until, StepOutcome* out) {
  out->clear();
  int64_t steps;
  {
    Stopwatch watch(&report.cache_op_seconds);  // it may rank the waiting window: cache time, as a step's ranking
    steps = pure_decode_steps();
  }
  if (steps) {
    decode_run(steps, until, out);
  } else {
    one_step(out);
  }
}

void Replica::one_step(StepOutcome* out) {
  Batch b;
  std::vector<int32_t> finished;
  {
    Stopwatch watch(&report.cache_op_seconds);
    if (!schedule(b)) {
      if (!is_idle()) throw std::runtime_error("scheduler stalled: requests wait but none can be admitted");
      return;
    }
  }
  const CostModel& cost = config_.cost;
  if (b.extend) {
    int64_t loaded = 0, stored = 0;
    for (int32_t i : b.reqs) {
      Request& r = reqs_[i];
      if (r.live) continue;  // a chunked prompt going on
      r.live = true;
      loaded += r.host_hit_len;
      stored += r.storage_hit_len;
      if (!r.admitted) {
        r.admitted = true;
        ++report.requests;
        report.prompt_tokens += r.input_len;
        report.cached_tokens += r.prefix_len;
        report.host_cached_tokens += r.host_hit_len - r.storage_hit_len;
        report.storage_cached_tokens += r.storage_hit_len;
        report.prefill_seconds_saved += cost.prefill_seconds_saved(r.prefix_len);
      }
    }
    clock += cost.extend_seconds(b.prefix, b.seq, loaded, stored);
    // Read before the results: a request's sampled token makes it look partly prefilled again.
    for (int32_t i : b.reqs) {
      if (reqs_[i].extend_end >= reqs_[i].fill_len()) out->prefilled.push_back(reqs_[i].rid);
    }
  } else {
    for (int32_t i : b.retracted) reqs_[i].live = false;
    int64_t kv_tokens = 0, window_tokens = 0;
    for (int32_t i : b.reqs) {
      kv_tokens += reqs_[i].kv_len;
      window_tokens += cost.window_keys(reqs_[i].kv_len);
    }
    clock += cost.decode_seconds(static_cast<int64_t>(b.reqs.size()), kv_tokens, window_tokens);
  }
  {
    Stopwatch watch(&report.cache_op_seconds);
    process(b, finished);
  }
  if (b.extend) {
    for (int32_t i : b.reqs) {
      Request& r = reqs_[i];
      if (r.num_output > 0 && r.waiting_first_token) {
        r.waiting_first_token = false;
        report.ttft_s.push_back(clock - r.arrival);
        report.first_token_s.push_back(clock);
      }
    }
  }
  finished_requests(finished, out);
  record_step();
}

// ReplicaSim._finished: their outputs counted, their prompts' heads pinned.
void Replica::finished_requests(const std::vector<int32_t>& finished, StepOutcome* out) {
  for (int32_t i : finished) {
    Request& r = reqs_[i];
    r.live = false;
    report.output_tokens += r.num_output;
    ++report.finished;
    out->finished.push_back(r.rid);
    if (config_.pin_prefix_tokens) tree_.pin(r.rid, std::min(config_.pin_prefix_tokens, r.input_len));
  }
}

void Replica::record_step() {
  report.time_s.push_back(clock);
  report.tokens_used.push_back(slots_.used());
  report.evictable_tokens.push_back(tree_.evictable_size());
  report.running.push_back(static_cast<int64_t>(running_.size()));
  report.cumulative_hit_rate.push_back(report.hit_rate());
}

void Replica::decay_new_token_ratio() {
  new_token_ratio_ = py_max(config_.min_new_token_ratio, new_token_ratio_ - config_.new_token_ratio_decay);
}

// ---- the scheduler's step ---------------------------------------------------------------------------------------

bool Replica::schedule(Batch& b) {
  if (extend_batch(b)) return true;
  if (running_.empty()) return false;
  decode_batch(b);
  return true;
}

int64_t Replica::reserved_tokens() const {
  return static_cast<int64_t>(static_cast<double>(tokens_left_) * new_token_ratio_);
}

int64_t Replica::charge(const Request& r, int64_t start) const {
  const int64_t fill = r.fill_len(), left = r.max_new_tokens - r.num_output;
  const int64_t done = round_up(start);
  return std::min(round_up(fill) - done + static_cast<int64_t>(static_cast<double>(left) * new_token_ratio_),
                  round_up(fill + left) - done);
}

void Replica::plan_extend(int32_t i, int64_t& budget, int64_t& reserved) {
  Request& r = reqs_[i];
  const int64_t start = r.status == Status::kRunning ? r.kv_len : r.prefix_len;
  const int64_t end = std::min(r.fill_len(), start + budget);
  r.extend_end = end;
  if (end < r.fill_len()) chunked_ = i;
  budget -= end - start;
  reserved += charge(r, start);
}

bool Replica::extend_batch(Batch& b) {
  if (waiting_.empty() && chunked_ < 0) return false;
  int64_t budget = config_.chunked_prefill_size > 0 ? config_.chunked_prefill_size : kUnbounded;
  int64_t reserved = reserved_tokens();
  std::vector<int32_t>& reqs = b.reqs;
  const int32_t chunked = chunked_;
  chunked_ = -1;
  if (chunked >= 0) {  // its whole prompt was charged when it was admitted: it goes on without a new check
    plan_extend(chunked, budget, reserved);
    reqs.push_back(chunked);
  }
  const int64_t max_running = config_.max_running;
  auto can_admit = [&]() {
    return static_cast<int64_t>(running_.size() + reqs.size()) < max_running && budget > 0 && chunked_ < 0;
  };
  if (can_admit() && config_.lpm) {
    Stopwatch watch(&report.match_seconds);
    sort_waiting_by_prefix(true);
  }
  while (!waiting_.empty() && can_admit()) {
    const int32_t i = waiting_.front();
    Request& r = reqs_[i];
    {
      Stopwatch watch(&report.match_seconds);
      match(i, slots_.available() - reserved + tree_.evictable_size());
      tree_.lock_below(r.last_node, RadixTree::kRoot);
    }
    if (config_.in_batch_prefix_caching && next_page_in_batch(i, reqs)) {
      tree_.unlock(r.last_node);
      break;  // it and those behind it wait a step
    }
    const int64_t room = slots_.available() - reserved + tree_.evictable_size();
    if (charge(r, r.prefix_len) > room) {
      tree_.unlock(r.last_node);
      break;
    }
    waiting_.pop_front();
    r.has_walk = false;
    plan_extend(i, budget, reserved);
    reqs.push_back(i);
  }
  if (reqs.empty()) return false;
  // ScheduleBatch.prepare_for_extend: the new pages, after evicting what is short.
  b.extend = true;
  int64_t need = 0;
  for (int32_t i : reqs) {
    const Request& r = reqs_[i];
    const int64_t prefix = r.status == Status::kRunning ? r.kv_len : r.prefix_len;
    b.prefix.push_back(prefix);
    b.seq.push_back(r.extend_end);
    need += (pages_for(r.extend_end) - pages_for(prefix)) * page_size_;
  }
  const int64_t short_by = need - slots_.available();
  bool ok = true;
  if (short_by > 0) {
    report.evicted_tokens += evict(short_by);
    ok = need <= slots_.available();
  }
  if (!ok) {  // Scheduler._undo_admission: the tree and the slots as they were, the new requests queued again
    chunked_ = chunked;
    for (int32_t i : reqs) {
      if (i != chunked) tree_.unlock(reqs_[i].last_node);
    }
    for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) {
      if (*it != chunked) waiting_.push_front(*it);
    }
    b = Batch();
    return false;
  }
  slots_.free -= need;
  for (int32_t i : reqs) {
    Request& r = reqs_[i];
    if (r.status != Status::kRunning) {
      r.cache_protected_len = r.prefix_len;
      r.status = Status::kRunning;
    }
    r.kv_len = r.extend_end;
  }
  return true;
}

int64_t Replica::decode_need(const std::vector<int32_t>& reqs) const {
  if (page_size_ == 1) return static_cast<int64_t>(reqs.size());
  int64_t full = 0;
  for (int32_t i : reqs) full += reqs_[i].kv_len % page_size_ == 0;
  return full * page_size_;
}

void Replica::decode_batch(Batch& b) {
  b.extend = false;
  b.reqs = running_;
  if (decode_need(b.reqs) > slots_.available() + tree_.evictable_size()) retract(b);
  const int64_t need = decode_need(b.reqs);
  const int64_t short_by = need - slots_.available();
  if (short_by > 0) report.evicted_tokens += evict(short_by);
  slots_.free -= need;
  for (int32_t i : b.reqs) ++reqs_[i].kv_len;
  if (!b.retracted.empty()) {
    running_ = b.reqs;
    report.retractions += static_cast<int64_t>(b.retracted.size());
    for (int32_t i : b.retracted) {
      tokens_left_ -= reqs_[i].max_new_tokens - reqs_[i].num_output;
      untrack_tail(i);
    }
    for (auto it = b.retracted.rbegin(); it != b.retracted.rend(); ++it) waiting_.push_front(*it);
    new_token_ratio_ = config_.init_new_token_ratio;
  } else {
    decay_new_token_ratio();
  }
}

void Replica::retract(Batch& b) {
  // ScheduleBatch.retract_decode: the requests that generated least go first, longest prompt first among equals.
  std::vector<int32_t> order = b.reqs;
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    const Request& a = reqs_[x];
    const Request& c = reqs_[y];
    if (a.num_output != c.num_output) return a.num_output < c.num_output;
    return a.input_len > c.input_len;
  });
  int64_t need = decode_need(b.reqs);
  for (size_t k = 0; k + 1 < order.size(); ++k) {
    if (need <= slots_.available() + tree_.evictable_size()) break;
    const int32_t victim = order[k];
    if (page_size_ == 1 || reqs_[victim].kv_len % page_size_ == 0) need -= page_size_;
    release(victim);
    b.retracted.push_back(victim);
  }
  if (b.retracted.empty()) return;
  std::vector<int32_t> kept;
  for (int32_t i : b.reqs) {
    if (reqs_[i].status == Status::kRunning) kept.push_back(i);
  }
  b.reqs.swap(kept);
}

void Replica::release(int32_t i) {
  if (config_.cache_decode_pages) cache_req(i, false);
  Request& r = reqs_[i];
  slots_.free += pages_for(r.kv_len - r.cache_protected_len) * page_size_;
  if (r.last_node >= 0) tree_.unlock(r.last_node);
  r.status = Status::kRetracted;
  r.kv_len = r.prefix_len = r.cache_protected_len = r.extend_end = 0;
  r.last_node = -1;
}

void Replica::process(const Batch& b, std::vector<int32_t>& finished) {
  if (b.extend) {
    std::vector<int32_t> joined;
    for (int32_t i : b.reqs) {
      Request& r = reqs_[i];
      const bool decoding = r.extend_end >= r.fill_len();  // a middle chunk samples nothing
      if (decoding) {
        ++r.num_output;
        if (r.num_output >= r.max_new_tokens) {
          finish(i, finished);
          continue;
        }
        joined.push_back(i);
        tokens_left_ += r.max_new_tokens - r.num_output;
      }
      // The prefilled tokens enter the tree now, as SGLang checkpoints every prefilled request.
      cache_req(i, false);
      if (decoding && config_.cache_decode_pages) track_tail(i);
    }
    running_.insert(running_.end(), joined.begin(), joined.end());
    return;
  }
  std::vector<int32_t> still;
  still.reserve(b.reqs.size());
  for (int32_t i : b.reqs) {
    Request& r = reqs_[i];
    if (++r.num_output < r.max_new_tokens) {
      still.push_back(i);
    } else {
      finish(i, finished);
    }
  }
  running_.swap(still);
  tokens_left_ -= static_cast<int64_t>(b.reqs.size());
}

void Replica::finish(int32_t i, std::vector<int32_t>& finished) {
  untrack_tail(i);
  cache_req(i, true);
  reqs_[i].status = Status::kFinished;
  finished.push_back(i);
}

int64_t Replica::evict(int64_t tokens) {
  Stopwatch watch(&report.evict_seconds);
  return tree_.evict(tokens);
}

// RadixCache._cache_req on the Scheduler's path: the request's whole pages go in below its locked prefix; a
// finished request frees its duplicates and its partial tail and unlocks; a running one moves its lock down.
void Replica::cache_req(int32_t i, bool finished) {
  Stopwatch watch(&report.insert_release_seconds);
  Request& r = reqs_[i];
  const int64_t kv_len = r.kv_len, protected_len = r.cache_protected_len;
  const int64_t aligned = kv_len - kv_len % page_size_;
  if (!finished && aligned <= protected_len) return;
  int64_t cached = protected_len;
  int32_t node = r.last_node;
  if (aligned > protected_len) {
    const auto [on_device, last] = tree_.insert(r.rid, r.last_node, protected_len, aligned);
    cached = on_device;
    node = last;
  }
  if (finished) {
    slots_.free += (cached - protected_len) + (kv_len > aligned ? page_size_ : 0);
    tree_.unlock(r.last_node);
    return;
  }
  slots_.free += cached - protected_len;  // another request cached these meanwhile: the tree's slots serve
  tree_.lock_below(node, r.last_node);
  r.last_node = node;
  r.prefix_len = aligned;
  r.cache_protected_len = aligned;
}

void Replica::track_tail(int32_t i) {
  Request& r = reqs_[i];
  if (static_cast<int64_t>(tails_.size()) < tree_.num_node_slots()) tails_.resize(tree_.num_node_slots());
  r.tail_node = r.last_node;
  tails_[r.last_node].push_back(i);
}

void Replica::untrack_tail(int32_t i) {
  Request& r = reqs_[i];
  if (r.tail_node < 0) return;
  std::vector<int32_t>& list = tails_[r.tail_node];
  list.erase(std::find(list.begin(), list.end(), i));
  r.tail_node = -1;
}

// ---- admission --------------------------------------------------------------------------------------------------

void Replica::keep_walk(Request& r, int64_t key_len, const Walk& w) {
  r.has_walk = true;
  r.walk = w;
  r.walk_key_len = key_len;
  r.next_page = w.child < 0 && w.matched + page_size_ <= key_len;
  r.rank = -w.num_tokens();
  r.walk_version = tree_.node(w.node).child_version;
}

// PrefixRanker.sort: the first lpm_window waiting requests, longest cached prefix first (stable), each ranked by
// its kept walk while that is still where a walk would stop. Without `take_decode_pages` (a decode run's ranking)
// it returns false, reordering nothing, where a walk ends at a running request's tail.
bool Replica::sort_waiting_by_prefix(bool take_decode_pages) {
  const int64_t n = std::min<int64_t>(config_.lpm_window, static_cast<int64_t>(waiting_.size()));
  std::vector<int64_t> ranks(n);
  bool sorted = true;
  for (int64_t k = 0; k < n; ++k) {
    const int32_t i = waiting_[k];
    Request& r = reqs_[i];
    if (r.has_walk && kept_walk_is_current(r)) {
      ranks[k] = r.rank;
    } else if (take_decode_pages) {
      ranks[k] = rank(i);
    } else {
      if (!rank_without_decode_pages(i)) return false;
      ranks[k] = r.rank;
    }
    if (k && ranks[k] < ranks[k - 1]) sorted = false;
  }
  if (sorted) return true;
  std::vector<int64_t> order(n);
  for (int64_t k = 0; k < n; ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return ranks[x] < ranks[y]; });
  std::vector<int32_t> window(n);
  for (int64_t k = 0; k < n; ++k) window[k] = waiting_[order[k]];
  for (int64_t k = 0; k < n; ++k) waiting_[k] = window[k];
  return true;
}

// PrefixRanker.sort's inline check of a kept walk: still where a walk stops (a node in the tree without a child for
// the key's next page, or a child it went into partway still under that node), and no running request's output
// pages continue it.
bool Replica::kept_walk_is_current(Request& r) {
  const Walk& w = r.walk;
  if (w.child >= 0) {
    return tree_.alive(w.child, w.child_gen) && tree_.alive(w.node, w.node_gen) &&
           tree_.node(w.child).parent == w.node;
  }
  const Node& node = tree_.node(w.node);
  if (!tree_.alive(w.node, w.node_gen) || node.parent < 0) return false;
  if (r.next_page && node.child_version != r.walk_version) {
    if (tree_.has_child_page(w.node, r.rid, w.matched)) return false;
    r.walk_version = node.child_version;  // still no child there: remember since when
  }
  return !in_tails(w.node) || !continues(r, w.node, w.matched);
}

// PrefixRanker._rank (taking decode pages): walks again where the kept walk is stale, and goes on through a running
// request's output pages where the walk ends at its tail.
int64_t Replica::rank(int32_t i) {
  Request& r = reqs_[i];
  const int64_t key_len = r.has_walk ? r.walk_key_len : r.fill_len() - 1;
  bool current = r.has_walk;
  if (current) {
    const Walk& w = r.walk;
    if (w.child >= 0 || !r.next_page || !tree_.alive(w.node, w.node_gen) ||
        tree_.node(w.node).child_version != r.walk_version) {
      current = tree_.walk_is_current(w, r.rid, r.next_page);
    }
  }
  if (!current) keep_walk(r, key_len, tree_.prefix_walk(r.rid, key_len));
  if (r.walk.child < 0 && in_tails(r.walk.node)) {
    Walk w = r.walk;
    while (w.child < 0 && take_decode_pages(i, key_len, w.node, w.matched)) w = tree_.prefix_walk(r.rid, key_len);
    keep_walk(r, key_len, w);
  }
  return r.rank;
}

// PrefixRanker._rank without taking decode pages: false where the (kept or new) walk ends at a running request's
// tail, which only a match can go past.
bool Replica::rank_without_decode_pages(int32_t i) {
  Request& r = reqs_[i];
  const int64_t key_len = r.has_walk ? r.walk_key_len : r.fill_len() - 1;
  if (!r.has_walk || !tree_.walk_is_current(r.walk, r.rid, r.next_page)) {
    keep_walk(r, key_len, tree_.prefix_walk(r.rid, key_len));
  }
  return !(r.walk.child < 0 && in_tails(r.walk.node));
}

// DecodePageTails.continues: whether a running request whose cached prefix ends at `node` (`matched` tokens) has
// written request r's next page as its next full page.
bool Replica::continues(const Request& q, int32_t node, int64_t matched) const {
  if (!q.next_page) return false;
  const int32_t first = tokens_->token(q.rid, matched);  // a page that starts otherwise is not q's next one
  for (int32_t c : tails_[node]) {
    const Request& r = reqs_[c];
    if (r.kv_len - r.kv_len % page_size_ - r.cache_protected_len >= page_size_ &&
        tokens_->token(r.rid, matched) == first &&
        tokens_->first_mismatch(r.rid, q.rid, matched, matched + page_size_) == matched + page_size_) {
      return true;
    }
  }
  return false;
}

// Scheduler._take_decode_pages: when the key of request q (key_len tokens) goes on, after `matched` tokens at
// `node`, with the next full page of output of a running request whose cached prefix ends there, that request's
// full pages enter the tree.
bool Replica::take_decode_pages(int32_t q, int64_t key_len, int32_t node, int64_t matched) {
  if (!in_tails(node)) return false;
  if (key_len < matched + page_size_) return false;
  const int32_t qrid = reqs_[q].rid;
  const int32_t first = tokens_->token(qrid, matched);
  for (int32_t c : tails_[node]) {
    const Request& r = reqs_[c];
    if (r.kv_len - r.kv_len % page_size_ - r.cache_protected_len >= page_size_ &&
        tokens_->token(r.rid, matched) == first &&
        tokens_->first_mismatch(r.rid, qrid, matched, matched + page_size_) == matched + page_size_) {
      untrack_tail(c);
      cache_req(c, false);  // its full pages up to kv_len; the rest are not written yet
      track_tail(c);
      return true;
    }
  }
  return false;
}

// Scheduler._match: the request's cached prefix (taking decode pages where a running request's output continues it);
// a host-only part of at least load_back_threshold tokens is loaded back when the request then fits in `room`.
void Replica::match(int32_t i, int64_t room) {
  Request& r = reqs_[i];
  int64_t from_storage = 0;
  if (r.prefetch.active) {
    from_storage = tree_.finish_prefetch(r.prefetch, r.rid);
    r.prefetch.active = false;
  }
  const int64_t key_len = r.fill_len() - 1;
  Match m = tree_.match_prefix(r.rid, key_len);
  while (m.host_tokens == 0 && take_decode_pages(i, key_len, m.node, tree_.path_len(m.node))) {
    m = tree_.match_prefix(r.rid, key_len);
  }
  int32_t node = m.node;
  r.host_hit_len = r.storage_hit_len = 0;
  const int64_t host = m.host_tokens;
  if (host >= config_.load_back_threshold && host + charge(r, tree_.path_len(m.node) + host) <= room) {
    // Scheduler._evict_for_load_back: what the load is short of, with the matched path locked.
    const int64_t short_by = host - slots_.available();
    if (short_by > 0) {
      tree_.lock_below(m.host_node, RadixTree::kRoot);
      report.evicted_tokens += evict(short_by);
      tree_.unlock(m.host_node);
    }
    if (tree_.load_back(m.host_node, host)) {
      node = m.host_node;
      r.host_hit_len = host;
      r.storage_hit_len = std::min(from_storage, host);
    }
  }
  r.last_node = node;
  r.prefix_len = r.cache_protected_len = tree_.path_len(node);
}

bool Replica::next_page_in_batch(int32_t i, const std::vector<int32_t>& batch) const {
  const Request& r = reqs_[i];
  const int64_t end = r.cache_protected_len + page_size_;
  if (r.fill_len() - 1 < end) return false;
  for (int32_t o : batch) {
    const Request& other = reqs_[o];
    if (other.extend_end >= end && tokens_->first_mismatch(other.rid, r.rid, 0, end) == end) return true;
  }
  return false;
}

}  // namespace kvmem
