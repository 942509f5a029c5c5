"""The benchmark scripts run end to end in their short mode and print the JSON they document.

The SGLang side is pointed at a python that does not exist, so each report must say it was skipped
rather than fail; timing figures are not checked here (they belong to the scripts' own runs).
"""
import importlib.util
import json
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
NO_PEER = ["--sglang-python", "/nonexistent/python"]


def run_script(name: str, *args: str) -> dict:
    # Without the interpreter flag conftest sets, the scripts take the torch fallbacks on the CPU as a
    # user's run would; under the interpreter the scheduler benchmark alone takes minutes.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def load_script(name: str, monkeypatch) -> dict:
    """A benchmark's functions (its report among them), loaded without running its main()."""
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the scripts import _peer from their folder
    return runpy.run_path(str(SCRIPTS / name), run_name="bench")


@pytest.fixture(scope="module")
def quick_reports(tmp_path_factory):
    """Each peer benchmark's --quick report with the SGLang side skipped (one run per script)."""
    out = {}
    for name in ("bench_allocator.py", "bench_radix_cache.py", "bench_scheduler.py"):
        path = tmp_path_factory.mktemp("bench") / "report.json"
        out[name] = run_script(name, "--quick", "--out", str(path), *NO_PEER)
        assert json.loads(path.read_text()) == out[name]
    return out


@pytest.mark.parametrize("name", ["bench_allocator.py", "bench_radix_cache.py", "bench_scheduler.py"])
def test_peer_benchmark_without_sglang_reports_kvmem_alone(name, quick_reports):
    report = quick_reports[name]
    assert report["rows"] and all(row["kvmem_us"] > 0 for row in report["rows"])
    assert "not found: SGLang side skipped" in report["raw"]["sglang"]["error"]
    assert not any("sglang_us" in row or "ratio" in row for row in report["rows"])


@pytest.mark.parametrize("name", ["bench_allocator.py", "bench_radix_cache.py"])
def test_the_hybrid_rows_time_every_full_attention_row_on_the_same_work(name, quick_reports):
    report = quick_reports[name]["hybrid"]
    rows = [r["row"] for r in report["rows"]]
    assert rows and all(r["hybrid_us"] > 0 and "ratio" in r for r in report["rows"]), report["rows"]
    assert any(row.startswith("evict/" if name == "bench_radix_cache.py" else "paged/") for row in rows)
    goal = next(iter(report["goal"]))
    assert report["goal"][goal] == (not report["goal"]["rows_over"])


def test_the_hybrid_peer_comparison_reports_where_the_trees_first_differ(monkeypatch):
    script = load_script("compare_sglang_hybrid.py", monkeypatch)
    ops = script["operations"](5)
    assert ops == script["operations"](5) and len(ops) == script["OPS"]  # the same sequence in both processes
    mine = script["run"](script["KvmemWindowSide"](), ops)
    theirs = json.loads(json.dumps(mine))
    first = next(i for i, op in enumerate(ops) if op[0].startswith("evict"))
    theirs[-1][0] += 1  # a difference after the first eviction, and none before it
    row = script["compare"](ops, mine, theirs)
    assert row["differing_ops"] == 1 and row["differing_before_first_eviction"] == 0
    assert row["first_difference"]["op"] == len(ops) - 1 and row["first_eviction"] == first
    assert row["first_difference"]["class"] == "after_eviction"
    assert script["compare"](ops, mine, {"error": "boom"}) == {"sglang_error": "boom"}


def test_the_state_peer_comparison_names_an_off_grid_insert_and_leaves_other_early_differences_unexplained(
        monkeypatch):
    script = load_script("compare_sglang_hybrid.py", monkeypatch)
    grid = script["GRID"]
    whole, mixed = script["operations"](4, "states"), script["operations"](5, "states")
    assert whole == script["operations"](4, "states") and len(whole) == script["OPS"]
    assert all(len(op[1]) % grid == 0 for op in whole if op[0] == "insert")  # even seeds insert whole blocks
    off = next(i for i, op in enumerate(mixed) if op[0] == "insert" and len(op[1]) % grid)
    mine = script["run"](script["KvmemStateSide"](), mixed)
    assert mine[off][0][1] == 0  # kvmem keeps no state off the grid
    theirs = json.loads(json.dumps(mine))
    theirs[off][0][1] = 1  # SGLang's no-buffer tree keeps one at the request's end
    row = script["compare"](mixed, mine, theirs, "states")
    assert row["first_difference"]["class"] == "state_off_the_grid"
    assert set(row["first_difference"]["kvmem"]) == set(script["FIELDS"]["states"])
    match = next(i for i, op in enumerate(mixed) if op[0] == "match")
    theirs = json.loads(json.dumps(mine))
    theirs[match][0][0] += grid
    row = script["compare"](mixed, mine, theirs, "states")
    expected = "unexplained" if match < row["first_eviction"] else "after_eviction"
    assert row["first_difference"]["class"] == expected


@pytest.mark.parametrize("component", ["window", "states"])
def test_the_hybrid_peer_comparison_without_sglang_reports_the_skipped_side(component):
    report = run_script("compare_sglang_hybrid.py", "--quick", "--component", component, *NO_PEER)
    assert "not found: SGLang side skipped" in report["error"] and report["kvmem"]["sequences"] == 8


