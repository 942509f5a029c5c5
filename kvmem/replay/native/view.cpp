#include "view.h"

#include <stdexcept>

namespace kvmem {

PageView::PageView(const TraceTokens* tokens, int64_t page_size) : tokens_(tokens), page_size_(page_size) {
  nodes_.emplace_back();  // the root
}

int32_t PageView::new_node(int32_t parent, int32_t src, int64_t depth, int64_t len) {
  int32_t n;
  if (!free_.empty()) {
    n = free_.back();
    free_.pop_back();
  } else {
    n = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  nodes_[n] = ViewNode{parent, src, depth, len, 0, -1};
  return n;
}

int32_t PageView::find_child(int32_t parent, int32_t q, int64_t pos) const {
  return children_.find_page(nodes_, *tokens_, page_size_, parent, q, pos);
}

void PageView::link(int32_t parent, int32_t child) { children_.link(nodes_, *tokens_, parent, child); }

void PageView::unlink(int32_t parent, int32_t child) { children_.unlink(nodes_, *tokens_, parent, child); }

PageView::Stop PageView::descend(int32_t q, int64_t end) const {
  const ChildMap::Descent d = children_.descend(nodes_, *tokens_, page_size_, q, 0, 0, end);
  return {d.node, d.matched + d.into, d.into ? d.child : -1};
}

int64_t PageView::overlap(int32_t q, int64_t tokens) const {
  return descend(q, tokens - tokens % page_size_).matched / page_size_;
}

void PageView::apply(const std::vector<PageRun>& runs) {
  for (const PageRun& run : runs) {
    if (run.stored) {
      store(run.src, run.start, run.end);
    } else {
      remove(run.src, run.start, run.end);
    }
  }
}

// Pages [start, end) of src's prefix enter: the view holds [0, start) of it (device pages are prefix-closed) and
// none after, so the run hangs at `start`, splitting a node that goes on past it with other pages.
void PageView::store(int32_t src, int64_t start, int64_t end) {
  const Stop at = descend(src, start);
  if (at.matched != start) throw std::logic_error("page view: a stored run's prefix is not in the view");
  int32_t parent = at.node;
  if (at.child >= 0) {  // cut the child at `start`: its head stays under `parent`
    ViewNode& c = nodes_[at.child];
    const int64_t into = start - c.depth;
    const int32_t head = new_node(parent, c.src, c.depth, into);
    children_.cut(nodes_, *tokens_, parent, at.child, head, into);
    parent = head;
  }
  link(parent, new_node(parent, src, start, end - start));
  pages_ += (end - start) / page_size_;
}

// Pages [start, end) of src's prefix leave: a device leaf's, so they end a path of the view, within one node.
void PageView::remove(int32_t src, int64_t start, int64_t end) {
  const Stop at = descend(src, end);
  const int32_t n = at.node;
  ViewNode& x = nodes_[n];
  if (at.matched != end || at.child >= 0 || x.num_children || x.depth > start || n == 0) {
    throw std::logic_error("page view: a removed run is not a leaf of the view");
  }
  if (x.depth == start) {
    unlink(x.parent, n);
    free_.push_back(n);
  } else {
    x.len = start - x.depth;
  }
  pages_ -= (end - start) / page_size_;
}

}  // namespace kvmem
