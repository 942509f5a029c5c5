// The storage tier of RadixTree (kvmem/tiers/storage_prefetch.py and the writes of backups.py) over a SimStore:
// backed-up pages written once, a prompt's pages after what the tree holds read ahead of its admission into host
// slots, and hung in the tree as host-only nodes when its match comes. Pages are named by a chain over their
// prefix's tokens, each node keeping the name of its last page (as the Python tree keeps its pages' digests).
#include <algorithm>

#include "store.h"
#include "tree.h"

namespace kvmem {

namespace {
constexpr int64_t kReadChunkPages = 64;      // StorageLink.read_chunk_pages: one batch_get per chunk
constexpr uint64_t kNameSalt = 0x6B766D656D2D7067ULL;  // keeps a first page's name apart from its content hash
}  // namespace

// Appends to `names` (when given) the names of q's pages [from, to) following the page named `parent`; returns the
// last one's (`parent` when there are none).
uint64_t RadixTree::chain_names(uint64_t parent, int32_t q, int64_t from, int64_t to,
                                std::vector<uint64_t>* names) const {
  for (int64_t p = from; p < to; p += page_size_) {
    parent = TraceTokens::mix64(TraceTokens::mix64(parent ^ kNameSalt) ^ tokens_->content_hash(q, p, p + page_size_));
    if (names != nullptr) names->push_back(parent);
  }
  return parent;
}

void RadixTree::name_node(int32_t n) {
  Node& x = nodes_[n];
  x.last_hash = chain_names(nodes_[x.parent].last_hash, x.src, x.depth, x.depth + x.len, nullptr);
}

// The name of the page that ends where `w` stopped (StoragePrefetch._digest_at).
uint64_t RadixTree::name_at(const Walk& w) const {
  const uint64_t parent = nodes_[w.node].last_hash;
  if (w.child < 0) return parent;
  return chain_names(parent, nodes_[w.child].src, w.matched, w.matched + w.into_child, nullptr);
}

Prefetch RadixTree::prefetch(int32_t q, int64_t key_len) {
  Prefetch p;
  if (store_ == nullptr) return p;
  const int64_t end = key_len - key_len % page_size_;
  const Walk w = descend(q, kRoot, 0, end);
  const int64_t start = w.num_tokens();
  if (start >= end) return p;
  names_.clear();
  chain_names(name_at(w), q, start, end, &names_);
  const int64_t pages = store_->exists(names_.data(), static_cast<int64_t>(names_.size()));
  if (!pages) return p;
  // The prefix the pages will hang from is locked while host room is made: evicting it would waste the read.
  const int32_t held = w.child >= 0 ? w.child : w.node;
  if (held != kRoot) lock_below(held, kRoot);
  const bool room = alloc_host(pages * page_size_);
  if (held != kRoot) unlock(held);
  if (!room) return p;
  prefetch_held_ += pages * page_size_;
  p = {true, start, pages, 0};
  bool whole = true;  // the pages after a short chunk hang from nothing
  for (int64_t i = 0; i < pages; i += kReadChunkPages) {
    const int64_t asked = std::min(kReadChunkPages, pages - i);
    const int64_t loaded = store_->get(names_.data() + i, asked);
    if (whole) p.got += loaded;
    whole = whole && loaded == asked;
  }
  return p;
}

int64_t RadixTree::finish_prefetch(const Prefetch& p, int32_t q) {
  prefetch_held_ -= p.pages * page_size_;
  const auto [skip, end] = attach(p, q);
  const int64_t attached = end - skip;
  host_free_ += (p.pages - attached) * page_size_;  // the pages it read that the tree does not take
  stats_.prefetched_tokens += attached * page_size_;
  return attached * page_size_;
}

// StoragePrefetch._attach: pages [skip, end) of the prefetch under the node where the tree's prefix ends now.
std::pair<int64_t, int64_t> RadixTree::attach(const Prefetch& p, int32_t q) {
  if (p.got == 0) return {0, 0};
  const int64_t end = p.start + p.got * page_size_;
  const Walk w = descend(q, kRoot, 0, end);
  const int64_t now = w.num_tokens();
  if (now < p.start || now >= end) return {0, 0};  // its prefix left the tree, or the tree has them all by now
  const int64_t skip = (now - p.start) / page_size_;
  const int32_t parent = walk_to_node(w);
  if (parent != kRoot) {
    if (!nodes_[parent].host) backup_path(parent);  // a host-only child needs a parent with a host copy
    if (!nodes_[parent].host) return {0, 0};
  }
  const int32_t n = new_node(parent, q, now, end - now, clock_);
  nodes_[n].on_device = false;
  nodes_[n].host = true;
  nodes_[n].stored = true;
  link_child(parent, n);
  ++nodes_[parent].child_version;
  name_node(n);
  if (nodes_[parent].host_heap_pos >= 0) remove_host_evictable(parent);
  host_evictable_size_ += end - now;
  add_host_evictable(n);
  if (events_ != nullptr) events_->host_stored((end - now) / page_size_);
  return {skip, p.got};
}

// Backups of `nodes` completed: the pages of those not yet handed to the storage tier are written, in one call.
void RadixTree::write_pages(const std::vector<int32_t>& nodes) {
  names_.clear();
  bool any = false;
  for (int32_t n : nodes) {
    const Node& x = nodes_[n];
    if (x.stored) continue;
    chain_names(nodes_[x.parent].last_hash, x.src, x.depth, x.depth + x.len, &names_);
    any = true;
  }
  if (!any) return;
  stats_.stored_tokens += store_->set(names_.data(), static_cast<int64_t>(names_.size())) * page_size_;
  for (int32_t n : nodes) nodes_[n].stored = true;
}

}  // namespace kvmem
