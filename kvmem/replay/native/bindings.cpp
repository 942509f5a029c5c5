// kvmem.replay._native: the compiled replay engine's Python module (see kvmem/replay/native_replay.py, which is
// its only caller and checks every argument before it gets here).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "cluster.h"
#include "driver.h"
#include "replica.h"
#include "tokens.h"

namespace py = pybind11;
using kvmem::Policy;
using kvmem::Rejection;
using kvmem::ReplicaConfig;

namespace {

template <typename T>
using Array = py::array_t<T, py::array::c_style | py::array::forcecast>;

// A trace's token sources, keeping the numpy arrays the tokens are read from alive.
struct Trace {
  kvmem::TraceTokens tokens;
  std::vector<py::object> keep;
};

std::shared_ptr<Trace> trace_from_blocks(Array<int64_t> hash_ids, Array<int64_t> block_offsets,
                                         Array<int64_t> input_lens, Array<int64_t> output_lens,
                                         Array<uint64_t> seeds, Array<int32_t> out_tokens,
                                         Array<int64_t> out_offsets) {
  auto t = std::make_shared<Trace>();
  t->keep = {hash_ids, block_offsets, out_tokens, out_offsets};
  t->tokens.set_blocks(hash_ids.data(), block_offsets.data(), input_lens.data(), input_lens.size());
  t->tokens.set_outputs(output_lens.data(), seeds.data(), out_tokens.data(), out_offsets.data());
  return t;
}

std::shared_ptr<Trace> trace_from_tokens(Array<int32_t> tokens, Array<int64_t> offsets, Array<int64_t> output_lens,
                                         Array<uint64_t> seeds, Array<int32_t> out_tokens,
                                         Array<int64_t> out_offsets) {
  auto t = std::make_shared<Trace>();
  t->keep = {tokens, offsets, out_tokens, out_offsets};
  t->tokens.set_prompts(tokens.data(), offsets.data(), output_lens.size());
  t->tokens.set_outputs(output_lens.data(), seeds.data(), out_tokens.data(), out_offsets.data());
  return t;
}

Policy policy_of(const std::string& name) {
  if (name == "lru") return Policy::kLru;
  if (name == "lfu") return Policy::kLfu;
  if (name == "fifo") return Policy::kFifo;
  if (name == "priority") return Policy::kPriority;
  throw py::value_error("the native engine has no eviction policy " + name);
}

kvmem::WritePolicy write_policy_of(const std::string& name) {
  if (name == "write_through") return kvmem::WritePolicy::kWriteThrough;
  if (name == "write_through_selective") return kvmem::WritePolicy::kWriteThroughSelective;
  if (name == "write_back") return kvmem::WritePolicy::kWriteBack;
  throw py::value_error("the native engine has no write policy " + name);
}

ReplicaConfig config_of(const py::dict& d) {
  ReplicaConfig c;
  c.capacity_tokens = d["capacity_tokens"].cast<int64_t>();
  c.context_len = d["context_len"].cast<int64_t>();
  c.page_size = d["page_size"].cast<int64_t>();
  c.eviction_policy = policy_of(d["eviction_policy"].cast<std::string>());
  c.lpm = d["schedule_policy"].cast<std::string>() == "lpm";
  c.max_running = d["max_running"].cast<int64_t>();
  c.chunked_prefill_size = d["chunked_prefill_size"].cast<int64_t>();
  c.cache_decode_pages = d["cache_decode_pages"].cast<bool>();
  c.in_batch_prefix_caching = d["in_batch_prefix_caching"].cast<bool>();
  c.pin_prefix_tokens = d["pin_prefix_tokens"].cast<int64_t>();
  c.pin_budget = d["pin_budget"].cast<double>();
  c.lpm_window = d["lpm_window"].cast<int64_t>();
  c.init_new_token_ratio = d["init_new_token_ratio"].cast<double>();
  c.min_new_token_ratio = d["min_new_token_ratio"].cast<double>();
  c.new_token_ratio_decay = d["new_token_ratio_decay"].cast<double>();
  c.load_back_threshold = d["load_back_threshold"].cast<int64_t>();
  if (!d["host_capacity_tokens"].is_none()) {
    c.host.capacity_tokens = d["host_capacity_tokens"].cast<int64_t>();
    c.host.write_policy = write_policy_of(d["write_policy"].cast<std::string>());
    c.storage = d["storage"].cast<bool>();
    c.storage_capacity_tokens = d["storage_capacity_tokens"].cast<int64_t>();
  }
  const py::dict cost = d["cost"].cast<py::dict>();
  c.cost.roofline = cost["roofline"].cast<bool>();
  for (auto [name, field] : {std::pair{"decode_step_s", &c.cost.decode_step_s},
                             std::pair{"prefill_tokens_per_s", &c.cost.prefill_tokens_per_s},
                             std::pair{"flops_per_s", &c.cost.flops_per_s},
                             std::pair{"bytes_per_s", &c.cost.bytes_per_s},
                             std::pair{"weight_bytes", &c.cost.weight_bytes},
                             std::pair{"pair_flops", &c.cost.pair_flops},
                             std::pair{"token_flops", &c.cost.token_flops},
                             std::pair{"window_pair_flops", &c.cost.window_pair_flops},
                             std::pair{"linear_flops", &c.cost.linear_flops},
                             std::pair{"full_kv_bytes", &c.cost.full_kv_bytes},
                             std::pair{"window_kv_bytes", &c.cost.window_kv_bytes},
                             std::pair{"state_bytes", &c.cost.state_bytes},
                             std::pair{"kv_bytes", &c.cost.kv_bytes},
                             std::pair{"links", &c.cost.links},
                             std::pair{"h2d_gbps", &c.cost.h2d_gbps},
                             std::pair{"storage_gbps", &c.cost.storage_gbps},
                             std::pair{"storage_latency_us", &c.cost.storage_latency_us}}) {
    if (cost.contains(name)) *field = cost[name].cast<double>();
  }
  if (cost.contains("window")) c.cost.window = cost["window"].cast<int64_t>();
  if (cost.contains("chunked")) c.cost.chunked = cost["chunked"].cast<bool>();
  return c;
}

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

py::dict report_of(const kvmem::Replica& replica) {
  const kvmem::ReplicaReport& r = replica.report;
  py::dict d;
  d["capacity_tokens"] = replica.capacity_tokens();
  d["requests"] = r.requests;
  d["prompt_tokens"] = r.prompt_tokens;
  d["cached_tokens"] = r.cached_tokens;
  d["evicted_tokens"] = r.evicted_tokens;
  d["retractions"] = r.retractions;
  d["rejected"] = r.rejected;
  d["output_tokens"] = r.output_tokens;
  d["prefill_seconds_saved"] = r.prefill_seconds_saved;
  d["time_s"] = to_numpy(r.time_s);
  d["tokens_used"] = to_numpy(r.tokens_used);
  d["evictable_tokens"] = to_numpy(r.evictable_tokens);
  d["running"] = to_numpy(r.running);
  d["cumulative_hit_rate"] = to_numpy(r.cumulative_hit_rate);
  d["ttft_s"] = to_numpy(r.ttft_s);
  d["first_token_s"] = to_numpy(r.first_token_s);
  d["host_cached_tokens"] = r.host_cached_tokens;
  d["storage_cached_tokens"] = r.storage_cached_tokens;
  const kvmem::TierStats& tiers = replica.tree().stats();
  d["loaded_tokens"] = tiers.loaded_tokens;
  d["backed_up_tokens"] = tiers.backed_up_tokens;
  d["host_evicted_tokens"] = tiers.host_evicted_tokens;
  d["prefetched_tokens"] = tiers.prefetched_tokens;
  d["stored_tokens"] = tiers.stored_tokens;
  const kvmem::SimStore* store = replica.tree().store();
  d["storage_failed_ops"] = store == nullptr ? 0 : store->stats.failed_ops;
  d["cache_op_seconds"] = r.cache_op_seconds;
  d["match_seconds"] = r.match_seconds;
  d["evict_seconds"] = r.evict_seconds;
  d["insert_release_seconds"] = r.insert_release_seconds;
  return d;
}

const char* rejection_name(Rejection why) {
  return why == Rejection::kCapacity ? "capacity" : why == Rejection::kContext ? "context" : "";
}

// A replica together with the trace it reads, so that Python cannot free the trace under it.
struct PyReplica {
  std::shared_ptr<Trace> trace;
  kvmem::Replica replica;
  PyReplica(const py::dict& config, std::shared_ptr<Trace> t) : trace(std::move(t)), replica(config_of(config), &trace->tokens) {}
};

struct PyReplay {
  std::shared_ptr<Trace> trace;
  kvmem::SingleReplay replay;
  PyReplay(const py::dict& config, std::shared_ptr<Trace> t, Array<int32_t> order, Array<double> arrivals)
      : trace(std::move(t)),
        replay(config_of(config), &trace->tokens, std::vector<int32_t>(order.data(), order.data() + order.size()),
               std::vector<double>(arrivals.data(), arrivals.data() + arrivals.size())) {}
};

struct PyCluster {
  std::shared_ptr<Trace> trace;
  kvmem::ClusterReplay cluster;
  PyCluster(const py::dict& config, std::shared_ptr<Trace> t, int32_t replicas, const std::string& policy,
            Array<int32_t> order, Array<double> arrivals)
      : trace(std::move(t)),
        cluster(config_of(config), &trace->tokens, replicas, route_policy_of(policy), kvmem::RouterParams(),
                std::vector<int32_t>(order.data(), order.data() + order.size()),
                std::vector<double>(arrivals.data(), arrivals.data() + arrivals.size())) {}