def test_hybrid_rounds_alternate_which_side_runs_first_and_rate_the_median_of_their_ratios(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _peer

    order = []
    rounds = _peer.hybrid_rounds(lambda: order.append("full") or {"a": 2.0, "b": 1.0},
                                 lambda: order.append("hybrid") or {"a": 3.0, "b": 4.0}, 3, {"a": 2.0, "b": 1.0})
    assert order == ["hybrid", "hybrid", "full", "full", "hybrid"]
    rounds[2][1]["a"] = 9.0  # a burst of noise in one round moves the row's mean, not its median
    out = _peer.hybrid_rows(rounds, lambda row: [(1, 1), (1, 1 if row == "a" else 2), (1, 1)], 1.5)
    a, b = out["rows"]
    assert a == {"row": "a", "kvmem_us": 2.0, "hybrid_us": 5.0, "round_ratios": [1.5, 1.5, 4.5], "ratio": 1.5}
    assert "ratio" not in b and out["rounds"] == 3
    assert b["unequal_work"][1] == {"kvmem": 1, "hybrid": 2}
    assert out["goal"] == {"within_1.5x_on_every_row": False, "rows_over": []}  # b has no ratio: unequal work
    out = _peer.hybrid_rows(rounds, lambda row: [(1, 1)] * 3, 1.4)
    assert out["goal"] == {"within_1.4x_on_every_row": False, "rows_over": ["a", "b"]}


def test_radix_benchmark_records_the_work_each_row_did(quick_reports):
    rows = quick_reports["bench_radix_cache.py"]["raw"]["kvmem"]
    for n in (1024, 32768):
        assert rows[f"match_prefix/{n}"]["work"] == rows[f"match_prefix_with_indices/{n}"]["work"] == {
            "matched_tokens": n}
        assert rows[f"insert/{n}"]["work"] == rows[f"insert_and_free/{n}"]["work"] == {"cached_prefix_tokens": n // 2}
    assert {r["work"]["evicted_tokens_per_call"] for name, r in rows.items() if name.startswith("evict/")} == {64}


def test_radix_benchmark_compares_only_equal_work_and_names_lopsided_rows(quick_reports, monkeypatch):
    bench = load_script("bench_radix_cache.py", monkeypatch)
    kv = quick_reports["bench_radix_cache.py"]["raw"]["kvmem"]
    # SGLang stand-ins that did kvmem's work in kvmem's time; the Rust core's bare 32k match twice as fast, its
    # match with indices twice as slow; and a 1k match that found one token less.
    radix, rust = json.loads(json.dumps(kv)), json.loads(json.dumps(kv))
    rust["match_prefix/32768"]["median_us"] = kv["match_prefix/32768"]["median_us"] / 2
    rust["match_prefix_with_indices/32768"]["median_us"] = kv["match_prefix/32768"]["median_us"] * 2
    rust["match_prefix/1024"]["work"] = {"matched_tokens": 1023}
    out = bench["report"](kv, {"radix": radix, "rust": rust})
    rows = {(r["op"], r.get("key_tokens")): r for r in out["rows"]}
    match_1k = rows["match_prefix", 1024]
    assert "speedup_vs_sglang_rust" not in match_1k and "speedup_vs_sglang" in match_1k
    assert rows["match_prefix", 1024]["unequal_work_vs_sglang_rust"]["sglang_rust"] == {"matched_tokens": 1023}
    assert out["goals"]["rows_with_unequal_work"] == ["match_prefix/1024 vs sglang_rust"]
    assert rows["match_prefix", 32768]["speedup_vs_sglang_rust"] == 2.0
    assert "match_prefix 32768" in out["goals"]["rows_slower_than_sglang_rust_bare"]
    assert "match_prefix 32768" not in out["goals"]["rows_slower_than_sglang_rust"]
    insert = rows["insert", 32768]
    assert "lopsided_vs_sglang_rust" in insert and "lopsided_vs_sglang" not in insert
    assert insert["speedup_vs_sglang_rust"] == round(insert["sglang_rust_us"] / insert["kvmem_insert_and_free_us"], 2)


def test_allocator_benchmark_compares_only_equal_work_and_only_alloc_plus_free_like_for_like(quick_reports,
                                                                                           monkeypatch):
    bench = load_script("bench_allocator.py", monkeypatch)
    kv = quick_reports["bench_allocator.py"]["raw"]["kvmem"]
    assert kv["checks"]["token/n=64"]["slots_per_alloc"] == 64
    assert all(c["free_before_row"] == c["free_after_row"] for name, c in kv["checks"].items()
               if name.startswith("token/"))
    assert kv["checks"]["paged/decode"]["out_len"] == 256
    same, other = json.loads(json.dumps(kv)), json.loads(json.dumps(kv))
    other["checks"]["paged/decode"]["first_call_digest"] = "another slot order"
    for row in same["rows"].values():  # SGLang twice as slow everywhere but on its bare alloc
        for op in ("free", "alloc+free"):
            row[op]["median_us"] *= 2
        row["alloc"]["median_us"] /= 2
    out = bench["report"](kv, {"sglang": same, "sglang_sorted": other})
    rows = {r["row"]: r for r in out["rows"]}
    assert rows["paged/decode/alloc+free"]["ratio"] == 2.0 and "ratio_sorted" not in rows["paged/decode/alloc+free"]
    assert "unequal_work_vs_sglang_sorted" in rows["paged/decode/alloc+free"]
    assert out["goal"]["rows_with_unequal_work"] == ["paged/decode vs sglang_sorted"]
    assert "lopsided" in rows["token/n=1/alloc"] and "lopsided" not in rows["token/n=1/alloc+free"]
    assert out["goal"]["kvmem_slower_rows"] == [] and "token/n=1/alloc" in out["goal"]["kvmem_slower_lopsided_rows"]


def test_scheduler_benchmark_compares_only_shapes_that_took_the_same_slots(quick_reports, monkeypatch):
    bench = load_script("bench_scheduler.py", monkeypatch)
    kv = quick_reports["bench_scheduler.py"]["raw"]["kvmem"]
    decode, extend = kv["page_size=16"]["decode"]["work"], kv["page_size=1"]["extend"]["work"]
    assert decode["batch_sizes"] == [256] and all(n % 16 == 0 for n in decode["slots_taken_per_step"])
    assert extend["batch_sizes"] == [32] and set(extend["slots_taken_per_step"]) == {32 * 1024}
    sg = json.loads(json.dumps(kv))
    sg["page_size=1"]["decode"]["work"]["slots_taken_per_step"][0] += 1
    for shape in sg.values():  # keys the SGLang side reports under its own names
        for side in shape.values():
            for theirs, mine in (("decode_alloc_us", "step_us"), ("process_us", "process_batch_result_us"),
                                 ("prefill_alloc_us", "prepare_extend_us"), ("finish_us", "process_batch_result_us")):
                if mine in side:
                    side[theirs], side["min"][theirs] = side[mine], side["min"][mine]
    out = bench["report"](kv, sg)
    assert out["shapes_with_unequal_work"] == ["decode (page 1)"]
    rows = [r for r in out["rows"] if "sglang_us" in r]
    assert all(("ratio" in r) != (r["page_size"] == 1 and r["row"].startswith("decode/")) for r in rows)
    assert all("lopsided" in r for r in rows if r["row"].endswith("full (step + metadata + process)") and "ratio" in r)


def test_kv_indices_benchmark_on_cpu():
    report = run_script("bench_kv_indices.py", "--device", "cpu", "--quick")
    shapes = {(r["bs"], r["tokens_per_request"]) for r in report["results"]}
    assert shapes == {(1, 1024), (1, 8192), (64, 1024), (64, 8192)}
    assert all(r["torch_fallback_us"] > 0 for r in report["results"])


def test_hiradix_benchmark_sets_every_row_of_the_tiered_caches_beside_the_plain_one():
    report = run_script("bench_hiradix_cache.py", "--quick")
    tiered = [r for r in report["rows"] if not r["row"].startswith("evict_host/")]
    assert tiered and all(r["hi_write_back_ratio"] > 0 and r["hi_write_through_ratio"] > 0 for r in tiered)
    host = report["raw"]["evict_host"]
    assert set(host) == {f"evict_host/{n}/{t}" for t in (16, 1) for n in (1000, 10000, 40000)}
    assert all(row["work"] == {"host_tokens_freed": 64} for row in host.values())
    assert report["goals"]["device_only_worst_ratio_write_back"] == max(
        r["hi_write_back_ratio"] for r in tiered if r["row"].startswith(("match_prefix/", "insert/")))


def test_event_benchmark_reports_throughput_and_bytes_per_event():
    report = run_script("bench_events.py", "--quick")
    assert {(r["workload"], r["page_size"], r["wire_format"]) for r in report["rows"]} == {
        (w, p, f) for w in ("cache", "one_page") for p in (16, 1) for f in ("map", "array")}
    for row in report["rows"]:
        assert row["events"] > 0 and row["bytes_per_event"] > 0 and row["one_page_event_bytes"] > 0
        if row["wire_format"] == "map":  # --quick measures throughput in the map form only
            assert row["publish_events_per_s"] > 0 and row["dropped"] == 0
    assert {r["page_size"] for r in report["cache_hook"]} == {16, 1}

def run_in_process(name: str, argv: list[str], capsys) -> str:
    """Runs a script's main() in this process: the engine scripts' cost is importing transformers, which the
    engine tests have already paid."""
    main = runpy.run_path(str(SCRIPTS / name), run_name="script")["main"]
    assert main(argv) == 0
    return capsys.readouterr().out


def test_generate_prints_outputs_errors_and_a_summary(tmp_path, capsys):
    pytest.importorskip("transformers")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3, 4, 5, 6], "output_len": 3}\n{"input_ids": [1, 2, 3, 4, 5, 7]}\n'
                       '{"input_ids": [1, 999]}\n')
    out = run_in_process("generate.py", ["--model", "llama-tiny", "--prompts", str(prompts), "--max-new-tokens", "5",
                                         "--page-size", "2", "--capacity-tokens", "64"], capsys)
    *lines, summary = map(json.loads, out.splitlines())
    assert [len(line.get("output_ids", [])) for line in lines] == [3, 5, 0]
    assert "token id 999 at position 1 is outside the vocabulary" in lines[2]["error"]
    assert summary["requests"] == 2 and summary["rejected"] == 1 and summary["output_tokens"] == 8
    assert summary["tokens_per_s"] > 0 and 0 <= summary["hit_rate"] <= 1


