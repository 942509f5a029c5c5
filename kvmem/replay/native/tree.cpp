#include "tree.h"

#include <stdexcept>

namespace kvmem {

// ---- LeafHeap ---------------------------------------------------------------------------------------------------

void LeafHeap::place(int64_t i, const Entry& e) {
  heap_[i] = e;
  pos(e.node) = static_cast<int32_t>(i);
}

void LeafHeap::sift_up(int64_t i, Entry e) {
  while (i > 0) {
    const int64_t p = (i - 1) / 2;
    if (!less(e, heap_[p])) break;
    place(i, heap_[p]);
    i = p;
  }
  place(i, e);
}

void LeafHeap::sift_down(int64_t i, Entry e) {
  const int64_t n = size();
  while (true) {
    int64_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && less(heap_[c + 1], heap_[c])) ++c;
    if (!less(heap_[c], e)) break;
    place(i, heap_[c]);
    i = c;
  }
  place(i, e);
}

void LeafHeap::push(const Entry& e) {
  heap_.push_back(e);
  sift_up(size() - 1, e);
}

void LeafHeap::remove(int32_t node) {
  const int64_t i = pos(node);
  pos(node) = -1;
  const Entry last = heap_.back();
  heap_.pop_back();
  if (i == size()) return;
  if (i > 0 && less(last, heap_[(i - 1) / 2])) {
    sift_up(i, last);
  } else {
    sift_down(i, last);
  }
}

void LeafHeap::update(int32_t node, int64_t k1, int64_t k2) {
  const int64_t i = pos(node);
  Entry e = heap_[i];
  e.k1 = k1;
  e.k2 = k2;
  if (i > 0 && less(e, heap_[(i - 1) / 2])) {
    sift_up(i, e);
  } else {
    sift_down(i, e);
  }
}

int32_t LeafHeap::pop() {
  if (heap_.empty()) return -1;
  const int32_t top = heap_[0].node;
  remove(top);
  return top;
}

// ---- IndexMap ---------------------------------------------------------------------------------------------------

namespace {
constexpr uint64_t kEmptyKey = ~0ULL;
}

void IndexMap::rehash(int64_t capacity) {
  std::vector<uint64_t> keys(capacity, kEmptyKey);
  std::vector<int32_t> values(capacity, -1);
  keys_.swap(keys);
  values_.swap(values);
  mask_ = static_cast<uint64_t>(capacity - 1);
  used_ = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == kEmptyKey) continue;
    int64_t j = slot_of(keys[i]);
    while (keys_[j] != kEmptyKey) j = (j + 1) & mask_;
    keys_[j] = keys[i];
    values_[j] = values[i];
    ++used_;
  }
}

int32_t IndexMap::find(uint64_t key) const {
  for (int64_t i = slot_of(key);; i = (i + 1) & mask_) {
    if (keys_[i] == key) return values_[i];
    if (keys_[i] == kEmptyKey) return -1;
  }
}

void IndexMap::put(uint64_t key, int32_t value) {
  if (2 * (used_ + 1) > static_cast<int64_t>(keys_.size())) rehash(2 * static_cast<int64_t>(keys_.size()));
  int64_t i = slot_of(key);
  while (keys_[i] != kEmptyKey && keys_[i] != key) i = (i + 1) & mask_;
  if (keys_[i] == kEmptyKey) ++used_;
  keys_[i] = key;
  values_[i] = value;
}

void IndexMap::erase(uint64_t key) {
  int64_t i = slot_of(key);
  while (keys_[i] != key) {
    if (keys_[i] == kEmptyKey) return;
    i = (i + 1) & mask_;
  }
  // Backward-shift deletion: entries after the hole that may live there move back, so no tombstones build up.
  for (int64_t j = i;;) {
    j = (j + 1) & mask_;
    if (keys_[j] == kEmptyKey) break;
    const int64_t home = slot_of(keys_[j]);
    const bool stays = (j > i) ? (home > i && home <= j) : (home > i || home <= j);
    if (!stays) {
      keys_[i] = keys_[j];
      values_[i] = values_[j];
      i = j;
    }
  }
  keys_[i] = kEmptyKey;
  --used_;
}

// ---- RadixTree --------------------------------------------------------------------------------------------------

