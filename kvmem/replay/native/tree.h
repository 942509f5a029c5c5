// The radix tree of one replica's cache, as kvmem/radix_tree.py + kvmem/radix_cache.py keep it for the Scheduler
// (and kvmem/tiers/hiradix_cache.py with a host tier): the same walks, splits, lock references, access clock, node
// ids, evictable sets and pins, so that every decision (what a match returns, which leaf an eviction takes, which
// host copy goes) is the one the Python tree makes.
//
// What it leaves out is what no decision reads: slot values (the allocators only count free slots; which slot
// a token gets changes nothing in a replay), key bytes (a node's key is a run of the request that inserted it,
// at the same positions: see tokens.h), namespaces, and policies other than the key functions of
// kvmem/eviction/base.py (lru, lfu, fifo, priority; a replay's requests all have priority 0).
//
// The host tier (host_tier.cpp) is a HostSlotPool's: copies complete at once, so a backup in flight never outlives
// the call that started it. A node is on device, backed up (a host copy), or both; both sets are prefix-closed.
#pragma once

#include <cstdint>
#include <vector>

#include "events.h"
#include "tokens.h"

namespace kvmem {

// Free KV slots, in tokens (whole pages): PagedTokenAllocator's count without its slot ids.
struct SlotCount {
  int64_t size = 0;
  int64_t free = 0;
  int64_t available() const { return free; }
  int64_t used() const { return size - free; }
};

enum class Policy { kLru, kLfu, kFifo, kPriority };
enum class WritePolicy { kWriteThrough, kWriteThroughSelective, kWriteBack };

// The host tier: `capacity_tokens` 0 for none.
struct HostTier {
  int64_t capacity_tokens = 0;  // whole pages
  WritePolicy write_policy = WritePolicy::kWriteThrough;
};

// HiRadixCache.stats and its storage link's: tokens moved between tiers.
struct TierStats {
  int64_t loaded_tokens = 0, backed_up_tokens = 0, host_evicted_tokens = 0;
  int64_t prefetched_tokens = 0, stored_tokens = 0;
};

class SimStore;

// A prompt's pages read from the storage tier ahead of its admission (storage_link.Prefetch): `pages` pages from
// token `start`, of which the leading `got` arrived; held in host slots until the request's match takes them.
struct Prefetch {
  bool active = false;
  int64_t start = 0, pages = 0, got = 0;
};

struct Node {
  int32_t parent = -1;  // -1: a root, or a node that left the tree (radix_tree's parent None)
  int32_t src = -1;     // the request whose sequence holds this node's key at [depth, depth + len)
  int64_t depth = 0;    // tokens on the path above it
  int64_t len = 0;      // tokens of its key (= slots of its value)
  int64_t last_access = 0, created = 0, hit_count = 0;
  int64_t id = 0;
  int64_t pin = 0;        // 0, or the order of its newest pin
  int32_t pin_count = 0;  // pins that mark it (RadixTree._pins_per_node)
  int32_t lock_ref = 0;
  int32_t num_children = 0;     // in either tier
  int32_t device_children = 0;  // on device
  int32_t heap_pos = -1;   // its entry in the evictable set (the policy's, or the pinned one when pin != 0)
  int32_t host_heap_pos = -1;  // its entry in the host-evictable set
  int32_t next_same = -1;  // the next child of its parent with the same first token (pages of several tokens)
  uint32_t gen = 0;        // bumped when the slot is reused, so that a kept walk sees its node left the tree
  uint32_t child_version = 0;  // bumped when it gains a child: a kept walk that stopped here needs no lookup
  bool alive = false;
  bool on_device = true;  // its value holds device slots (else it is host-only)
  bool host = false;      // it has a host copy
  bool stored = false;    // its pages were handed to the storage tier
  uint64_t last_hash = 0;  // with a storage tier: the name of its last page (SimStore)
};

// Where a walk of a key stopped (radix_tree.Walk, in tokens): `node` is the deepest node matched whole, its path
// covering the first `matched` tokens; `child` is the next node when the match goes `into_child` tokens (whole
// pages, less than the child's key) into it, else -1.
struct Walk {
  int32_t node = 0;
  uint32_t node_gen = 0;
  int64_t matched = 0;
  int32_t child = -1;
  uint32_t child_gen = 0;
  int64_t into_child = 0;
  int64_t num_tokens() const { return matched + into_child; }
};

// The evictable leaves ordered by (k1, k2, id): an indexed binary heap (a node knows its position in the field
// `pos`), so that add, remove, re-key and pop are O(log n) without allocating.
class LeafHeap {
 public:
  struct Entry {
    int64_t k1, k2, id;
    int32_t node;
  };
  LeafHeap(std::vector<Node>* nodes, int32_t Node::*pos) : nodes_(nodes), pos_(pos) {}
  bool empty() const { return heap_.empty(); }
  int64_t size() const { return static_cast<int64_t>(heap_.size()); }
  void push(const Entry& e);
  void remove(int32_t node);
  void update(int32_t node, int64_t k1, int64_t k2);
  int32_t pop();

