#include "store.h"

namespace kvmem {

int64_t SimStore::exists(const uint64_t* names, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) {
    if (index_.find(key_of(names[i])) < 0) return i;
  }
  return n;
}

int64_t SimStore::get(const uint64_t* names, int64_t n) {
  const int64_t got = exists(names, n);
  use(names, got);
  stats.hits += got;
  return got;
}

int64_t SimStore::set(const uint64_t* names, int64_t n) {
  const int64_t call = ++calls_;
  int64_t chain = 0;
  for (; chain < n; ++chain) {
    const int32_t present = index_.find(key_of(names[chain]));
    if (present >= 0) {
      entries_[present].call = call;
      continue;
    }
    // PageLRU.make_room, keeping names[:chain] (this chain's pages so far)
    bool fits = capacity_ == 0 || page_size_ <= capacity_;
    while (fits && capacity_ && used_ + page_size_ > capacity_ && head_ >= 0) {
      if (entries_[head_].call == call) {
        fits = false;
      } else {
        drop(head_);
      }
    }
    if (!fits) {
      ++stats.failed_ops;  // no room left but the chain's own pages
      break;
    }
    entries_[add(names[chain])].call = call;
  }
  use(names, chain);
  stats.stored += chain;
  return chain;
}

void SimStore::use(const uint64_t* names, int64_t n) {
  for (int64_t i = n - 1; i >= 0; --i) {
    const int32_t e = index_.find(key_of(names[i]));
    if (e < 0) continue;
    unlink(e);
    push_back(e);
  }
}

void SimStore::unlink(int32_t e) {
  Entry& x = entries_[e];
  (x.prev >= 0 ? entries_[x.prev].next : head_) = x.next;
  (x.next >= 0 ? entries_[x.next].prev : tail_) = x.prev;
}

void SimStore::push_back(int32_t e) {
  entries_[e].prev = tail_;
  entries_[e].next = -1;
  (tail_ >= 0 ? entries_[tail_].next : head_) = e;
  tail_ = e;
}

int32_t SimStore::add(uint64_t name) {
  int32_t e;
  if (!free_.empty()) {
    e = free_.back();
    free_.pop_back();
  } else {
    e = static_cast<int32_t>(entries_.size());
    entries_.emplace_back();
  }
  entries_[e].name = name;
  push_back(e);
  index_.put(key_of(name), e);
  used_ += page_size_;
  return e;
}

void SimStore::drop(int32_t e) {
  unlink(e);
  index_.erase(key_of(entries_[e].name));
  free_.push_back(e);
  used_ -= page_size_;
}

}  // namespace kvmem
