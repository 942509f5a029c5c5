// The host tier of RadixTree (kvmem/tiers/hiradix_cache.py and backups.py over a HostSlotPool): host-only nodes,
// the host-evictable set under the device's policy kind, the write policies, load-backs and host eviction. A backup
// completes within the call that starts it (the pool's copies are instant), so the lock a Python backup holds while
// in flight is taken and released with nothing in between, and is left out here.
#include <algorithm>

#include "tree.h"

namespace kvmem {

namespace {
constexpr int64_t kSelectiveHits = 2;  // backups._SELECTIVE_HITS
}

std::pair<int32_t, int64_t> RadixTree::device_ancestor(int32_t n) const {
  int64_t tokens = 0;
  while (nodes_[n].parent >= 0 && !nodes_[n].on_device) {
    tokens += nodes_[n].len;
    n = nodes_[n].parent;
  }
  return {n, tokens};
}

// HiRadixCache._matched: a match that ended at `n` (touched), whose device part ends at `device_node`.
void RadixTree::matched(int32_t n, int32_t device_node) {
  if (nodes_[device_node].heap_pos >= 0) rekey(device_node);
  if (nodes_[n].host_heap_pos >= 0) {
    const LeafHeap::Entry e = entry_of(n);
    host_leaves_.update(n, e.k1, e.k2);
  }
  if (host_.write_policy == WritePolicy::kWriteThroughSelective && device_node != kRoot) backup_hot_path(device_node);
}

int64_t RadixTree::device_gap(const Walk& w) const {
  int64_t tokens = device_ancestor(w.node).second;
  if (w.child >= 0 && !nodes_[w.child].on_device) tokens += w.into_child;
  return tokens;
}

// The host-only nodes at the end of root..last back on device (root side first), in the inserting request's slots.
void RadixTree::revive_path(int32_t last) {
  std::vector<int32_t> nodes;
  for (int32_t n = last; nodes_[n].parent >= 0 && !nodes_[n].on_device; n = nodes_[n].parent) nodes.push_back(n);
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) to_device_tier(*it);
}

void RadixTree::to_device_tier(int32_t n) {
  Node& x = nodes_[n];
  x.on_device = true;
  const int32_t parent = x.parent;
  ++nodes_[parent].device_children;
  if (nodes_[parent].heap_pos >= 0) remove_evictable(parent);
  if (x.host_heap_pos >= 0) remove_host_evictable(n);
  if (x.lock_ref) {
    protected_size_ += x.len;  // its host copy was protected as a locked node, and stays so
  } else {
    evictable_size_ += x.len;
    host_evictable_size_ -= x.len;
    host_protected_size_ += x.len;
    if (x.device_children == 0) add_evictable(n);
  }
  report_stored(n);
}

// A backed-up device leaf gives its device slots up (the caller counts them freed) and stays as host-only.
void RadixTree::demote(int32_t n) {
  Node& x = nodes_[n];
  x.on_device = false;
  const int32_t parent = x.parent;
  Node& p = nodes_[parent];
  --p.device_children;
  if (p.device_children == 0 && p.heap_pos < 0 && p.lock_ref == 0 && p.parent >= 0) add_evictable(parent);
  host_protected_size_ -= x.len;
  host_evictable_size_ += x.len;
  if (x.num_children == 0) add_host_evictable(n);
}

void RadixTree::add_host_evictable(int32_t n) { host_leaves_.push(entry_of(n)); }

void RadixTree::remove_host_evictable(int32_t n) { host_leaves_.remove(n); }

bool RadixTree::alloc_host(int64_t tokens) {
  const int64_t short_by = tokens - host_free_;
  if (short_by > 0) evict_host(short_by);
  if (host_free_ < tokens) return false;
  host_free_ -= tokens;
  return true;
}

int64_t RadixTree::evict_host(int64_t num_tokens) {
  int64_t freed = 0;
  while (freed < num_tokens) {
    const int32_t n = host_leaves_.pop();
    if (n < 0) break;
    const int32_t parent = nodes_[n].parent;
    unlink_child(parent, n);
    freed += nodes_[n].len;
    free_node(n);
    const Node& p = nodes_[parent];
    if (p.parent >= 0 && p.num_children == 0 && p.lock_ref == 0 && !p.on_device) add_host_evictable(parent);
  }
  if (freed) {
    host_evictable_size_ -= freed;
    host_free_ += freed;
    stats_.host_evicted_tokens += freed;
    if (events_ != nullptr) events_->host_removed(freed / page_size_);
  }
  return freed;
}

// The device nodes from the first without a host copy down to `n`, root side first, into `path`; their tokens.
int64_t RadixTree::unbacked_path(int32_t n, std::vector<int32_t>* path) const {
  path->clear();
  int64_t tokens = 0;
  for (; nodes_[n].parent >= 0 && !nodes_[n].host; n = nodes_[n].parent) {
    path->push_back(n);
    tokens += nodes_[n].len;
  }
  std::reverse(path->begin(), path->end());
  return tokens;
}

// Host slots for `nodes` (evicting host-only leaves when short); false, changing nothing else, when short.
bool RadixTree::start_backup(const std::vector<int32_t>& nodes, int64_t tokens) {
  if (!alloc_host(tokens)) return false;
  for (int32_t n : nodes) nodes_[n].host = true;
  host_protected_size_ += tokens;
  stats_.backed_up_tokens += tokens;
  return true;
}

// backup_path and, for write_back, _backup_now: root..n's nodes without a host copy get one.
void RadixTree::backup_path(int32_t n) {
  const int64_t tokens = unbacked_path(n, &path_);
  if (path_.empty() || !start_backup(path_, tokens)) return;
  report_backed_up(path_);
}

void RadixTree::backup_hot_path(int32_t n) {
  while (nodes_[n].parent >= 0 && nodes_[n].hit_count < kSelectiveHits) n = nodes_[n].parent;
  if (nodes_[n].parent >= 0) backup_path(n);
}

void RadixTree::report_backed_up(const std::vector<int32_t>& nodes) {
  if (events_ != nullptr) {
    for (int32_t n : nodes) events_->host_stored(nodes_[n].len / page_size_);
  }
  if (store_ != nullptr) write_pages(nodes);
}

bool RadixTree::load_back(int32_t host_node, int64_t host_tokens) {
  const int32_t device_node = device_ancestor(host_node).first;
  std::vector<int32_t> nodes;
  for (int32_t n = host_node; n != device_node; n = nodes_[n].parent) nodes.push_back(n);
  lock_below(host_node, kRoot);  // the device prefix stays, and the host nodes cannot be host-evicted
  bool loaded = false;
  const int64_t short_by = host_tokens - slots_->free;
  if (short_by <= evictable_size_) {  // else nothing: a load that cannot happen must not cost other prefixes
    if (short_by > 0) evict(short_by);
    if (slots_->free >= host_tokens) {
      slots_->free -= host_tokens;
      for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) to_device_tier(*it);
      stats_.loaded_tokens += host_tokens;
      loaded = true;
    }
  }
  unlock(host_node);
  return loaded;
}

}  // namespace kvmem