def test_engine_benchmark_on_cpu_reports_both_workloads(capsys):
    pytest.importorskip("transformers")
    import torch

    threads = torch.get_num_threads()
    try:
        out = run_in_process("bench_engine.py", ["--device", "cpu", "--quick", "--repeats", "1", "--threads", "1"],
                             capsys)
    finally:
        torch.set_num_threads(threads)
    rows = {(r["model"], r["workload"]): r for r in json.loads(out)["rows"]}
    assert set(rows) == {(m, w) for m in ("llama-tiny", "qwen2-tiny", "deepseek-v2-tiny")
                         for w in ("prefix_reuse", "no_reuse")}
    assert all(rows[m, "prefix_reuse"]["hit_rate"] > 0 == rows[m, "no_reuse"]["hit_rate"] for m, _ in rows)
    assert all(r["output_tokens_per_s"] > 0 for r in rows.values())


@pytest.mark.skipif(not (SCRIPTS.parents[1] / "shared" / "peers" / "sglang_driver.py").exists(),
                    reason="../shared/peers is not beside the checkout")
def test_replay_benchmark_runs_kvmem_on_the_peers_workload_and_skips_missing_peers(tmp_path):
    out = tmp_path / "report.json"
    report = run_script("bench_replay.py", "--sizes", "80", "--page-sizes", "1,16", "--out", str(out),
                        "--vllm-python", "/nonexistent/python", "--sglang-python", "/nonexistent/python")
    assert json.loads(out.read_text()) == report
    assert [(r["requests"], r["page_size"]) for r in report["rows"]] == [(80, 1), (80, 16)]
    for row in report["rows"]:
        kvmem = row["kvmem"]
        assert set(kvmem) == {"vllm", "decode_pages", "in_batch", "sglang"}
        assert kvmem["vllm"]["cache_s"] > 0 and kvmem["vllm"]["hit_rate"] >= kvmem["sglang"]["hit_rate"] > 0
        assert "not found" in row["vllm"]["error"] and row["ratios"]["vllm_cache_ops_plus_hash"] is None
    assert report["kvmem_faster_than_vllm_cache_ops_plus_hash"] is False


def test_trace_replay_benchmark_sets_the_engines_and_clusters_beside_dynamo_and_skips_a_missing_dynamo(tmp_path,
                                                                                                         monkeypatch):
    from kvmem.replay.native_replay import native_built
    from kvmem.replay.traces import default_trace_path

    traces = tmp_path / "shared" / "traces" / "mooncake"
    traces.mkdir(parents=True)
    (traces / "conversation_trace.jsonl").write_bytes(default_trace_path().read_bytes())
    monkeypatch.setenv("DYNAMO_PEER_VENV", str(tmp_path / "no-venv"))
    out = tmp_path / "report.json"
    sides = "native,native-no-torch,python,dynamo" if native_built() else "python,dynamo"
    cluster_sides = "native-no-torch,python,dynamo" if native_built() else "python,dynamo"
    report = run_script("bench_trace_replay.py", "--traces", "conversation", "--page-sizes", "16", "--limit", "30",
                        "--capacity-tokens", "200000", "--sides", sides, "--shared", str(tmp_path / "shared"),
                        "--replicas", "2", "--cluster-page-sizes", "16", "--cluster-sides", cluster_sides,
                        "--no-build", "--out", str(out))
    assert json.loads(out.read_text()) == report
    (row,) = report["rows"]
    assert (row["trace"], row["page_size"]) == ("conversation", 16) and "no Dynamo venv" in row["dynamo"]["skipped"]
    kvmem = [row[side] for side in sides.split(",")[:-1]]
    assert all(r["requests"] == 30 and r["wall_s"] > 0 and r["peak_rss_mb"] > 0 for r in kvmem)
    assert len({r["hit_rate"] for r in kvmem}) == 1 and row["ratios"] == {}  # one replay, whatever the engine
    assert [(c["router"], c["replicas"], c["page_size"]) for c in report["clusters"]] == [
        ("round-robin", 2, 16), ("kv-overlap", 2, 16)]
    for cluster in report["clusters"]:
        kvmem = [cluster[side] for side in cluster_sides.split(",")[:-1]]
        assert all(r["requests"] == 30 and r["makespan_s"] > 0 for r in kvmem)
        assert len({r["hit_rate"] for r in kvmem}) == 1
    sweep = report["sweep"]
    assert len(sweep["capacities"]) == len(sweep["hit_rates"]) == 6 and sweep["wall_s"] > 0
    assert "build" not in report and report["meta"]["commit"]


