// kvmem/storage/sim_store.py's SimStore: the names of the pages a storage tier holds, at most `capacity_tokens`
// tokens of them (0: unbounded), evicted least recently used first with each written chain kept whole, as
// kvmem/storage/lru.py orders them; no bytes. Pages are named by a 64-bit chain over their prefix's tokens
// (RadixTree::page_name), as the Python store names them by 64 bits of their SHA-256 digest.
//
// A replay's storage calls run in the order they are issued: the Python link's worker thread takes them in that
// order, and with prefetch_policy "wait_complete" every read and lookup waits for what was queued before it.
#pragma once

#include <cstdint>
#include <vector>

#include "tree.h"

namespace kvmem {

struct StoreStats {
  int64_t hits = 0, stored = 0, failed_ops = 0;  // pages read, pages written, calls that could not store a page
};

class SimStore {
 public:
  SimStore(int64_t capacity_tokens, int64_t page_size) : capacity_(capacity_tokens), page_size_(page_size) {}

  StoreStats stats;
  // batch_exists: how many leading pages of `names` it holds.
  int64_t exists(const uint64_t* names, int64_t n) const;
  // batch_get: the leading pages it holds, marked used; how many.
  int64_t get(const uint64_t* names, int64_t n);
  // batch_set: stores the leading pages that fit (making room by LRU, never evicting a page of this chain);
  // returns the chain's pages it holds now.
  int64_t set(const uint64_t* names, int64_t n);

 private:
  struct Entry {
    uint64_t name;
    int64_t call;  // the last set() that wrote or found it
    int32_t prev, next;
  };
  static uint64_t key_of(uint64_t name) { return name == ~0ULL ? ~1ULL : name; }  // ~0 marks a free slot
  void use(const uint64_t* names, int64_t n);  // root first: marked used deepest first, the root last
  void unlink(int32_t e);
  void push_back(int32_t e);
  int32_t add(uint64_t name);
  void drop(int32_t e);

  int64_t capacity_, page_size_;
  int64_t used_ = 0;
  IndexMap index_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_;
  int32_t head_ = -1, tail_ = -1;  // least recently used first
  int64_t calls_ = 0;
};

}  // namespace kvmem