  static kvmem::RoutePolicy route_policy_of(const std::string& name) {
    if (name == "round-robin") return kvmem::RoutePolicy::kRoundRobin;
    if (name == "least-load") return kvmem::RoutePolicy::kLeastLoad;
    if (name == "cache-aware") return kvmem::RoutePolicy::kCacheAware;
    if (name == "kv-overlap") return kvmem::RoutePolicy::kKvOverlap;
    throw py::value_error("the native engine has no routing policy " + name);
  }
};

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvmem's compiled replay engine (see kvmem.replay.native_replay)";

  py::class_<Trace, std::shared_ptr<Trace>>(m, "Trace")
      .def_static("from_blocks", &trace_from_blocks)
      .def_static("from_tokens", &trace_from_tokens)
      .def("token", [](Trace& t, int32_t r, int64_t pos) {
        t.tokens.take_output(r);
        return t.tokens.token(r, pos);
      })
      .def("output", [](Trace& t, int32_t r) {
        t.tokens.take_output(r);
        std::vector<int32_t> out;
        for (int64_t k = 0; k < t.tokens.output_len(r); ++k) out.push_back(t.tokens.token(r, t.tokens.input_len(r) + k));
        return to_numpy(out);
      });

  py::class_<PyReplica>(m, "Replica")
      .def(py::init<const py::dict&, std::shared_ptr<Trace>>())
      .def("add_request", [](PyReplica& p, int32_t rid, double arrival) {
        return rejection_name(p.replica.add_request(rid, arrival));
      })
      .def("run_until", [](PyReplica& p, double t) { p.replica.run_until(t); })
      .def("step", [](PyReplica& p, double until) {
        kvmem::StepOutcome out;
        p.replica.step(until, &out);
      })
      .def("is_idle", [](const PyReplica& p) { return p.replica.is_idle(); })
      .def_property("clock", [](const PyReplica& p) { return p.replica.clock; },
                    [](PyReplica& p, double t) { p.replica.clock = t; })
      .def("report", [](const PyReplica& p) { return report_of(p.replica); });