def test_eviction_benchmark_times_every_online_policy_against_lru(tmp_path):
    from kvmem.eviction import ONLINE_POLICIES

    out = tmp_path / "report.json"
    report = run_script("bench_eviction.py", "--quick", "--out", str(out))
    assert json.loads(out.read_text()) == report
    assert [r["policy"] for r in report["rows"]] == list(ONLINE_POLICIES)
    assert all(r["cycle_us"] > 0 and r["cycle_vs_lru"] > 0 for r in report["rows"])


def test_mutation_scores_name_listed_survivors_by_function_and_line_whatever_their_number(monkeypatch):
    score = load_script("mutation.py", monkeypatch)["score"]
    found = {"counts": {"killed": 6, "survived": 3, "no tests": 1},
             "survivors": [{"name": "m.x_f__mutmut_9", "status": "survived", "line": "a = 2"},
                           {"name": "m.x_f__mutmut_4", "status": "survived", "line": "b = None"},
                           {"name": "m.x_g__mutmut_1", "status": "survived", "line": "c = 0"},
                           {"name": "m.x_g__mutmut_2", "status": "no tests", "line": "d = 1"}]}
    listed = [{"mutant": "m.x_f__mutmut_3", "line": "a = 2"},  # renumbered since it was judged: still matches
              {"mutant": "m.x_g__mutmut_1", "line": "c = 0", "kind": "needs CUDA"},
              {"mutant": "m.x_f__mutmut_4", "line": "b = 1"},  # its line changed: stale, and b = None survives
              {"mutant": "m.x_h__mutmut_1", "line": "a = 2"}]  # same line, other function: no match
    result = score(found, listed)
    assert (result["equivalent"], result["needs_cuda"], result["killed"], result["mutants"]) == (1, 1, 6, 10)
    assert [s["name"] for s in result["survivors"]] == ["m.x_f__mutmut_4", "m.x_g__mutmut_2"]
    assert result["stale_equivalent"] == ["m.x_f__mutmut_4", "m.x_h__mutmut_1"]
    assert result["score"] == round(6 / 8, 4) and result["score_of_all_mutants"] == 0.6


def test_mutation_results_take_the_retested_survivors_new_exit_codes(monkeypatch, tmp_path):
    script = load_script("mutation.py", monkeypatch)
    meta = tmp_path / "mutants" / "kvmem" / "a.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {"kvmem.a.x_f__mutmut_1": 1, "kvmem.a.x_f__mutmut_2": 0,
                                                     "kvmem.a.x_f__mutmut_3": 0, "kvmem.a.x_f__mutmut_4": None}}))
    diffs = types.ModuleType("diff_apply")  # mutmut's diff of a mutant (mutmut is not installed in CI)
    diffs.get_diff_for_mutant = lambda name, path: f"--- a\n+++ b\n-line\n+line of {name[-1]}\n"
    for name, fake in (("mutmut", types.ModuleType("mutmut")), ("mutmut.mutation", types.ModuleType("mutation")),
                       ("mutmut.mutation.diff_apply", diffs)):
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.chdir(tmp_path)  # mutated_line works from the run's directory, as mutmut does
    monkeypatch.syspath_prepend(str(tmp_path))
    module = {"mutate": ["kvmem/a.py"]}
    assert script["exit_codes"](tmp_path, module)["kvmem.a.x_f__mutmut_2"] == ("kvmem/a.py", 0)  # file, code
    found = script["results"](tmp_path, module, {"kvmem.a.x_f__mutmut_2": 1})  # killed by a later test
    assert found["counts"] == {"killed": 2, "survived": 1, "not checked": 1}
    assert found["survivors"] == [{"name": "kvmem.a.x_f__mutmut_3", "status": "survived", "line": "line of 3"},
                                  {"name": "kvmem.a.x_f__mutmut_4", "status": "not checked", "line": "line of 4"}]


def test_a_mutation_sample_depends_only_on_the_seed_and_the_set_of_mutants(monkeypatch):
    draw = load_script("mutation.py", monkeypatch)["draw_sample"]
    names = [f"kvmem.a.x_f__mutmut_{i}" for i in range(1, 101)]
    sample = draw(names, 10, 0)
    assert len(set(sample)) == 10 and set(sample) <= set(names) and sample == sorted(sample)
    assert draw(list(reversed(names)), 10, 0) == sample != draw(names, 10, 1)
    assert draw(names, 11, 0) != sample and draw(names, 100, 0) == draw(names, 101, 0) == sorted(names)


def test_a_mutation_samples_score_comes_with_its_wilson_95_percent_interval(monkeypatch):
    wilson = load_script("mutation.py", monkeypatch)["wilson_interval"]
    assert wilson(8, 10) == [0.4902, 0.9433]
    assert wilson(0, 5) == [0.0, 0.4345] and wilson(5, 5) == [0.5655, 1.0]
    assert wilson(0, 0) is None and wilson(1, 1) == [0.2065, 1.0]