RadixTree::RadixTree(const TraceTokens* tokens, SlotCount* slots, int64_t page_size, Policy policy,
                     int64_t pin_budget, const HostTier& host)
    : tokens_(tokens), slots_(slots), page_size_(page_size), policy_(policy), leaves_(&nodes_, &Node::heap_pos),
      pinned_(&nodes_, &Node::heap_pos), host_(host), host_leaves_(&nodes_, &Node::host_heap_pos),
      host_free_(host.capacity_tokens), pin_budget_(pin_budget) {
  nodes_.reserve(1024);
  new_node(-1, -1, 0, 0, 0);  // the root, id 0
}

int32_t RadixTree::new_node(int32_t parent, int32_t src, int64_t depth, int64_t len, int64_t created) {
  int32_t n;
  if (!free_nodes_.empty()) {
    n = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    n = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& x = nodes_[n];
  const uint32_t gen = x.gen;
  x = Node();
  x.gen = gen;
  x.alive = true;
  x.parent = parent;
  x.src = src;
  x.depth = depth;
  x.len = len;
  x.created = created;
  x.last_access = created;
  x.id = next_id_++;
  return n;
}

// A node that left the tree: its slot is reused, and a kept walk through it sees that by its generation.
void RadixTree::free_node(int32_t n) {
  Node& x = nodes_[n];
  x.parent = -1;
  x.alive = false;
  ++x.gen;
  free_nodes_.push_back(n);
}

int32_t RadixTree::find_child(int32_t parent, int32_t q, int64_t pos) const {
  return children_.find_page(nodes_, *tokens_, page_size_, parent, q, pos);
}

void RadixTree::link_child(int32_t parent, int32_t child) { children_.link(nodes_, *tokens_, parent, child); }

void RadixTree::unlink_child(int32_t parent, int32_t child) { children_.unlink(nodes_, *tokens_, parent, child); }

Walk RadixTree::descend(int32_t q, int32_t from, int64_t start, int64_t end) const {
  const ChildMap::Descent d = children_.descend(nodes_, *tokens_, page_size_, q, from, start, end);
  if (d.child < 0) return Walk{d.node, nodes_[d.node].gen, d.matched, -1, 0, 0};
  return Walk{d.node, nodes_[d.node].gen, d.matched, d.child, nodes_[d.child].gen, d.into};
}

bool RadixTree::walk_is_current(const Walk& w, int32_t q, bool next_page) const {
  if (w.child >= 0) {
    return alive(w.child, w.child_gen) && alive(w.node, w.node_gen) && nodes_[w.child].parent == w.node;
  }
  if (!alive(w.node, w.node_gen)) return false;
  return !next_page || !has_child_page(w.node, q, w.matched);
}

int32_t RadixTree::walk_to_node(const Walk& w) { return w.child < 0 ? w.node : split(w.child, w.into_child); }

int32_t RadixTree::split(int32_t child, int64_t into_child) {
  const int32_t parent = nodes_[child].parent;
  const int32_t head = new_node(parent, nodes_[child].src, nodes_[child].depth, into_child, nodes_[child].created);
  Node& h = nodes_[head];
  Node& c = nodes_[child];
  h.lock_ref = c.lock_ref;
  h.last_access = c.last_access;
  h.hit_count = c.hit_count;
  h.on_device = c.on_device;
  h.host = c.host;
  h.stored = c.stored;
  h.device_children = c.on_device ? 1 : 0;
  children_.cut(nodes_, *tokens_, parent, child, head, into_child);
  if (store_ != nullptr) name_node(head);
  // The key functions read no length: their places stay.
  if (c.heap_pos >= 0) rekey(child);
  if (c.host_heap_pos >= 0) {
    const LeafHeap::Entry e = entry_of(child);
    host_leaves_.update(child, e.k1, e.k2);
  }
  return head;
}

int32_t RadixTree::add_leaf(int32_t parent, int32_t src, int64_t depth, int64_t len) {
  const int32_t leaf = new_node(parent, src, depth, len, clock_);
  if (nodes_[parent].heap_pos >= 0) remove_evictable(parent);
  link_child(parent, leaf);
  ++nodes_[parent].device_children;
  ++nodes_[parent].child_version;
  if (store_ != nullptr) name_node(leaf);
  evictable_size_ += len;
  add_evictable(leaf);
  return leaf;
}

void RadixTree::touch(int32_t last, bool hit) {
  const int64_t now = ++clock_;
  for (int32_t n = last; nodes_[n].parent >= 0; n = nodes_[n].parent) {
    nodes_[n].last_access = now;
    if (hit) ++nodes_[n].hit_count;
  }
}

Match RadixTree::match_prefix(int32_t q, int64_t key_len) {
  const int32_t n = walk_to_node(prefix_walk(q, key_len));
  if (n == kRoot) return {n, 0, -1};
  touch(n, true);
  if (!has_host()) {
    if (nodes_[n].heap_pos >= 0) rekey(n);
    return {n, 0, -1};
  }
  const auto [device_node, host_tokens] = device_ancestor(n);
  matched(n, device_node);
  return {device_node, host_tokens, host_tokens ? n : -1};
}

std::pair<int64_t, int32_t> RadixTree::insert(int32_t q, int32_t below, int64_t start, int64_t end) {
  const Walk w = descend(q, below, start, end);
  const int64_t matched = w.num_tokens();
  const int64_t on_device = has_host() ? matched - device_gap(w) : matched;
  int32_t last = walk_to_node(w);
  if (on_device < matched) revive_path(last);
  touch(last, false);
  if (matched < end) {
    last = add_leaf(last, q, matched, end - matched);
    report_stored(last);
  } else if (nodes_[last].heap_pos >= 0) {
    rekey(last);
  }
  if ((matched < end || on_device < matched) && has_host() && host_.write_policy == WritePolicy::kWriteThrough) {
    backup_path(last);
  }
  return {on_device, last};
}

void RadixTree::lock_below(int32_t n, int32_t ancestor) {
  for (; n != ancestor; n = nodes_[n].parent) {
    if (nodes_[n].lock_ref == 0) protect(n);
    ++nodes_[n].lock_ref;
  }
}

void RadixTree::unlock(int32_t n) {
  for (; nodes_[n].parent >= 0; n = nodes_[n].parent) {
    if (--nodes_[n].lock_ref == 0) unprotect(n);
  }
}

void RadixTree::protect(int32_t n) {
  Node& x = nodes_[n];
  if (!x.on_device) {  // a host-only node: its host copy cannot be host-evicted now
    host_evictable_size_ -= x.len;
    host_protected_size_ += x.len;
    if (x.host_heap_pos >= 0) remove_host_evictable(n);
    return;
  }
  evictable_size_ -= x.len;
  protected_size_ += x.len;
  if (x.heap_pos >= 0) remove_evictable(n);
}

void RadixTree::unprotect(int32_t n) {
  Node& x = nodes_[n];
  if (!x.on_device) {
    host_protected_size_ -= x.len;
    host_evictable_size_ += x.len;
    if (x.num_children == 0) add_host_evictable(n);
    return;
  }
  protected_size_ -= x.len;
  evictable_size_ += x.len;
  if (x.device_children == 0) add_evictable(n);
}

LeafHeap::Entry RadixTree::entry_of(int32_t n) const {
  const Node& x = nodes_[n];
  switch (policy_) {
    case Policy::kLru:
      return {x.last_access, 0, x.id, n};
    case Policy::kLfu:
      return {x.hit_count, x.last_access, x.id, n};
    case Policy::kFifo:
      return {x.created, 0, x.id, n};
    case Policy::kPriority:
      break;
  }
  return {0, x.last_access, x.id, n};  // a replay's requests all have priority 0
}

void RadixTree::add_evictable(int32_t n) {
  if (nodes_[n].pin) {
    pinned_.push({nodes_[n].pin, 0, nodes_[n].id, n});
  } else {
    leaves_.push(entry_of(n));
  }
}

void RadixTree::remove_evictable(int32_t n) {
  if (nodes_[n].pin) {
    pinned_.remove(n);
  } else {
    leaves_.remove(n);
  }
}

void RadixTree::rekey(int32_t n) {
  if (nodes_[n].pin) return;  // a pinned leaf keeps its pin's order
  const LeafHeap::Entry e = entry_of(n);
  leaves_.update(n, e.k1, e.k2);
}

int32_t RadixTree::next_victim() {
  int32_t n = leaves_.pop();
  if (n < 0 && !pinned_.empty()) {
    n = pinned_.pop();
    drop_pins_of(n);
  }
  return n;
}

int64_t RadixTree::evict(int64_t num_tokens) {
  int64_t freed = 0;
  bool removed = false;
  while (freed < num_tokens) {
    const int32_t n = next_victim();
    if (n < 0) break;
    freed += nodes_[n].len;
    if (events_ != nullptr) events_->device_removed_run(nodes_[n].src, nodes_[n].depth, path_len(n), page_size_);
    removed = true;
    leave_device(n);
  }
  evictable_size_ -= freed;
  slots_->free += freed;
  if (removed && events_ != nullptr) events_->removal();
  return freed;
}

// An evicted device leaf: with a host copy it stays as host-only (write_back makes one now if it can), else it
// leaves the tree; its parent may become a device leaf.
void RadixTree::leave_device(int32_t n) {
  if (has_host()) {
    if (!nodes_[n].host && host_.write_policy == WritePolicy::kWriteBack) backup_path(n);
    if (nodes_[n].host) {
      demote(n);
      return;
    }
  }
  const int32_t parent = nodes_[n].parent;
  unlink_child(parent, n);
  free_node(n);
  Node& p = nodes_[parent];
  --p.device_children;
  if (p.device_children == 0 && p.lock_ref == 0 && p.parent >= 0 && p.heap_pos < 0) add_evictable(parent);
}

// ---- pins -------------------------------------------------------------------------------------------------------

int32_t RadixTree::find_pin(int32_t q, int64_t len, uint64_t hash) const {
  for (int32_t r = pins_head_; r >= 0; r = pins_[r].next) {
    const PinRecord& p = pins_[r];
    if (p.len == len && p.hash == hash && tokens_->first_mismatch(p.src, q, 0, len) == len) return r;
  }
  return -1;
}

void RadixTree::unlink_pin(int32_t record) {
  PinRecord& p = pins_[record];
  (p.prev >= 0 ? pins_[p.prev].next : pins_head_) = p.next;
  (p.next >= 0 ? pins_[p.next].prev : pins_tail_) = p.prev;
  free_pins_.push_back(record);
}

int64_t RadixTree::pin(int32_t q, int64_t len) {
  const int64_t ntok = len - len % page_size_;
  const uint64_t hash = tokens_->content_hash(q, 0, ntok);
  int32_t n = walk_to_node(descend(q, kRoot, 0, ntok));
  if (has_host()) n = device_ancestor(n).first;  // a pin marks what the device holds
  const int32_t old = find_pin(q, ntok, hash);
  if (old >= 0) {
    const PinRecord p = pins_[old];
    unlink_pin(old);
    drop_pin(p.node, p.tokens);
  }
  if (n == kRoot) return 0;
  const int64_t tokens = path_len(n);
  if (tokens > pin_budget_) return 0;  // alone past the budget: it pins nothing and costs the other pins nothing
  int32_t r;
  if (!free_pins_.empty()) {
    r = free_pins_.back();
    free_pins_.pop_back();
  } else {
    r = static_cast<int32_t>(pins_.size());
    pins_.emplace_back();
  }
  pins_[r] = PinRecord{q, ntok, hash, n, tokens, pins_tail_, -1};
  (pins_tail_ >= 0 ? pins_[pins_tail_].next : pins_head_) = r;
  pins_tail_ = r;
  ++nodes_[n].pin_count;
  pinned_tokens_ += tokens;
  set_pin(n, ++pin_seq_);
  while (pinned_tokens_ > pin_budget_) {
    const PinRecord p = pins_[pins_head_];
    unlink_pin(pins_head_);
    drop_pin(p.node, p.tokens);
  }
  return tokens;
}

void RadixTree::set_pin(int32_t n, int64_t pin) {
  if (nodes_[n].heap_pos < 0) {
    nodes_[n].pin = pin;
    return;
  }
  remove_evictable(n);
  nodes_[n].pin = pin;
  add_evictable(n);
}

void RadixTree::drop_pin(int32_t n, int64_t tokens) {
  pinned_tokens_ -= tokens;
  if (--nodes_[n].pin_count == 0) set_pin(n, 0);
}

void RadixTree::drop_pins_of(int32_t n) {
  for (int32_t r = pins_head_; r >= 0;) {
    const int32_t next = pins_[r].next;
    if (pins_[r].node == n) {
      pinned_tokens_ -= pins_[r].tokens;
      unlink_pin(r);
    }
    r = next;
  }
  nodes_[n].pin_count = 0;
  nodes_[n].pin = 0;
}

}  // namespace kvmem