  py::class_<PyReplay>(m, "Replay")
      .def(py::init<const py::dict&, std::shared_ptr<Trace>, Array<int32_t>, Array<double>>())
      .def("advance", [](PyReplay& p, int64_t max_steps) { return p.replay.advance(max_steps); })
      .def_property_readonly("finished", [](const PyReplay& p) { return p.replay.replica.report.finished; })
      .def_property_readonly("start_s", [](const PyReplay& p) -> py::object {
        return p.replay.started ? py::cast(p.replay.start_s) : py::none();
      })
      .def("rejections", [](const PyReplay& p, size_t from) {
        py::list out;
        for (size_t k = from; k < p.replay.rejections.size(); ++k) {
          out.append(py::make_tuple(p.replay.rejections[k].first, rejection_name(p.replay.rejections[k].second)));
        }
        return out;
      })
      .def("report", [](const PyReplay& p) { return report_of(p.replay.replica); });

  py::class_<PyCluster>(m, "Cluster")
      .def(py::init<const py::dict&, std::shared_ptr<Trace>, int32_t, const std::string&, Array<int32_t>,
                    Array<double>>())
      .def("advance", [](PyCluster& p, int64_t max_routes) { return p.cluster.advance(max_routes); })
      .def_property_readonly("finished", [](const PyCluster& p) { return p.cluster.finished(); })
      .def("rejections", [](const PyCluster& p, size_t from) {
        py::list out;
        for (size_t k = from; k < p.cluster.rejections.size(); ++k) {
          const auto& [rank, what] = p.cluster.rejections[k];
          out.append(py::make_tuple(rank, what.first, rejection_name(what.second)));
        }
        return out;
      })
      .def("summary", [](const PyCluster& p) {
        const kvmem::ClusterReplay& c = p.cluster;
        py::dict d;
        d["events"] = py::dict(py::arg("batches") = c.events.batches,
                               py::arg("stored_blocks") = c.events.stored_blocks,
                               py::arg("removed_blocks") = c.events.removed_blocks,
                               py::arg("cleared") = c.events.cleared);
        d["index_cached_tokens"] = c.index_cached_tokens;
        d["routing_seconds"] = c.routing_seconds;
        py::list replicas;
        for (const kvmem::ClusterReplay::Member& m : c.members) {
          py::dict r = report_of(*m.replica);
          r["start_s"] = m.started ? py::cast(m.start_s) : py::none();
          r["clock"] = m.replica->clock;
          r["busy_s"] = m.busy_s;
          r["prefill_s"] = m.prefill_s;
          r["routed"] = m.routed;
          replicas.append(r);
        }
        d["replicas"] = replicas;
        return d;
      });

  m.def("draw_outputs", [](uint64_t seed, int64_t n) {
    std::vector<int32_t> out(n);
    kvmem::draw_outputs(seed, n, out.data());
    return to_numpy(out);
  });
}