def test_a_sampled_mutation_run_counts_only_its_sample(monkeypatch, tmp_path):
    script = load_script("mutation.py", monkeypatch)
    meta = tmp_path / "mutants" / "kvmem" / "a.py.meta"
    meta.parent.mkdir(parents=True)
    codes = {"kvmem.a.x_f__mutmut_1": 1, "kvmem.a.x_f__mutmut_2": 0, "kvmem.a.x_f__mutmut_3": None,
             "kvmem.a.x_f__mutmut_4": 1}
    meta.write_text(json.dumps({"exit_code_by_key": codes}))
    module = {"mutate": ["kvmem/a.py"]}
    assert script["read_sample"](tmp_path) is None and len(script["exit_codes"](tmp_path, module)) == 4
    sample = {"seed": 3, "of": 4, "names": ["kvmem.a.x_f__mutmut_1", "kvmem.a.x_f__mutmut_4"]}
    (tmp_path / "sample.json").write_text(json.dumps(sample))
    assert script["read_sample"](tmp_path) == sample
    assert script["exit_codes"](tmp_path, module) == {"kvmem.a.x_f__mutmut_1": ("kvmem/a.py", 1),
                                                      "kvmem.a.x_f__mutmut_4": ("kvmem/a.py", 1)}
    assert script["results"](tmp_path, module) == {"counts": {"killed": 2}, "survivors": []}
    # Nothing of the sample survived: a retest runs nothing (mutmut would test every mutant given no names).
    monkeypatch.setitem(script["retest_survivors"].__globals__, "run_mutmut", lambda *a: pytest.fail("ran mutmut"))
    assert script["retest_survivors"](tmp_path, tmp_path / "retest", module, 1, {}) == {}


def test_trace_reuse_reports_reusable_tokens_their_gaps_and_conversation_turns(tmp_path):
    # A, then B continues A (A's full blocks 1, 2 begin it) 10 s later, C shares nothing, D continues B 30 s
    # after B. Reused: B 2 blocks (gap 10 s), D 3 blocks (gap 30 s); A and B get a next turn, C and D do not.
    lines = [(0, 1200, [1, 2, 3]), (10_000, 1800, [1, 2, 5, 6]), (30_000, 700, [7, 8]), (40_000, 1900, [1, 2, 5, 9])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 5, "hash_ids": ids})
                             + "\n" for t, n, ids in lines))
    facts = run_script("trace_reuse.py", str(trace))
    assert facts["requests"] == 4 and facts["prompt_tokens"] == 5600
    assert facts["reusable_share"] == round((2 * 512 + 3 * 512) / 5600, 4)
    # Token-weighted: 1,024 tokens waited 10 s and 1,536 waited 30 s, so the median is 30 s.
    assert facts["reuse_gap_s"] == {"p10": 10.0, "p25": 10.0, "p50": 30.0, "p75": 30.0, "p90": 30.0}
    assert facts["next_turn"] == {"share": 0.5, "by_turn": [{"turn": 0, "prompts": 2, "share": 0.5},
                                                           {"turn": 1, "prompts": 1, "share": 1.0},
                                                           {"turn": 2, "prompts": 1, "share": 0.0}]}


def usage_error(name: str, argv: list[str], option: str, monkeypatch, capsys) -> None:
    """A script's main() stops on a bad argument before any work, with argparse's exit status 2 and an error line
    naming the option. Run in this process: three of the scripts import torch, 1.5 s a subprocess; a traceback
    would escape pytest.raises and fail the test."""
    main = load_script(name, monkeypatch)["main"]
    with pytest.raises(SystemExit) as stop:
        sys.exit(main(argv))  # kvmem-replay's main returns its status
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert ": error: " in err.splitlines()[-1] and option in err.splitlines()[-1], err


@pytest.mark.parametrize("trace", ["missing.jsonl", ".", "empty.jsonl", "not_json.jsonl", "jsonl.jsonl",
                                   "short_hash_ids.jsonl"])
def test_trace_reuse_refuses_a_bad_trace_as_a_usage_error(trace, tmp_path, monkeypatch, capsys):
    for name, text in (("empty.jsonl", ""), ("not_json.jsonl", "{\n"),
                       ("jsonl.jsonl", '{"input_ids": [1, 2], "output_len": 2}\n'),  # not a Mooncake trace
                       ("short_hash_ids.jsonl",
                        '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}\n')):
        (tmp_path / name).write_text(text)
    usage_error("trace_reuse.py", [str(tmp_path / trace)], "argument trace", monkeypatch, capsys)


needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="loading a model needs transformers")


@pytest.mark.parametrize("args, option", [
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--max-new-tokens", "x"], "--max-new-tokens"),
    (["--capacity-tokens", "-1"], "--capacity-tokens"), (["--page-size", "0"], "--page-size"),
    (["--page-size", "3"], "--page-size"),  # does not divide the capacity
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--max-running-requests", "-2"], "--max-running-requests"),
    (["--seed", str(2**64)], "--seed"), (["--device", "nowhere"], "--device"), (["--device", "meta"], "--device"),
    (["--attention-backend", "flashinfer", "--device", "cpu"], "--attention-backend"),
    (["--model", "{tmp}/missing"], "--model"),
    pytest.param(["--model", "{tmp}"], "--model", marks=needs_transformers),  # a folder without a checkpoint
    # a pool bigger than this machine's memory: only the loaded model tells its bytes
    pytest.param(["--capacity-tokens", str(2**50)], "--model", marks=needs_transformers),
    (["--prompts", "{tmp}/missing.jsonl"], "--prompts"), (["--prompts", "{tmp}"], "--prompts"),
    (["--prompts", "{tmp}/empty.jsonl"], "--prompts"), (["--prompts", "{tmp}/not_json.jsonl"], "--prompts"),
    (["--prompts", "{tmp}/not_a_prompt.jsonl"], "--prompts"),
    (["--prompts", "{tmp}/text.jsonl"], "--prompts"),  # a preset has no tokenizer
])
def test_generate_refuses_bad_arguments_as_usage_errors(args, option, tmp_path, monkeypatch, capsys):
    for name, text in (("prompts.jsonl", '{"input_ids": [1, 2, 3]}\n'), ("empty.jsonl", ""), ("not_json.jsonl", "{\n"),
                       ("not_a_prompt.jsonl", "[1, 2]\n"), ("text.jsonl", '{"text": "hello"}\n')):
        (tmp_path / name).write_text(text)
    argv = ["--model", "llama-tiny", "--prompts", str(tmp_path / "prompts.jsonl")]
    usage_error("generate.py", argv + [a.format(tmp=tmp_path) for a in args], option, monkeypatch, capsys)


