// A router's index of one replica (kvmem.router.BlockIndex's "GPU" blocks of that replica), fed by the replica's
// KV events alone: the device pages it reported stored and not yet removed.
//
// BlockIndex keeps a set of chained page hashes; a hash names a page's whole prefix, so the set is a set of token
// prefixes, and a replica's device pages are prefix-closed (a page's device copy implies its prefix's). PageView
// keeps that set as a tree of runs of trace requests' tokens (as RadixTree keeps keys), named exactly rather than
// by 64-bit hashes: a request's cached prefix on the replica (BlockIndex.prefix_overlaps) is one walk down it.
#pragma once

#include <cstdint>
#include <vector>

#include "events.h"
#include "tokens.h"
#include "tree.h"

namespace kvmem {

class PageView {
 public:
  PageView(const TraceTokens* tokens, int64_t page_size);

  // Applies a step's page runs, in order.
  void apply(const std::vector<PageRun>& runs);
  // How many leading pages of trace request q's first `tokens` tokens (whole pages) the replica holds.
  int64_t overlap(int32_t q, int64_t tokens) const;
  int64_t num_pages() const { return pages_; }

 private:
  struct ViewNode {
    int32_t parent = -1, src = -1;
    int64_t depth = 0, len = 0;
    int32_t num_children = 0, next_same = -1;
  };
  struct Stop {
    int32_t node;     // the deepest node matched whole
    int64_t matched;  // tokens through it
    int32_t child;    // the node the walk went partway into (-1: none)
  };

  Stop descend(int32_t q, int64_t end) const;
  int32_t find_child(int32_t parent, int32_t q, int64_t pos) const;
  void link(int32_t parent, int32_t child);
  void unlink(int32_t parent, int32_t child);
  int32_t new_node(int32_t parent, int32_t src, int64_t depth, int64_t len);
  void store(int32_t src, int64_t start, int64_t end);
  void remove(int32_t src, int64_t start, int64_t end);

  const TraceTokens* tokens_;
  int64_t page_size_;
  std::vector<ViewNode> nodes_;
  std::vector<int32_t> free_;
  ChildMap children_;
  int64_t pages_ = 0;
};

}  // namespace kvmem