 private:
  static bool less(const Entry& a, const Entry& b) {
    if (a.k1 != b.k1) return a.k1 < b.k1;
    if (a.k2 != b.k2) return a.k2 < b.k2;
    return a.id < b.id;
  }
  void place(int64_t i, const Entry& e);
  void sift_up(int64_t i, Entry e);
  void sift_down(int64_t i, Entry e);
  int32_t& pos(int32_t node) { return (*nodes_)[node].*pos_; }
  std::vector<Entry> heap_;
  std::vector<Node>* nodes_;
  int32_t Node::*pos_;
};

// uint64 keys (any but ~0) -> int32 values: open addressing, linear probing, backward-shift deletion.
class IndexMap {
 public:
  IndexMap() { rehash(1024); }
  int32_t find(uint64_t key) const;  // -1 when absent
  void put(uint64_t key, int32_t value);
  void erase(uint64_t key);

 private:
  int64_t slot_of(uint64_t key) const { return static_cast<int64_t>(TraceTokens::mix64(key) & mask_); }
  void rehash(int64_t capacity);
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  uint64_t mask_ = 0;
  int64_t used_ = 0;
};

// (parent, first token of the child's key) -> the first such child; its siblings with the same first token
// (possible only with pages of several tokens) follow through Node::next_same.
class ChildMap {
 public:
  int32_t find(int32_t parent, int32_t token) const { return map_.find(key_of(parent, token)); }
  void put(int32_t parent, int32_t token, int32_t node) { map_.put(key_of(parent, token), node); }
  void erase(int32_t parent, int32_t token) { map_.erase(key_of(parent, token)); }

  // The tree and the router's page view keep their children alike; `nodes` is either's node array (each node has
  // src, depth, next_same and num_children).
  // The child of `parent` whose first page is request q's tokens from `pos` (-1: none).
  template <class Nodes>
  int32_t find_page(const Nodes& nodes, const TraceTokens& tokens, int64_t page_size, int32_t parent, int32_t q,
                    int64_t pos) const {
    int32_t c = find(parent, tokens.token(q, pos));
    if (page_size == 1) return c;
    for (; c >= 0; c = nodes[c].next_same) {
      if (tokens.first_mismatch(nodes[c].src, q, pos, pos + page_size) == pos + page_size) return c;
    }
    return -1;
  }
  template <class Nodes>
  void link(Nodes& nodes, const TraceTokens& tokens, int32_t parent, int32_t child) {
    auto& c = nodes[child];
    const int32_t token = tokens.token(c.src, c.depth);
    c.next_same = find(parent, token);
    put(parent, token, child);
    ++nodes[parent].num_children;
  }
  // Where a walk of request q's tokens [matched, end) from `node` stops: the deepest node matched whole, the tokens
  // through it, and the child it went partway into (-1: none) with how far (whole pages before the first token
  // that differs, or all of the key's rest).
  struct Descent {
    int32_t node;
    int64_t matched;
    int32_t child;
    int64_t into;
  };
  template <class Nodes>
  Descent descend(const Nodes& nodes, const TraceTokens& tokens, int64_t page_size, int32_t q, int32_t node,
                  int64_t matched, int64_t end) const {
    while (matched < end) {
      const int32_t c = find_page(nodes, tokens, page_size, node, q, matched);
      if (c < 0) break;
      const auto& child = nodes[c];
      const int64_t child_end = matched + child.len;
      const int64_t limit = child_end <= end ? child_end : end;
      const int64_t m = tokens.first_mismatch(child.src, q, matched, limit);
      if (m == limit && child_end <= end) {
        node = c;
        matched = child_end;
        continue;
      }
      return {node, matched, c, m == limit ? limit - matched : (m - matched) / page_size * page_size};
    }
    return {node, matched, -1, 0};
  }
  // `child`'s first `into` tokens become `head`, which takes its place under `parent`; the rest hangs under head.
  template <class Nodes>
  void cut(Nodes& nodes, const TraceTokens& tokens, int32_t parent, int32_t child, int32_t head, int64_t into) {
    unlink(nodes, tokens, parent, child);
    link(nodes, tokens, parent, head);
    auto& c = nodes[child];
    c.depth += into;
    c.len -= into;
    c.parent = head;
    link(nodes, tokens, head, child);
  }
  template <class Nodes>
  void unlink(Nodes& nodes, const TraceTokens& tokens, int32_t parent, int32_t child) {
    auto& c = nodes[child];
    const int32_t token = tokens.token(c.src, c.depth);
    const int32_t head = find(parent, token);
    if (head == child) {
      if (c.next_same >= 0) {
        put(parent, token, c.next_same);
      } else {
        erase(parent, token);
      }
    } else {
      int32_t prev = head;
      while (nodes[prev].next_same != child) prev = nodes[prev].next_same;
      nodes[prev].next_same = c.next_same;
    }
    c.next_same = -1;
    --nodes[parent].num_children;
  }