# Every case names a work directory in tmp_path, and --rescore where it can: a check that let a bad option through
# then fails on the empty run instead of starting mutmut or replacing a run in /tmp/kvmem-mutation.
RESCORE_EMPTY = ["--rescore", "--workdir", "{tmp}/empty"]


@pytest.mark.parametrize("args, option", [
    (["--max-children", "0", *RESCORE_EMPTY], "--max-children"),
    (["--max-children", "-1", *RESCORE_EMPTY], "--max-children"),
    (["--max-children", "x", *RESCORE_EMPTY], "--max-children"),
    (RESCORE_EMPTY, "--workdir"), (["--retest-survivors", "--workdir", "{tmp}/empty"], "--workdir"),
    (["--workdir", "{tmp}/file"], "--workdir"), (["--workdir", "{tmp}/file/under"], "--workdir"),
    (["--out", "{tmp}/missing/summary.json", *RESCORE_EMPTY], "--out"), (["--out", "{tmp}", *RESCORE_EMPTY], "--out"),
    (["--retest-survivors", *RESCORE_EMPTY], "--rescore"),
    (["--sample", "0", *RESCORE_EMPTY], "--sample"), (["--sample", "x", *RESCORE_EMPTY], "--sample"),
    (["--sample", "5", *RESCORE_EMPTY], "--sample"),  # a rescore scores the run's own sample
    (["--sample", "5", "--seed", "x", *RESCORE_EMPTY], "--seed"),
])
def test_mutation_refuses_bad_arguments_as_usage_errors(args, option, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    usage_error("mutation.py", ["allocator", *(a.format(tmp=tmp_path) for a in args)], option, monkeypatch, capsys)


# --quick where it hides no check: a check that let a bad option through then runs the short benchmark and exits 0
@pytest.mark.parametrize("args, option", [
    (["--quick", "--pages", "0"], "--pages"), (["--quick", "--pages", "-1"], "--pages"),
    (["--quick", "--pages", "x"], "--pages"), (["--pages", str(10**9)], "--pages"),  # more than this machine holds
    (["--quick", "--repeats", "0"], "--repeats"), (["--quick", "--repeats", "-3"], "--repeats"),
    (["--quick", "--out", "{tmp}/missing/report.json"], "--out"), (["--quick", "--out", "{tmp}"], "--out"),
])
def test_bench_storage_refuses_bad_arguments_before_any_store_starts(args, option, tmp_path, monkeypatch, capsys):
    usage_error("bench_storage.py", [a.format(tmp=tmp_path) for a in args], option, monkeypatch, capsys)


# The peer benchmarks' cases skip the SGLang side (NO_PEER) unless they are about it. Their options are checked in
# turn (--sglang-python, --sglang-driver, --out, --seed, then bench_allocator's --allocator-module): a case adds a
# bad option checked after its own where there is one, so that a check that let its option through fails the test
# at once by naming another, instead of starting the rows; --quick where there is none.
BAD_OUT = ["--out", "{tmp}/missing/report.json"]
BAD_DRIVER = ["--sglang-python", sys.executable, "--sglang-driver", "{tmp}/missing.py"]


@pytest.mark.parametrize("args, option", [
    (["--seed", "-1", *NO_PEER], "--seed"),  # numpy's generators refuse it, at the first row
    (["--seed", "x", *NO_PEER], "--seed"),
    ([*BAD_OUT, *NO_PEER, "--allocator-module", "{tmp}/missing.py"], "--out"),
    (["--out", "{tmp}", *NO_PEER, "--allocator-module", "{tmp}/missing.py"], "--out"),
    (["--allocator-module", "{tmp}/missing.py", *NO_PEER], "--allocator-module"),
    (["--allocator-module", "{tmp}/notes.txt", *NO_PEER], "--allocator-module"),  # no Python file
    (["--allocator-module", "{tmp}/empty.py", *NO_PEER], "--allocator-module"),  # no allocators in it
    (["--sglang-python", "{tmp}", *BAD_OUT], "--sglang-python"),  # there, but no executable file
    ([*BAD_DRIVER, *BAD_OUT], "--sglang-driver"),
])
def test_bench_allocator_refuses_bad_arguments_before_any_row(args, option, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "empty.py").write_text("")
    usage_error("bench_allocator.py", ["--quick", *(a.format(tmp=tmp_path) for a in args)], option, monkeypatch,
                capsys)


@pytest.mark.parametrize("args, option", [
    (["--sglang-python", "{tmp}", *BAD_OUT], "--sglang-python"), ([*BAD_DRIVER, *BAD_OUT], "--sglang-driver"),
    ([*BAD_OUT, *NO_PEER], "--out"), (["--out", "{tmp}", *NO_PEER], "--out"),
])
def test_bench_radix_cache_refuses_bad_arguments_before_any_row(args, option, tmp_path, monkeypatch, capsys):
    usage_error("bench_radix_cache.py", ["--quick", *(a.format(tmp=tmp_path) for a in args)], option, monkeypatch,
                capsys)


@pytest.mark.parametrize("args, option", [
    (["--seed", "-1", *NO_PEER], "--seed"),  # numpy's generators refuse it, at the first row
    ([*BAD_OUT, "--seed", "-1", *NO_PEER], "--out"), (["--out", "{tmp}", "--seed", "-1", *NO_PEER], "--out"),
    (["--sglang-python", "{tmp}", *BAD_OUT], "--sglang-python"), ([*BAD_DRIVER, *BAD_OUT], "--sglang-driver"),
])
def test_bench_scheduler_refuses_bad_arguments_before_any_row(args, option, tmp_path, monkeypatch, capsys):
    usage_error("bench_scheduler.py", ["--quick", *(a.format(tmp=tmp_path) for a in args)], option, monkeypatch,
                capsys)


@pytest.mark.parametrize("name", ["bench_hiradix_cache.py", "bench_eviction.py", "bench_events.py"])
@pytest.mark.parametrize("out", ["{tmp}/missing/report.json", "{tmp}"])
def test_benchmarks_refuse_an_out_they_could_not_write_before_any_row(name, out, tmp_path, monkeypatch, capsys):
    usage_error(name, ["--quick", "--out", out.format(tmp=tmp_path)], "--out", monkeypatch, capsys)


def test_event_benchmark_refuses_a_drain_without_an_expected_count(monkeypatch, capsys):
    # not an endpoint: a check that let it through fails at once in ZeroMQ rather than waiting for batches
    usage_error("bench_events.py", ["--drain", "not-an-endpoint"], "--drain", monkeypatch, capsys)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(cuda_available(), reason="--device cuda is refused only where there is no CUDA device")
@pytest.mark.parametrize("name, argv", [("bench_kv_indices.py", ["--device", "cuda", "--quick"]),
                                        ("bench_engine.py", ["--device", "cuda", "--quick"]),
                                        ("bench_cascade.py", ["--device", "cuda", "--quick"])])
def test_gpu_benchmarks_refuse_cuda_without_a_cuda_device(name, argv, monkeypatch, capsys):
    usage_error(name, argv, "--device", monkeypatch, capsys)


@pytest.mark.parametrize("args, option", [
    (["--vllm-python", "{tmp}", *BAD_OUT], "--vllm-python"),  # there, but no executable file
    (["--sglang-python", "{tmp}", *BAD_OUT], "--sglang-python"),
    (BAD_OUT, "--out"), (["--out", "{tmp}"], "--out"),
])
def test_check_vllm_events_refuses_bad_arguments_before_any_check(args, option, tmp_path, monkeypatch, capsys):
    argv = ["--vllm-python", "/nonexistent/python", *(a.format(tmp=tmp_path) for a in args)]  # the last one counts
    usage_error("check_vllm_events.py", argv, option, monkeypatch, capsys)


@pytest.mark.parametrize("args, option", [
    (["--repeats", "0"], "--repeats"), (["--threads", "0"], "--threads"), (["--threads", "x"], "--threads"),
    (["--capacity-tokens", "-1"], "--capacity-tokens"), (["--page-size", "0"], "--page-size"),
    (["--page-size", "3"], "--page-size"),  # does not divide the capacity
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"), (["--batch", "0"], "--batch"),
    (["--prompt-len", "-1"], "--prompt-len"), (["--new-tokens", "x"], "--new-tokens"),
    (["--model", "bogus"], "--model"),
    # a pool past this machine's memory: only a preset's model tells its bytes
    pytest.param(["--capacity-tokens", str(2**50)], "--capacity-tokens", marks=needs_transformers),
])
def test_bench_engine_refuses_bad_arguments_before_any_row(args, option, monkeypatch, capsys):
    usage_error("bench_engine.py", ["--device", "cpu", "--quick", "--repeats", "1", *args], option, monkeypatch,
                capsys)


# --quick on one workload, or, for the settings --quick replaces, that workload made small.
QUICK_CASCADE = ["--quick", "--workloads", "synthetic-system"]
SMALL_CASCADE = ["--workloads", "synthetic-system", "--limit", "20", "--snapshots", "1", "--warmup", "0"]


def test_bench_cascade_names_the_workloads_it_skips_and_why(tmp_path):
    report = run_script("bench_cascade.py", "--workloads", "mooncake-conversation,mooncake-synthetic", "--traces",
                        str(tmp_path))
    assert report["workloads"] == []
    assert report["skipped"] == {f"mooncake-{name}": f"{tmp_path / f'{name}_trace.jsonl'} not found"
                                 for name in ("conversation", "synthetic")}


@pytest.mark.parametrize("args, option", [
    (["--quick", "--workloads", ""], "--workloads"), (["--quick", "--workloads", "bogus"], "--workloads"),
    (["--quick", "--workloads", "synthetic-system,,synthetic-chat"], "--workloads"),
    ([*SMALL_CASCADE, "--limit", "0"], "--limit"), ([*SMALL_CASCADE, "--every", "0"], "--every"),
    ([*SMALL_CASCADE, "--repeats", "0"], "--repeats"), ([*SMALL_CASCADE, "--snapshots", "0"], "--snapshots"),
    ([*SMALL_CASCADE, "--min-batch", "0"], "--min-batch"), ([*SMALL_CASCADE, "--warmup", "-1"], "--warmup"),
    ([*SMALL_CASCADE, "--capacity-tokens", "0"], "--capacity-tokens"),
    ([*SMALL_CASCADE, "--capacity-tokens", str(2**50)], "--capacity-tokens"),  # past this machine's memory
    ([*QUICK_CASCADE, "--time-scale", "0"], "--time-scale"), ([*QUICK_CASCADE, "--time-scale", "nan"], "--time-scale"),
    ([*QUICK_CASCADE, "--arrival-rate", "-1"], "--arrival-rate"),
    ([*QUICK_CASCADE, "--arrival-rate", "inf"], "--arrival-rate"),
    ([*QUICK_CASCADE, "--page-size", "0"], "--page-size"), ([*QUICK_CASCADE, "--max-running", "0"], "--max-running"),
    ([*QUICK_CASCADE, "--min-shared-tokens", "-1"], "--min-shared-tokens"),
    ([*QUICK_CASCADE, "--max-levels", "0"], "--max-levels"),
    ([*QUICK_CASCADE, "--seed", "-1"], "--seed"), ([*QUICK_CASCADE, "--model", "bogus"], "--model"),
    ([*QUICK_CASCADE, *BAD_OUT], "--out"), ([*QUICK_CASCADE, "--out", "{tmp}"], "--out"),
    ([*QUICK_CASCADE, "--traces", "{tmp}/missing"], "--traces"),
    (["--workloads", "mooncake-conversation", "--traces", "{tmp}", "--limit", "20"], "--traces"),  # a bad trace
])
def test_bench_cascade_refuses_bad_arguments_before_any_replay(args, option, tmp_path, monkeypatch, capsys):
    (tmp_path / "conversation_trace.jsonl").write_text("{\n")
    usage_error("bench_cascade.py", [a.format(tmp=tmp_path) for a in args], option, monkeypatch, capsys)


SHARED_PEERS = SCRIPTS.parents[1] / "shared" / "peers"
needs_peers = pytest.mark.skipif(not (SHARED_PEERS / "sglang_driver.py").exists(),
                                 reason="../shared/peers is not beside the checkout")


@pytest.mark.parametrize("args, option", [
    (["--sizes", ""], "--sizes"), (["--sizes", "1,,2"], "--sizes"), (["--sizes", "0"], "--sizes"),
    (["--sizes", "x"], "--sizes"), (["--page-sizes", ""], "--page-sizes"), (["--page-sizes", "16,-1"], "--page-sizes"),
    (["--token-budget", "0"], "--token-budget"), (["--max-running", "0"], "--max-running"),
    (["--repeats", "0"], "--repeats"), (["--sglang-impls", "bogus"], "--sglang-impls"),
    (["--sglang-impls", "radix,"], "--sglang-impls"),
    (["--sglang-impls", "radix,all"], "--sglang-impls"),  # the driver reports "all" in a form this script does not read
    ([*BAD_OUT], "--out"), (["--out", "{tmp}"], "--out"),
    (["--vllm-python", "{tmp}"], "--vllm-python"), (["--sglang-python", "{tmp}"], "--sglang-python"),
    (["--peers", "{tmp}"], "--peers"),  # no sglang_driver.py in it
    # the longest request does not fit: known once the workload is written, before any side runs
    pytest.param(["--token-budget", "100"], "--token-budget", marks=needs_peers),
])
def test_bench_replay_refuses_bad_arguments_before_any_side_runs(args, option, tmp_path, monkeypatch, capsys):
    argv = ["--sizes", "1", "--page-sizes", "16", "--peers", str(SHARED_PEERS), "--vllm-python", "/nonexistent/python",
            "--sglang-python", "/nonexistent/python", *(a.format(tmp=tmp_path) for a in args)]  # the last one counts
    usage_error("bench_replay.py", argv, option, monkeypatch, capsys)


@pytest.mark.parametrize("args, option", [
    (["{tmp}/missing.jsonl"], "cannot open trace"), (["{tmp}"], "cannot open trace"),
    (["{trace}", "--capacity-tokens", "0"], "--capacity-tokens"), (["{trace}", "--page-size", "x"], "--page-size"),
    (["{trace}", "--sweep", "1,,2"], "--sweep"), (["{trace}", "--compare-policies", ""], "--compare-policies"),
    (["{trace}", "--limit", "0"], "--limit"), (["{trace}", "--replicas", "0"], "--replicas"),
])
def test_replay_script_refuses_bad_arguments_as_kvmem_replay_does(args, option, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_ids": [1, 2, 3, 4], "output_len": 2}\n')
    usage_error("replay.py", [a.format(tmp=tmp_path, trace=trace) for a in args], option, monkeypatch, capsys)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer imports: it would build")
@pytest.mark.parametrize("args, option", [(["--jobs", "0"], "--jobs"), (["--jobs", "x"], "--jobs"),
                                          ([], "flashinfer does not import")])
def test_flashinfer_aot_refuses_bad_arguments_and_a_machine_without_flashinfer(args, option, monkeypatch, capsys):
    usage_error("flashinfer_aot.py", args, option, monkeypatch, capsys)


def test_continuation_oracle_told_whether_a_conversation_goes_on_keeps_its_prefix(tmp_path):
    # A, then C, both cached; B needs one of them evicted; A' then continues A. LRU and multiturn let A go (the
    # older), and a true turn says nothing either (A and C are both first prompts), so A' misses; the oracle
    # told that A goes on and C does not lets C go, and A' hits A's two full blocks, as belady does.
    lines = [(0, 1200, [1, 2, 3]), (10_000, 1200, [7, 8, 9]), (20_000, 1200, [10, 11, 12]),
             (30_000, 1800, [1, 2, 5, 6])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 5, "hash_ids": ids})
                             + "\n" for t, n, ids in lines))
    report = run_script("continuation_oracle.py", str(trace), "--capacities", "3000", "--jobs", "1")
    rows = report["capacities"]["3000"]
    assert rows["lru"]["hit_rate"] == rows["multiturn"]["hit_rate"] == rows["true-turn"]["hit_rate"]
    assert rows["whether"]["hit_rate"] == rows["belady"]["hit_rate"] == round(2 * 512 / 5400, 6)
    assert rows["lru"]["hit_rate"] < rows["whether"]["hit_rate"]
    assert rows["whether"]["gap_closed"] == 1.0 and rows["true-turn"]["gap_closed"] == 0.0


