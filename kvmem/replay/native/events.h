// The KV events of one replica (kvmem/events: BlockStored, BlockRemoved), as much of them as a cluster's router
// reads: how many events and pages each step reported (EventCounts), and, for the policies that read the block
// index, the runs of device pages that entered and left the device, in order (PageView applies them).
//
// A page is named by its place, not its hash: a run is the pages [start, end) of trace request `src`'s tokens, the
// whole prefix [0, end) being the pages' identity, as the chained page hashes (kvmem.page_hash) name prefixes.
#pragma once

#include <cstdint>
#include <vector>

namespace kvmem {

struct PageRun {
  int32_t src;
  int64_t start, end;  // tokens, whole pages
  bool stored;         // true: entered the device ("GPU" BlockStored); false: left it (BlockRemoved)
};

struct EventLog {
  bool keep_runs = false;   // whether the router reads the index (else only the counts are kept)
  int64_t events = 0;       // events reported since the last take: a step that reports none sends no batch
  int64_t stored_blocks = 0, removed_blocks = 0;
  std::vector<PageRun> runs;

  void device_stored(int32_t src, int64_t start, int64_t end, int64_t page_size) {
    ++events;
    stored_blocks += (end - start) / page_size;
    if (keep_runs) runs.push_back({src, start, end, true});
  }
  // An eviction call reports one BlockRemoved for all the nodes it took: a run per node, then `removal()`.
  void device_removed_run(int32_t src, int64_t start, int64_t end, int64_t page_size) {
    removed_blocks += (end - start) / page_size;
    if (keep_runs) runs.push_back({src, start, end, false});
  }
  void removal() { ++events; }
  void host_stored(int64_t pages) {
    ++events;
    stored_blocks += pages;
  }
  void host_removed(int64_t pages) {
    ++events;
    removed_blocks += pages;
  }
  void clear() {
    events = stored_blocks = removed_blocks = 0;
    runs.clear();
  }
};

}  // namespace kvmem