 private:
  static uint64_t key_of(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  }
  IndexMap map_;
};

// What a match found (HiRadixCache.match_prefix): the deepest node on device, and the host-only tokens below it
// down to `host_node` (0 and -1 without).
struct Match {
  int32_t node;
  int64_t host_tokens;
  int32_t host_node;
};

class RadixTree {
 public:
  RadixTree(const TraceTokens* tokens, SlotCount* slots, int64_t page_size, Policy policy, int64_t pin_budget,
            const HostTier& host = HostTier());

  static constexpr int32_t kRoot = 0;
  const Node& node(int32_t n) const { return nodes_[n]; }
  int64_t path_len(int32_t n) const { return nodes_[n].depth + nodes_[n].len; }
  int64_t num_node_slots() const { return static_cast<int64_t>(nodes_.size()); }
  int64_t evictable_size() const { return evictable_size_; }
  int64_t protected_size() const { return protected_size_; }
  bool has_host() const { return host_.capacity_tokens > 0; }
  int64_t host_evictable_size() const { return host_evictable_size_; }
  int64_t host_protected_size() const { return host_protected_size_; }
  int64_t host_available() const { return host_free_; }
  const TierStats& stats() const { return stats_; }
  // Where the tree reports its events (none: nullptr).
  void set_event_log(EventLog* log) { events_ = log; }
  // The storage tier under the host tier (a cluster's replicas share one); none: nullptr.
  void set_store(SimStore* store) { store_ = store; }
  const SimStore* store() const { return store_; }
  int64_t page_size() const { return page_size_; }
  const TraceTokens& tokens() const { return *tokens_; }

  // _descend: the first `end` tokens (whole pages from `start`) of request q's sequence, from `from`, whose path
  // is q's first `start` tokens.
  Walk descend(int32_t q, int32_t from, int64_t start, int64_t end) const;
  // _prefix_walk of q's key of `key_len` tokens from the root.
  Walk prefix_walk(int32_t q, int64_t key_len) const { return descend(q, kRoot, 0, key_len - key_len % page_size_); }
  // _walk_is_current for a kept walk whose key goes on with a page after it (`next_page`) or not.
  bool walk_is_current(const Walk& w, int32_t q, bool next_page) const;
  bool alive(int32_t n, uint32_t gen) const { return nodes_[n].alive && nodes_[n].gen == gen; }
  // Whether `parent` has a child whose first page is q's page at `pos`.
  bool has_child_page(int32_t parent, int32_t q, int64_t pos) const { return find_child(parent, q, pos) >= 0; }

  // match_prefix of q's first key_len tokens (whole pages): the node whose path is the longest prefix on device,
  // and the host-only part after it.
  Match match_prefix(int32_t q, int64_t key_len);
  // _insert below `below` (whose path is q's first `start` tokens) of q's tokens [start, end): returns the tokens
  // of q the device held already (from the root; host-only nodes on the way take q's slots) and the node whose
  // path is q's first `end` tokens.
  std::pair<int64_t, int32_t> insert(int32_t q, int32_t below, int64_t start, int64_t end);
  // HiRadixCache.load_back: the host-only nodes ending at `host_node` (`host_tokens`, as a match found them) onto
  // the device; false, with nothing loaded, when the device is short.
  bool load_back(int32_t host_node, int64_t host_tokens);
  // StoragePrefetch.prefetch of q's first key_len tokens: the whole pages after what the tree holds that the store
  // has, read into host slots (inactive when none).
  Prefetch prefetch(int32_t q, int64_t key_len);
  // finish_prefetch: hangs what arrived under the tree's prefix, as host-only; the tokens attached.
  int64_t finish_prefetch(const Prefetch& p, int32_t q);
  void lock_below(int32_t n, int32_t ancestor);
  void unlock(int32_t n);
  // evict: frees at least `num_tokens` tokens from unlocked leaves in policy order (or all there are).
  int64_t evict(int64_t num_tokens);
  // pin of q's first `len` tokens (whole pages): the tokens pinned, as RadixTree.pin returns them.
  int64_t pin(int32_t q, int64_t len);