@pytest.mark.parametrize("argv, option", [(["--capacities", "1e6"], "--capacities"),
                                          (["--capacities", "0"], "--capacities"),
                                          (["--jobs", "0"], "--jobs"),
                                          (["--limit", "x"], "--limit"),
                                          (["--limit", "0"], "--limit"),
                                          (["--gpu", "H100", "--tp", "0"], "--tp"),
                                          (["--gpu", "H100", "--model", "nope"], "--model")])
def test_continuation_oracle_refuses_bad_arguments_as_usage_errors(argv, option, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    usage_error("continuation_oracle.py", [str(trace), *argv], option, monkeypatch, capsys)


def test_continuation_oracle_refuses_a_bad_trace_as_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.jsonl").write_text('{"input_ids": [1, 2], "output_len": 2}\n')
    usage_error("continuation_oracle.py", [str(tmp_path / "t.jsonl")], "argument trace", monkeypatch, capsys)


def test_storage_footprint_counts_what_each_store_leaves_and_removes_it(tmp_path, monkeypatch, capsys):
    from kvmem.replay.traces import default_trace_path

    main = load_script("storage_footprint.py", monkeypatch)["main"]
    assert main([str(default_trace_path()), "--stores", "file,sim", "--dir", str(tmp_path), "--",
                 "--limit", "3", "--host-capacity-tokens", "400000", "--page-size", "16"]) == 0
    files, sim = json.loads(capsys.readouterr().out)["rows"]
    assert files["exit"] == sim["exit"] == 0 and files["stored_tokens"] == sim["stored_tokens"] > 0
    assert files["files"] == 1 and files["bytes"] > 0 and "--storage file:DIR " in files["command"]
    assert (sim["files"], sim["bytes"]) == (0, 0) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, option", [(["t.jsonl", "--stores", "nfs"], "--stores"),
                                          (["t.jsonl", "--dir", "/nonexistent-kvmem"], "--dir"),
                                          (["t.jsonl", "--timeout-s", "0"], "--timeout-s")])
def test_storage_footprint_refuses_bad_arguments_before_any_replay(argv, option, monkeypatch, capsys):
    usage_error("storage_footprint.py", argv, option, monkeypatch, capsys)


def test_replay_tiers_reports_each_points_time_to_first_token_beside_its_hit_rates(monkeypatch):
    pytest.importorskip("torch")  # a host tier replays on the Python engine
    from kvmem.replay.traces import default_trace_path

    script = load_script("replay_tiers.py", monkeypatch)
    row = script["run_point"](str(default_trace_path()), ["--limit", "30", "--capacity-tokens", "100000",
                                                          "--host-capacity-tokens", "400000", "--no-progress"])
    assert row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"] and 0 <= row["host_hit_rate"] <= 1
