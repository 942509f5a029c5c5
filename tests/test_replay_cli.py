import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvmem.replay import cli, native_replay
from kvmem.replay.cli import DEFAULT_CAPACITY_TOKENS, main
from kvmem.replay.compare import GAP_NOISE
from kvmem.replay.config import ReplayConfig
from kvmem.replay.report import ReplayReport, write_sweep_plots
from kvmem.replay.traces import default_trace_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_replay(monkeypatch):
    """Stands in for both engines' replay (kvmem.replay.simulator's and native_replay's): admits every request with
    half its prompt cached."""
    calls = []

    def replay(requests, config, progress=False):
        calls.append((requests, config, progress))
        report = ReplayReport(config.capacity_tokens)
        for step, req in enumerate(requests):
            report.record_admission(req.input_ids.size, req.input_ids.size // 2)
            report.record_step(float(step), min(req.input_ids.size, config.capacity_tokens), 0, 1)
        return report

    from kvmem.replay.simulator import open_storage  # the CLI opens the store as the replay will, before it

    monkeypatch.setitem(sys.modules, "kvmem.replay.simulator", types.SimpleNamespace(replay=replay,
                                                                                      open_storage=open_storage))
    monkeypatch.setattr(native_replay, "replay", replay)
    monkeypatch.setattr(cli, "default_jobs", lambda: 1)  # sweeps in this process, where the stand-in is
    return calls


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, *fragments):
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvmem-replay: error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def write_trace(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = '{"input_ids": [1, 2, 3, 4], "output_len": 2}'


# ---- the report on stdout ---------------------------------------------------------------------------------

def test_no_trace_replays_the_embedded_default_and_prints_the_json_report_last(capsys, fake_replay):
    code, out, err = run(capsys, "--no-progress")
    assert code == 0
    report = json.loads(out)  # the whole of stdout is the one JSON document
    assert out.endswith("}\n")
    assert report["trace"] == str(default_trace_path()) and report["format"] == "mooncake"
    for key in ("requests", "prompt_tokens", "cached_tokens", "hit_rate", "evicted_tokens", "retractions",
                "peak_tokens_used", "mean_tokens_used", "capacity_tokens", "cache_op_seconds", "replay_seconds"):
        assert key in report
    assert report["requests"] == 400 and report["capacity_tokens"] == DEFAULT_CAPACITY_TOKENS
    (requests, config, progress), = fake_replay
    assert len(requests) == 400 and progress is False


def test_options_reach_the_replay_config(capsys, fake_replay, tmp_path):
    path = write_trace(tmp_path, [GOOD, '{"input_ids": [1, 2], "output_len": 9}'])
    code, out, _ = run(capsys, str(path), "--capacity-tokens", "4096", "--page-size", "16", "--eviction-policy",
                       "lfu", "--schedule-policy", "fcfs", "--max-running", "8", "--chunked-prefill-size", "0",
                       "--arrivals", "all-at-once", "--seed", "7")
    assert code == 0
    config = fake_replay[0][1]
    assert config == ReplayConfig(capacity_tokens=4096, max_context_len=11, page_size=16, eviction_policy="lfu",
                                  schedule_policy="fcfs", max_running=8, chunked_prefill_size=None,
                                  honour_arrivals=False, seed=7, h2d_gbps=50.0, d2h_gbps=50.0)
    assert json.loads(out)["config"]["eviction_policy"] == "lfu"  # the report names the links it priced


def test_gpu_memory_and_model_size_the_capacity(capsys, fake_replay):
    sizing = pytest.importorskip("kvmem.sizing")
    code, out, _ = run(capsys, "--gpu-mem-gb", "2", "--model", "llama-3-8b", "--page-size", "16", "--limit", "3")
    assert code == 0
    expected = sizing.tokens_for_budget(sizing.get_model_config("llama-3-8b"), gpu_mem_gb=2.0, page_size=16)
    assert json.loads(out)["capacity_tokens"] == expected == fake_replay[0][1].capacity_tokens


def test_sweep_replays_each_capacity_and_reports_the_curve(capsys, fake_replay):
    code, out, _ = run(capsys, "--limit", "5", "--sweep", "30000,10000,20000")
    assert code == 0
    sweep = json.loads(out)["sweep"]
    assert [r["capacity_tokens"] for r in sweep] == [10000, 20000, 30000]
    assert [c.capacity_tokens for _, c, _ in fake_replay] == [10000, 20000, 30000]


def test_sweep_without_a_list_scales_the_capacity(capsys, fake_replay):
    code, out, _ = run(capsys, "--limit", "2", "--capacity-tokens", "8000", "--sweep")
    assert code == 0
    assert [r["capacity_tokens"] for r in json.loads(out)["sweep"]] == [1000, 2000, 4000, 8000, 16000, 32000]


@pytest.mark.parametrize("fmt", ["synthetic-system", "synthetic-chat", "synthetic-agent"])
def test_synthetic_formats_generate_limit_requests(capsys, fake_replay, fmt):
    code, out, _ = run(capsys, "--format", fmt, "--limit", "12", "--seed", "3")
    assert code == 0
    report = json.loads(out)
    assert report["requests"] == 12 and report["format"] == fmt and report["trace"] == fmt


def test_skip_mode_warns_on_stderr_naming_each_bad_line(capsys, fake_replay, tmp_path):
    path = write_trace(tmp_path, [GOOD, "{oops", GOOD])
    code, out, err = run(capsys, str(path), "--on-error", "skip")
    assert code == 0
    assert f"{path}:2:" in err and "skipped" in err
    report = json.loads(out)
    assert report["skipped_lines"] == 1 and report["requests"] == 2


# ---- the real replay, end to end (no fake): small handmade traces, figures worked out by hand ----------------
# tests/test_replay_simulator.py works these traces through step by step; here they go through the command line.
THREE = ['{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_ids": [100, 101], "arrival_s": 0}',
         '{"input_ids": [1, 2, 3, 4, 9, 10], "output_ids": [102], "arrival_s": 10}',
         '{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_ids": [103], "arrival_s": 20}']
SMALL = ["--no-progress", "--schedule-policy", "fcfs", "--chunked-prefill-size", "0"]


def test_the_real_replay_reports_the_hit_rate_and_steps_worked_out_by_hand(capsys, tmp_path):
    # 0 + 4 + 7 of 8 + 6 + 8 prompt tokens cached (a wholly cached prompt still computes its last token).
    code, out, _ = run(capsys, str(write_trace(tmp_path, THREE)), "--capacity-tokens", "64", *SMALL)
    assert code == 0
    report = json.loads(out)
    assert (report["requests"], report["prompt_tokens"], report["cached_tokens"]) == (3, 22, 11)
    assert report["hit_rate"] == 0.5
    assert (report["steps"], report["evicted_tokens"], report["retractions"], report["rejected"]) == (4, 0, 0, 0)
    assert (report["peak_tokens_used"], report["peak_pinned_tokens"], report["capacity_tokens"]) == (11, 8, 64)
    assert report["config"]["max_context_len"] == 10 and report["replay_seconds"] >= report["cache_op_seconds"] > 0


def test_the_real_replay_queues_everything_at_once_with_all_at_once_arrivals(capsys, tmp_path):
    code, out, _ = run(capsys, str(write_trace(tmp_path, THREE)), "--capacity-tokens", "64", "--arrivals",
                       "all-at-once", *SMALL)
    assert code == 0
    report = json.loads(out)
    assert (report["cached_tokens"], report["steps"]) == (0, 2)  # all three prefilled in one step, then a decode


def test_a_real_sweep_loses_the_hit_to_eviction_at_the_small_capacity(capsys, tmp_path):
    trace = write_trace(tmp_path, ['{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_ids": [100], "arrival_s": 0}',
                                   '{"input_ids": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29], "output_ids": [101], '
                                   '"arrival_s": 1}',
                                   '{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "output_ids": [102], "arrival_s": 2}'])
    code, out, _ = run(capsys, str(trace), "--sweep", "64,16", "--plot", str(tmp_path / "plots"), *SMALL)
    assert code == 0
    report = json.loads(out)
    got = [(r["capacity_tokens"], r["cached_tokens"], r["evicted_tokens"], r["steps"]) for r in report["sweep"]]
    assert got == [(16, 0, 18, 3), (64, 7, 0, 3)]
    assert Path(report["plots"][0]).read_bytes()[:4] == b"\x89PNG"


def test_the_real_replay_matches_whole_pages_only(capsys, tmp_path):
    trace = write_trace(tmp_path, [THREE[0], THREE[2]])
    code, out, _ = run(capsys, str(trace), "--capacity-tokens", "64", "--page-size", "4", *SMALL)
    assert code == 0
    assert json.loads(out)["cached_tokens"] == 4  # A's first page; its last page holds the token to compute


def test_the_real_replay_of_the_embedded_trace_and_a_synthetic_chat(capsys):
    code, out, _ = run(capsys, "--no-progress", "--limit", "12", "--capacity-tokens", "65536")
    assert code == 0
    report = json.loads(out)
    assert report["requests"] + report["rejected"] == 12 and report["steps"] > 0
    assert 0 <= report["cached_tokens"] <= report["prompt_tokens"] and report["peak_tokens_used"] <= 65536
    code, out, _ = run(capsys, "--no-progress", "--format", "synthetic-chat", "--limit", "40",
                       "--capacity-tokens", "65536")
    assert code == 0
    report = json.loads(out)
    assert report["requests"] == 40 and report["hit_rate"] > 0.2  # follow-up turns reuse their predecessors


# ---- user errors: one line on stderr, exit 2 --------------------------------------------------------------

def test_a_malformed_line_stops_the_run_naming_the_line(capsys, fake_replay, tmp_path):
    path = write_trace(tmp_path, [GOOD, '{"input_ids": [1], "output_len": -3}'])
    assert_one_line_error(*run(capsys, str(path)), f"{path}:2:", "output_len", "--on-error skip")
    assert fake_replay == []


def test_a_missing_trace_file_exits_2(capsys, fake_replay, tmp_path):
    assert_one_line_error(*run(capsys, str(tmp_path / "missing.jsonl")), "missing.jsonl", "cannot open")


@pytest.mark.parametrize("argv, fragment", [
    (["--format", "csv"], "invalid choice"),
    (["--capacity-tokens", "100", "--gpu-mem-gb", "8"], "not allowed with"),
    (["--gpu-mem-gb", "8"], "needs --model"),
    (["--model", "llama-3-99b"], "not a known model"),
    (["--host-mem-gb", "8"], "needs --model"),
    (["--host-capacity-tokens", "1000", "--capacity-tokens", "4096"], "must exceed"),
    (["--write-policy", "write_around"], "invalid choice"),
    (["--capacity-tokens", "100", "--kv-cache-dtype", "int8"], "--kv-cache-dtype only"),
    (["--capacity-tokens", "0"], "positive int"),
    (["--page-size", "16", "--capacity-tokens", "8"], "less than one page"),
    (["--sweep", "100,x"], "comma-separated"),
    (["--format", "jsonl"], "needs a TRACE"),
    (["--format", "synthetic-chat", "some.jsonl"], "drop TRACE"),
    (["--limit", "-1"], "positive int"),
    (["--bogus"], "unrecognized arguments"),
    (["--storage", "file:/tmp/kvmem-x"], "needs a host tier"),
    (["--host-capacity-tokens", "600000", "--storage", "s3:bucket"], "'file:DIR' or 'mooncake:HOST:PORT'"),
    (["--host-capacity-tokens", "600000", "--storage", "file:/proc/kvmem-cannot-be-here"], "cannot hold a store"),
    (["--host-capacity-tokens", "600000", "--storage", "mooncake:localhost"], "host:port"),
    (["--host-capacity-tokens", "600000", "--storage", "mooncake:127.0.0.1:1"], "no master answers"),
    (["--host-capacity-tokens", "600000", "--storage-capacity-tokens", "0"], "positive int"),
    # A tier's options without the tier would be ignored, and its figures read as the tier's.
    (["--write-policy", "write_back"], "--write-policy needs a host tier"),
    (["--h2d-gbps", "5"], "--h2d-gbps needs a host tier"),
    (["--d2h-gbps", "5"], "--d2h-gbps needs a host tier"),
    (["--host-capacity-tokens", "600000", "--storage-gbps", "3"], "--storage-gbps needs a storage tier"),
    (["--host-capacity-tokens", "600000", "--storage-metadata", "http://127.0.0.1:1/metadata"],
     "--storage-metadata needs a storage tier"),
    (["--host-capacity-tokens", "600000", "--storage-capacity-tokens", "5000"],
     "--storage-capacity-tokens needs a storage tier"),
    (["--host-capacity-tokens", "600000", "--storage-latency-us", "50"], "--storage-latency-us needs a storage tier"),
    (["--host-capacity-tokens", "600000", "--storage", "sim", "--storage-latency-us", "-1"], "non-negative"),
    (["--host-capacity-tokens", "600000", "--storage", "sim:0"], "'sim[:CAPACITY_TOKENS]'"),
    (["--host-capacity-tokens", "600000", "--storage", "sim:5000", "--storage-capacity-tokens", "5000"],
     "give the simulated store's capacity once"),
    (["--host-capacity-tokens", "600000", "--storage", "file:{tmp}", "--storage-capacity-tokens", str(1 << 62)],
     "is more than"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, fake_replay, tmp_path, argv, fragment):
    assert_one_line_error(*run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv]), fragment)
    assert fake_replay == []


@pytest.mark.mooncake
def test_a_mooncake_address_where_no_master_speaks_is_a_one_line_error(capfd, fake_replay):
    import socket

    from kvmem.storage.mooncake_store import _mooncake_store_class

    try:
        _mooncake_store_class()
    except RuntimeError as e:
        pytest.skip(f"the Mooncake store cannot load here: {e}")
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers: not a master
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        code = main(["--host-capacity-tokens", "600000", "--storage", f"mooncake:127.0.0.1:{silent.getsockname()[1]}"])
    out, err = capfd.readouterr()
    assert_one_line_error(code, out, err, "no Mooncake master answered within 5 s")
    assert fake_replay == []


def test_the_help_offers_the_simulated_store_for_planning(capsys):
    code, out, _ = run(capsys, "--help")
    text = " ".join(out.split())
    assert code == 0 and "sim[:CAPACITY_TOKENS] (a simulated store" in text and "--storage-latency-us US" in text


def test_a_replay_that_rejects_every_request_reports_it_and_exits_2(capsys):
    code, out, err = run(capsys, "--capacity-tokens", "64", "--limit", "3", "--no-progress", "--json-only")
    assert code == 2 and json.loads(out)["rejected"] == 3
    assert err.splitlines()[-1] == ("kvmem-replay: error: all 3 requests were rejected: none fits in the KV "
                                    "cache's 64 tokens")


def test_a_file_in_no_known_format_exits_2(capsys, fake_replay, tmp_path):
    path = write_trace(tmp_path, ['{"prompt": "hello"}'])
    assert_one_line_error(*run(capsys, str(path)), "unknown trace format")


def test_an_unknown_model_exits_2(capsys, fake_replay):
    pytest.importorskip("kvmem.sizing")
    assert_one_line_error(*run(capsys, "--gpu-mem-gb", "8", "--model", "gpt-17"), "gpt-17")


def test_plotting_without_matplotlib_fails_before_the_replay(capsys, fake_replay, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert_one_line_error(*run(capsys, "--plot", str(tmp_path)), "plots need matplotlib: pip install 'kvmem[plot]'\n")
    assert fake_replay == []


def test_an_unwritable_plot_directory_fails_before_the_replay(capsys, fake_replay, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line_error(*run(capsys, "--plot", str(blocker / "plots")), "cannot write plots")
    assert fake_replay == []


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--capacity-tokens" in capsys.readouterr().out


@pytest.mark.parametrize("entry", [["scripts/replay.py"], ["-m", "kvmem.replay.cli"]])
def test_the_script_shim_and_the_module_report_errors_without_a_traceback(tmp_path, entry):
    if entry[0] == "scripts/replay.py":
        entry = [str(REPO / entry[0])]
    proc = subprocess.run([sys.executable, *entry, str(tmp_path / "none.jsonl")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "none.jsonl" in proc.stderr


# ---- the report itself ------------------------------------------------------------------------------------

def test_a_one_capacity_sweep_still_plots(tmp_path, figures):
    report = ReplayReport(1000)
    report.record_admission(100, 25)
    assert all(p.exists() for p in write_sweep_plots([report], tmp_path))
    assert len(figures[0].axes[0].get_lines()) == 1


def test_tier_hits_add_up_over_admissions_and_a_wholly_cached_prompt_is_admissible():
    report = ReplayReport(capacity_tokens=100, host_capacity_tokens=1000)
    report.record_admission(10, 10)  # all of it cached on the device
    report.record_admission(30, 20, 12, 5)  # 20 cached: 8 on the device, 7 from the host, 5 from storage
    report.record_admission(15, 9, 3)
    assert (report.cached_tokens, report.host_cached_tokens, report.storage_cached_tokens) == (39, 10, 5)
    summary = report.to_json()
    assert (summary["hit_rate"], summary["host_hit_rate"]) == (round(39 / 55, 6), round(10 / 55, 6))
    assert summary["device_hit_rate"] == round(24 / 55, 6)


def test_hit_rate_is_cached_prefix_tokens_at_first_admission_over_prompt_tokens():
    report = ReplayReport(capacity_tokens=100)
    report.record_admission(40, 10)
    report.record_step(0.5, 60, 20, 1)
    report.record_admission(60, 30)
    report.record_step(1.0, 90, 10, 2)
    summary = report.to_json()
    assert summary["hit_rate"] == 0.4 and summary["prompt_tokens"] == 100 and summary["cached_tokens"] == 40
    assert summary["peak_tokens_used"] == 90 and summary["mean_tokens_used"] == 75.0
    assert summary["peak_pinned_tokens"] == 80 and summary["steps"] == 2
    assert list(report.cumulative_hit_rate) == [0.25, 0.4]
    assert (report.host_cached_tokens, report.storage_cached_tokens) == (0, 0)
    with pytest.raises(ValueError, match="cached_len"):
        report.record_admission(5, 6)


def test_plots_are_written_as_png_files(tmp_path):
    reports = []
    for capacity in (1000, 2000):
        report = ReplayReport(capacity)
        report.record_admission(100, capacity // 40)
        report.record_step(0.0, 500, 100, 1)
        report.record_step(1.0, 900, 300, 2)
        reports.append(report)
    paths = reports[0].write_plots(tmp_path) + write_sweep_plots(reports, tmp_path)
    assert [p.name for p in paths] == ["memory_use.png", "hit_rate.png", "hit_rate_vs_capacity.png",
                                       "ttft_vs_capacity.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_plot_option_writes_the_plots_named_in_the_report(capsys, fake_replay, tmp_path):
    code, out, _ = run(capsys, "--limit", "3", "--plot", str(tmp_path / "single"))
    assert code == 0
    assert [Path(p).name for p in json.loads(out)["plots"]] == ["memory_use.png", "hit_rate.png"]
    code, out, _ = run(capsys, "--limit", "3", "--sweep", "1000,2000", "--plot", str(tmp_path / "sweep"))
    assert code == 0 and Path(json.loads(out)["plots"][0]).exists()


def test_a_plot_that_cannot_be_written_after_the_replay_keeps_the_report(capsys, fake_replay, tmp_path, monkeypatch):
    def disk_full(self, directory):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ReplayReport, "write_plots", disk_full)
    code, out, err = run(capsys, "--limit", "3", "--plot", str(tmp_path))
    assert code == 2 and json.loads(out)["requests"] == 3 and "plots" not in json.loads(out)
    assert err.endswith(f"error: cannot write plots to {tmp_path}: No space left on device\n")


# ---- time, the summary, the tour ----------------------------------------------------------------------------

def test_a_gpu_server_prices_the_clock_and_sizes_the_cache(capsys, fake_replay):
    from kvmem.replay.cost import RooflineCost

    code, out, _ = run(capsys, "--limit", "3", "--gpu", "H100", "--model", "llama-3-70b", "--tp", "8",
                       "--page-size", "16")
    assert code == 0
    config = fake_replay[0][1]
    assert (config.gpu, config.model, config.tp, config.kv_bytes_per_token) == ("H100", "llama-3-70b", 8, 327680)
    assert config.capacity_tokens == RooflineCost("H100", "llama-3-70b", 8).kv_capacity_tokens(16)
    assert config.h2d_gbps == config.d2h_gbps == 50.0  # the H100's host link
    code, _, _ = run(capsys, "--limit", "3", "--gpu", "A100", "--capacity-tokens", "5000", "--kv-cache-dtype",
                     "fp8_e4m3")
    config = fake_replay[1][1]
    assert code == 0 and config.capacity_tokens == 5000 and config.model == "llama-3-8b"
    assert config.h2d_gbps == 25.0 and config.kv_bytes_per_token == 65536


@pytest.mark.parametrize("argv, fragment", [
    (["--tp", "2"], "--tp needs --gpu"),
    (["--gpu", "H100", "--model", "deepseek-v3"], "leave no room for a KV cache"),
    (["--gpu", "V100"], "invalid choice"),
    (["--jobs", "0"], "positive int"),
])
def test_bad_gpu_options_exit_2_with_one_line(capsys, fake_replay, argv, fragment):
    assert_one_line_error(*run(capsys, *argv), fragment)


def test_caching_switches_reach_the_replay_config(capsys, fake_replay):
    assert run(capsys, "--limit", "2")[0] == 0
    assert fake_replay[0][1].cache_decode_pages and not fake_replay[0][1].in_batch_prefix_caching
    assert run(capsys, "--limit", "2", "--no-cache-decode-pages", "--in-batch-prefix-caching")[0] == 0
    assert not fake_replay[1][1].cache_decode_pages and fake_replay[1][1].in_batch_prefix_caching


def test_a_human_summary_goes_to_stderr_unless_json_only(capsys, fake_replay):
    code, out, err = run(capsys, "--limit", "4", "--no-progress")
    assert code == 0 and "hit rate" in err and "TTFT p50 / p90 / p99" in err and json.loads(out)["requests"] == 4
    code, out, err = run(capsys, "--limit", "4", "--no-progress", "--json-only")
    assert code == 0 and err == "" and json.loads(out)["requests"] == 4
    code, _, err = run(capsys, "--limit", "4", "--no-progress", "--sweep", "1000,2000")
    lines = err.splitlines()  # the trace, its reuse ceiling, the clock, the table's header and its two rows
    assert code == 0 and "reuse ceiling" in lines[1] and "capacity" in lines[3] and len(lines) == 6


def test_no_arguments_at_all_tours_capacities_with_and_without_a_host_tier(capsys, fake_replay):
    code, out, err = run(capsys)
    assert code == 0
    report = json.loads(out)
    points = [(c.capacity_tokens, c.host_capacity_tokens, c.gpu, c.tp) for _, c, _ in fake_replay]
    full = points[-1][0]
    assert [p[1] for p in points] == [None, 4 * points[0][0], None, 4 * full]
    assert points[0][0] == full // 4 and {p[2:] for p in points} == {("H100", 2)}
    assert len(report["sweep"]) == 4 and "The tour" in err


def test_a_sweep_on_the_python_engine_runs_its_replays_in_worker_processes(capsys, tmp_path):
    path = write_trace(tmp_path, ['{"input_ids": [%s], "output_len": 3}' % ", ".join(map(str, range(i, i + 40)))
                                  for i in range(6)])
    code, out, err = run(capsys, str(path), "--sweep", "64,128,4096", "--jobs", "2", "--no-progress", "--engine",
                         "python")
    assert code == 0
    sweep = json.loads(out)["sweep"]
    assert [r["capacity_tokens"] for r in sweep] == [64, 128, 4096]
    assert all(r["requests"] == 6 and r["output_tokens"] == 18 for r in sweep)
# ---- eviction policies -----------------------------------------------------------------------------------------

def test_every_eviction_policy_name_is_accepted(capsys, fake_replay):
    from kvmem.eviction import EVICTION_POLICIES

    for name in EVICTION_POLICIES:
        code, out, _ = run(capsys, "--limit", "2", "--eviction-policy", name)
        assert code == 0 and json.loads(out)["config"]["eviction_policy"] == name


def test_compare_policies_runs_lru_and_belady_beside_the_named_ones_in_parallel_and_prints_a_table(capsys, tmp_path):
    code, out, err = run(capsys, "--limit", "3", "--compare-policies", "s3fifo,gdsf", "--sweep", "1000,2000",
                         "--jobs", "2", "--plot", str(tmp_path), "--no-progress")
    assert code == 0
    compare = json.loads(out)["compare"]
    assert compare["policies"] == ["lru", "s3fifo", "gdsf", "belady"] and compare["capacities"] == [1000, 2000]
    assert set(compare["hit_rate"]) == set(compare["gap_closed"]) == set(compare["policies"])
    assert {(r["eviction_policy"], r["capacity_tokens"]) for r in compare["runs"]} == {
        (p, c) for p in compare["policies"] for c in (1000, 2000)}
    assert "policy" in err and "s3fifo" in err and "belady" in err
    assert json.loads(out)["plots"] == [str(tmp_path / "hit_rate_by_policy.png")]
    assert (tmp_path / "hit_rate_by_policy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_policies_reports_the_share_of_the_gap_each_policy_closes(capsys):
    code, out, err = run(capsys, "--format", "synthetic-chat", "--limit", "40", "--capacity-tokens", "3000",
                         "--compare-policies", "lookahead", "--jobs", "1", "--no-progress")
    assert code == 0
    compare = json.loads(out)["compare"]
    hit, gap = compare["hit_rate"], compare["gap_closed"]
    lru, belady = hit["lru"][0], hit["belady"][0]
    for policy in compare["policies"]:
        expected = (hit[policy][0] - lru) / (belady - lru) if belady - lru >= GAP_NOISE else None
        assert gap[policy][0] == (expected if expected is None else pytest.approx(expected, abs=1e-3))
    assert "policy" in err
    code, out, err = run(capsys, "--format", "synthetic-chat", "--limit", "40", "--capacity-tokens", "3000",
                         "--compare-policies", "lookahead", "--jobs", "1", "--no-progress", "--json-only")
    assert code == 0 and json.loads(out)["compare"]["hit_rate"] == hit and "policy" not in err  # no table


def test_compare_policies_prints_its_table_at_a_capacity_that_is_not_whole_pages(capsys):
    # The reports' capacity is rounded down to whole pages; the table looked lru's runs up by the one asked for.
    code, out, err = run(capsys, "--format", "synthetic-system", "--limit", "30", "--capacity-tokens", "20001",
                         "--page-size", "16", "--compare-policies", "lru", "--jobs", "1", "--no-progress")
    assert code == 0 and "Traceback" not in err and "lru: evictable" in err
    assert json.loads(out)["compare"]["capacities"] == [20001]


def test_compare_table_shows_each_policy_then_how_much_lru_could_choose_among_and_its_ttft():
    from kvmem.replay.compare import format_table

    def run_of(policy, capacity, evictable, ttft):
        return {"eviction_policy": policy, "capacity_tokens": capacity, "mean_evictable_tokens": evictable,
                **({} if ttft is None else {"ttft_p50_s": ttft})}

    result = {"policies": ["lru", "lookahead", "belady"], "capacities": [1000, 3000],
              "hit_rate": {"lru": [0.1, 0.2], "lookahead": [0.15, 0.2], "belady": [0.2, 0.2]},
              "gap_closed": {"lru": [0.0, None], "lookahead": [0.5, None], "belady": [1.0, None]},
              "runs": [run_of("belady", 1000, 0, 9.0), run_of("lru", 3000, 2990, None),
                       run_of("lru", 1000, 130, 5.83)]}
    assert format_table(result).splitlines() == [
        "policy                             1,000                   3,000",
        "----------------------------------------------------------------",
        "lru                               0.1000                  0.2000",
        "lookahead           0.1500 (+50% of gap)            0.2000 (n/a)",
        "belady                            0.2000                  0.2000",
        "----------------------------------------------------------------",
        "lru: evictable                       13%                    100%",
        "lru: TTFT p50                     5.83 s                       -",
    ]


@pytest.mark.parametrize("argv, fragment", [
    (["--compare-policies", "lru,random"], "eviction policies"),
    (["--eviction-policy", "random"], "invalid choice"),
    (["--pin-budget", "2"], "[0, 1]"),
    (["--pin-prefix-tokens", "-1"], "non-negative"),
])
def test_bad_policy_options_exit_2_with_one_line(capsys, fake_replay, argv, fragment):
    assert_one_line_error(*run(capsys, *argv), fragment)


@pytest.mark.parametrize("argv, fragment", [
    (["--compare-policies", "lru,fifo", "--eviction-policy", "lfu"], "name the policies in --compare-policies"),
    (["--sweep", "100000,200000", "--capacity-tokens", "5000"], "the list sets the capacities"),
    (["--capacity-tokens", "200000", "--host-capacity-tokens", "4000000", "--sweep", "--storage", "file:{tmp}"],
     "each replay would find the pages the ones before it stored"),
    (["--capacity-tokens", "200000", "--host-capacity-tokens", "4000000", "--compare-policies", "lru",
      "--storage", "file:{tmp}"], "each replay would find the pages the ones before it stored"),
])
def test_options_another_overrides_or_replays_that_would_depend_on_each_other_exit_2(capsys, fake_replay, tmp_path,
                                                                                     argv, fragment):
    plots = tmp_path / "plots"
    argv = [a.format(tmp=tmp_path / "store") for a in argv] + ["--plot", str(plots)]
    assert_one_line_error(*run(capsys, *argv), fragment)
    assert fake_replay == [] and not plots.exists()  # nothing made for a replay that does not run


def test_a_trace_through_a_pipe_needs_its_format_and_one_process(capsys, fake_replay, tmp_path):
    import os

    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    assert_one_line_error(*run(capsys, str(fifo)), "not a regular file: give its --format")
    assert_one_line_error(*run(capsys, str(fifo), "--format", "mooncake", "--compare-policies", "lru", "--jobs",
                               "2"), "a pipe can be read once): use --jobs 1")
    assert fake_replay == []


def test_a_missing_trace_makes_no_plot_folder(capsys, fake_replay, tmp_path):
    plots = tmp_path / "deep" / "plots"
    assert_one_line_error(*run(capsys, str(tmp_path / "missing.jsonl"), "--plot", str(plots)), "cannot open")
    assert not (tmp_path / "deep").exists()


def _descendants(pid: int) -> set[int]:
    """The processes under `pid`, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (a reaper-less container keeps those)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_sweep_stopped_by_sigterm_leaves_no_worker_behind():
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "kvmem.replay.cli", "--format", "synthetic-chat", "--limit",
                             "100000", "--sweep", "100000,200000", "--jobs", "2", "--no-progress", "--engine",
                             "python"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(children) < 2 and time.monotonic() < deadline:  # the two workers (and the tracker, maybe)
            time.sleep(0.2)
            children = _descendants(proc.pid)
        assert len(children) >= 2, "the sweep's workers never started"
        time.sleep(5.0)  # they are replaying
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 30
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _alive(c)], "workers outlived the sweep"
        # A worker still starting up when it is killed may have printed a traceback of its own after this line.
        assert proc.communicate(timeout=30)[1].decode().splitlines()[0] == "kvmem-replay: error: terminated"
    finally:
        for c in children | _descendants(proc.pid):
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
                pass
        proc.kill()


def test_a_worker_exits_when_the_process_that_started_it_is_gone():
    """A worker the sweep did not know of yet when it was interrupted (started while the Ctrl-C came) must not wait
    for work for ever, holding the terminal's stderr."""
    import os
    import signal
    import time

    code = ("import multiprocessing, os\n"
            "from concurrent.futures import ProcessPoolExecutor\n"
            "from kvmem.replay.workers import init_worker\n"
            "pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'), initializer=init_worker)\n"
            "print(pool.submit(os.getpid).result(timeout=120), flush=True)\n"
            "os._exit(0)  # gone without shutting the pool down: its idle worker is left behind\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(proc.communicate(timeout=150)[0].split()[0])
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived the process that started it"
    finally:
        proc.kill()
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except OSError:
                pass


def test_pin_options_reach_the_replay_config(capsys, fake_replay):
    code, out, _ = run(capsys, "--format", "synthetic-system", "--limit", "5", "--pin-prefix-tokens", "1024",
                       "--pin-budget", "0.1")
    assert code == 0
    config = fake_replay[0][1]
    assert (config.pin_prefix_tokens, config.pin_budget) == (1024, 0.1)


def test_pinning_system_prompts_in_a_replay_keeps_a_rarely_used_one_cached():
    import dataclasses

    import numpy as np

    from kvmem.replay.simulator import replay
    from kvmem.replay.traces import TraceRequest

    rng = np.random.default_rng(0)
    rare, busy = rng.integers(0, 1 << 30, 256), rng.integers(0, 1 << 30, 256)
    prompts = [rare] + [busy] * 8 + [rare]  # the rare system prompt's users are 8 big requests apart
    trace = [TraceRequest(np.concatenate([p, rng.integers(0, 1 << 30, 1500)]), 1, arrival_s=5.0 * i)
             for i, p in enumerate(prompts)]
    config = ReplayConfig(capacity_tokens=4000, max_context_len=1800, eviction_policy="lru")
    plain = replay(trace, config)
    pinned = replay(trace, dataclasses.replace(config, pin_prefix_tokens=256, pin_budget=0.2))
    assert pinned.cached_tokens == plain.cached_tokens + 256  # the last request finds the rare prompt


# ---- what the plots draw ------------------------------------------------------------------------------------
@pytest.fixture
def figures(monkeypatch):
    """The matplotlib Figures the report draws, kept for inspection (they are still saved as usual)."""
    from matplotlib.figure import Figure

    import kvmem.replay.report as report_module

    drawn = []

    class Recorded(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            drawn.append(self)

    monkeypatch.setattr(report_module, "require_matplotlib", lambda: Recorded)
    return drawn


def lines_of(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def png_dpi(path: Path) -> float:
    """The resolution a PNG records in its pHYs chunk (pixels per metre), in dots per inch."""
    data = path.read_bytes()
    at = data.index(b"pHYs") + 4
    return round(int.from_bytes(data[at:at + 4], "big") * 0.0254)


def test_the_memory_and_hit_rate_plots_draw_the_samples_against_simulated_time(tmp_path, figures):
    report = ReplayReport(1000)
    report.record_admission(100, 25)
    report.record_step(0.5, 500, 100, 1)
    report.record_step(1.5, 900, 300, 2)
    paths = report.write_plots(tmp_path / "new" / "plots")
    memory, hit = figures
    assert [p.name for p in paths] == ["memory_use.png", "hit_rate.png"] and all(png_dpi(p) == 120 for p in paths)
    # Cropped to what is drawn: smaller than the 960 x 540 of the whole 8 x 4.5 in figure at 120 dpi.
    assert all(png_size(p)[0] < 960 and png_size(p)[1] < 540 for p in paths)
    assert tuple(memory.get_size_inches()) == tuple(hit.get_size_inches()) == (8, 4.5)
    (ax,) = memory.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("KV-cache memory use", "simulated time (s)",
                                                                  "KV tokens")
    lines = lines_of(ax)
    assert lines["used (requests + cache)"] == ([0.5, 1.5], [500, 900])
    assert lines["pinned by running requests"] == ([0.5, 1.5], [400, 600])
    assert lines["capacity"][1] == [1000, 1000] and ax.get_lines()[2].get_linestyle() == "--"
    assert ax.get_lines()[2].get_color() == "grey"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(lines) and ax.get_legend()._loc == 4
    (ax,) = hit.axes
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_ylim()) == (
        "Prefix-cache hit rate (final 0.250)", "simulated time (s)", "cumulative hit rate", (0, 1))
    assert list(lines_of(ax).values()) == [([0.5, 1.5], [0.25, 0.25])]


@pytest.mark.parametrize("tiered", [False, True])
def test_the_sweep_plot_draws_a_hit_rate_curve_per_tier_over_the_capacities_as_typed(tmp_path, figures, tiered):
    reports = []
    for capacity, device, host in ((4000, 30, 10), (1000, 10, 20)):
        report = ReplayReport(capacity, host_capacity_tokens=9000 if tiered else None)
        report.record_admission(100, device + host, host)
        reports.append(report)
    hit_path, ttft_path = write_sweep_plots(reports, tmp_path / "sweep" / "plots", labels=["4k", "1k"],
                                            ceilings={"reuse ceiling": 0.5})
    assert (hit_path.name, ttft_path.name) == ("hit_rate_vs_capacity.png", "ttft_vs_capacity.png")
    assert png_dpi(hit_path) == 120 and png_size(hit_path)[0] < 960 and png_size(hit_path)[1] < 540
    assert tuple(figures[0].get_size_inches()) == (8, 4.5)
    ax = figures[0].axes[0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_ylim(), ax.get_xscale()) == (
        "Hit rate vs KV capacity", "device KV capacity", "hit rate", (0, 1), "log")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "4k"]  # as typed, not powers of 2
    assert all(g.get_visible() and g.get_alpha() == 0.3 for g in ax.xaxis.get_gridlines() + ax.yaxis.get_gridlines())
    curves = {name: (x, [round(y, 2) for y in ys]) for name, (x, ys) in lines_of(ax).items()}
    ceiling = curves.pop("reuse ceiling 0.500")
    assert ceiling[1] == [0.5, 0.5] and ax.get_lines()[-1].get_linestyle() == "--"
    if not tiered:
        assert list(curves.values())[0] == ([1000, 4000], [0.3, 0.4])
        assert list(curves)[0].startswith("_")  # unlabelled: the ceiling alone is in the legend
        return
    assert curves == {"host 9k": ([1000, 4000], [0.3, 0.4]), "device": ([1000, 4000], [0.1, 0.3]),
                      "host (9k)": ([1000, 4000], [0.2, 0.1])}
    assert ax.get_legend()._loc == 2


def test_the_sweep_plots_mark_what_the_chosen_gpus_hold_where_it_falls_among_the_capacities(tmp_path, figures):
    reports = [ReplayReport(c) for c in (1000, 4000, 16000)]
    write_sweep_plots(reports, tmp_path, fit=(6000, "1 x H100"))
    for ax in (figures[0].axes[0], figures[1].axes[0]):
        line = lines_of(ax)["what 1 x H100 hold: 6k"]
        assert line[0] == [6000, 6000] and ax.get_lines()[-1].get_linestyle() == "-."
    write_sweep_plots(reports, tmp_path, fit=(50000, "8 x H100"))  # every capacity fits: nothing to mark
    assert not [name for name in lines_of(figures[2].axes[0]) if name.startswith("what")]