 private:
  struct PinRecord {
    int32_t src;  // the key is src's first `len` tokens
    int64_t len;
    uint64_t hash;
    int32_t node;
    int64_t tokens;
    int32_t prev, next;  // insertion order (an OrderedDict's), oldest first
  };

  int32_t new_node(int32_t parent, int32_t src, int64_t depth, int64_t len, int64_t created);
  void free_node(int32_t n);
  int32_t find_child(int32_t parent, int32_t q, int64_t pos) const;
  void link_child(int32_t parent, int32_t child);
  void unlink_child(int32_t parent, int32_t child);
  int32_t walk_to_node(const Walk& w);
  int32_t split(int32_t child, int64_t into_child);
  int32_t add_leaf(int32_t parent, int32_t src, int64_t depth, int64_t len);
  void touch(int32_t last, bool hit);
  void protect(int32_t n);
  void unprotect(int32_t n);
  LeafHeap::Entry entry_of(int32_t n) const;
  void add_evictable(int32_t n);
  void remove_evictable(int32_t n);
  void rekey(int32_t n);
  int32_t next_victim();
  void leave_device(int32_t n);
  // host tier (host_tier.cpp)
  std::pair<int32_t, int64_t> device_ancestor(int32_t n) const;
  void matched(int32_t n, int32_t device_node);
  int64_t device_gap(const Walk& w) const;
  void revive_path(int32_t last);
  void to_device_tier(int32_t n);
  void demote(int32_t n);
  void add_host_evictable(int32_t n);
  void remove_host_evictable(int32_t n);
  bool alloc_host(int64_t tokens);
  int64_t evict_host(int64_t num_tokens);
  int64_t unbacked_path(int32_t n, std::vector<int32_t>* path) const;
  bool start_backup(const std::vector<int32_t>& nodes, int64_t tokens);
  void backup_path(int32_t n);
  void backup_hot_path(int32_t n);
  void report_backed_up(const std::vector<int32_t>& nodes);
  // storage tier (storage_tier.cpp)
  uint64_t chain_names(uint64_t parent, int32_t q, int64_t from, int64_t to, std::vector<uint64_t>* names) const;
  void name_node(int32_t n);
  uint64_t name_at(const Walk& w) const;
  std::pair<int64_t, int64_t> attach(const Prefetch& p, int32_t q);
  void write_pages(const std::vector<int32_t>& nodes);
  void report_stored(int32_t n) {
    if (events_ != nullptr) events_->device_stored(nodes_[n].src, nodes_[n].depth, path_len(n), page_size_);
  }
  void set_pin(int32_t n, int64_t pin);
  void drop_pin(int32_t n, int64_t tokens);
  void drop_pins_of(int32_t n);
  int32_t find_pin(int32_t q, int64_t len, uint64_t hash) const;
  void unlink_pin(int32_t record);

  const TraceTokens* tokens_;
  SlotCount* slots_;
  int64_t page_size_;
  Policy policy_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_nodes_;
  ChildMap children_;
  LeafHeap leaves_;
  LeafHeap pinned_;
  int64_t clock_ = 0;
  int64_t next_id_ = 0;
  int64_t evictable_size_ = 0;
  int64_t protected_size_ = 0;
  // host tier
  HostTier host_;
  LeafHeap host_leaves_;
  int64_t host_free_ = 0;
  int64_t host_evictable_size_ = 0;
  int64_t host_protected_size_ = 0;
  TierStats stats_;
  EventLog* events_ = nullptr;
  std::vector<int32_t> path_;  // scratch for backups
  // storage tier
  SimStore* store_ = nullptr;
  int64_t prefetch_held_ = 0;  // host slots reading pages for prefetches, not yet the tree's
  std::vector<uint64_t> names_;  // scratch for page names
  // pins
  int64_t pin_budget_;
  int64_t pinned_tokens_ = 0;
  int64_t pin_seq_ = 0;
  std::vector<PinRecord> pins_;
  std::vector<int32_t> free_pins_;
  int32_t pins_head_ = -1, pins_tail_ = -1;
};

}  // namespace kvmem
