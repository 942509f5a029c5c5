// The radix tree of one replica's device cache, as kvmem/radix_tree.py + kvmem/radix_cache.py keep it for the
// Scheduler: the same walks, splits, lock references, access clock, node ids, evictable set and pins, so that
// every decision (what a match returns, which leaf an eviction takes) is the one the Python tree makes.
//
// What it leaves out is what no decision reads: slot values (the allocator only counts free slots; which slot
// a token gets changes nothing in a replay), key bytes (a node's key is a run of the request that inserted it,
// at the same positions: see tokens.h), namespaces, events and policies other than the key functions of
// kvmem/eviction/base.py (lru, lfu, fifo, priority; a replay's requests all have priority 0).
#pragma once

#include <cstdint>
#include <vector>

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
  int32_t num_children = 0;
  int32_t heap_pos = -1;   // its entry in the evictable set (the policy's, or the pinned one when pin != 0)
  int32_t next_same = -1;  // the next child of its parent with the same first token (pages of several tokens)
  uint32_t gen = 0;        // bumped when the slot is reused, so that a kept walk sees its node left the tree
  uint32_t child_version = 0;  // bumped when it gains a child: a kept walk that stopped here needs no lookup
  bool alive = false;
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

// The evictable leaves ordered by (k1, k2, id): an indexed binary heap (a node knows its position), so that
// add, remove, re-key and pop are O(log n) without allocating.
class LeafHeap {
 public:
  struct Entry {
    int64_t k1, k2, id;
    int32_t node;
  };
  explicit LeafHeap(std::vector<Node>* nodes) : nodes_(nodes) {}
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
  std::vector<Entry> heap_;
  std::vector<Node>* nodes_;
};

// (parent, first token of the child's key) -> the first such child; its siblings with the same first token
// (possible only with pages of several tokens) follow through Node::next_same. Open addressing, linear probing.
class ChildMap {
 public:
  ChildMap() { rehash(1024); }
  int32_t find(int32_t parent, int32_t token) const;
  void put(int32_t parent, int32_t token, int32_t node);
  void erase(int32_t parent, int32_t token);

 private:
  static uint64_t key_of(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  }
  int64_t slot_of(uint64_t key) const { return static_cast<int64_t>(TraceTokens::mix64(key) & mask_); }
  void rehash(int64_t capacity);
  std::vector<uint64_t> keys_;
  std::vector<int32_t> values_;
  uint64_t mask_ = 0;
  int64_t used_ = 0;
};

class RadixTree {
 public:
  RadixTree(const TraceTokens* tokens, SlotCount* slots, int64_t page_size, Policy policy, int64_t pin_budget);

  static constexpr int32_t kRoot = 0;
  const Node& node(int32_t n) const { return nodes_[n]; }
  int64_t path_len(int32_t n) const { return nodes_[n].depth + nodes_[n].len; }
  int64_t num_node_slots() const { return static_cast<int64_t>(nodes_.size()); }
  int64_t evictable_size() const { return evictable_size_; }
  int64_t protected_size() const { return protected_size_; }
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

  // match_prefix of q's first key_len tokens: the node whose path is the longest cached prefix (whole pages).
  int32_t match_prefix(int32_t q, int64_t key_len);
  // _insert below `below` (whose path is q's first `start` tokens) of q's tokens [start, end): returns the tokens
  // of q the tree held already (from the root) and the node whose path is q's first `end` tokens.
  std::pair<int64_t, int32_t> insert(int32_t q, int32_t below, int64_t start, int64_t end);
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
  // pins
  int64_t pin_budget_;
  int64_t pinned_tokens_ = 0;
  int64_t pin_seq_ = 0;
  std::vector<PinRecord> pins_;
  std::vector<int32_t> free_pins_;
  int32_t pins_head_ = -1, pins_tail_ = -1;
};

}  // namespace kvmem
