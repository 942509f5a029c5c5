"""`kvmem-replay --replicas N --router POLICY`: the cluster replay on the command line."""

import json
import runpy
import tempfile
from pathlib import Path

import pytest

from kvmem.replay.cli import main
from kvmem.replay.traces import default_trace_path
from kvmem.router import POLICIES

SMALL = ["--format", "synthetic-chat", "--limit", "24", "--capacity-tokens", "4096", "--no-progress"]


def run(capsys, *argv):
    code = main([*SMALL, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_replicas_and_a_router_print_a_cluster_report(capsys):
    code, out, _ = run(capsys, "--replicas", "3", "--router", "kv-overlap")
    assert code == 0
    report = json.loads(out)
    assert (report["replicas"], report["router"], report["requests"]) == (3, "kv-overlap", 24)
    assert len(report["per_replica"]) == 3 and report["config"]["capacity_tokens"] == 4096
    for key in ("hit_rate", "load_imbalance", "index_hit_rate", "events", "makespan_seconds", "replay_seconds"):
        assert key in report, key
    assert set(report["per_replica"][0]) >= {"requests", "prompt_tokens", "hit_rate", "busy_seconds"}


def test_replicas_alone_route_cache_aware_as_sglangs_router_does(capsys):
    code, out, _ = run(capsys, "--replicas", "2")
    assert code == 0 and json.loads(out)["router"] == "cache-aware"


def test_lists_of_replica_counts_and_policies_sweep_every_pair(capsys):
    code, out, _ = run(capsys, "--replicas", "2,1", "--router", "round-robin,least-load")
    assert code == 0
    runs = [(r["replicas"], r["router"]) for r in json.loads(out)["sweep"]]
    assert runs == [(1, "round-robin"), (1, "least-load"), (2, "round-robin"), (2, "least-load")]


def test_sweep_with_replicas_doubles_the_count_up_to_n_under_every_policy(capsys, tmp_path):
    code, out, _ = run(capsys, "--replicas", "3", "--sweep", "--plot", str(tmp_path), "--limit", "8")
    assert code == 0
    report = json.loads(out)
    assert [(r["replicas"], r["router"]) for r in report["sweep"]] == [(n, p) for n in (1, 2, 3) for p in POLICIES]
    assert sorted(p.rsplit("/", 1)[1] for p in report["plots"]) == ["hit_rate_vs_replicas.png",
                                                                     "load_imbalance_vs_replicas.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in ("hit_rate_vs_replicas.png",
                                                               "load_imbalance_vs_replicas.png"))


def test_a_single_cluster_run_plots_each_replicas_load_and_hit_rate(capsys, tmp_path):
    code, out, _ = run(capsys, "--replicas", "2", "--plot", str(tmp_path))
    assert code == 0 and json.loads(out)["plots"] == [str(tmp_path / "replicas.png")]


@pytest.mark.parametrize("argv, fragment", [
    (["--replicas", "0"], "expected a positive replica count"),
    (["--replicas", "2,x"], "expected a positive replica count"),
    (["--replicas", "2", "--router", "random"], "unknown routing policy 'random'"),
    (["--router", "round-robin"], "--router needs --replicas"),
    (["--replicas", "2", "--sweep", "1000,2000"], "--sweep CAPACITIES sweeps a single replay's capacity"),
    (["--replicas", "1,2", "--host-capacity-tokens", "8192", "--storage", "file:/nonexistent/x"],
     "--storage with several cluster runs"),
])
def test_bad_cluster_options_are_one_line_errors(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvmem-replay: error: ") and fragment in err


def test_the_cluster_table_script_replays_each_policy_then_a_shared_store(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a store on disk would go: none does
    script = Path(__file__).resolve().parents[1] / "scripts" / "replay_cluster.py"
    monkeypatch.syspath_prepend(str(script.parent))  # the script imports _peer from its folder
    main_ = runpy.run_path(str(script), run_name="script")["main"]
    out = tmp_path / "table.json"
    assert main_([str(default_trace_path()), "--limit", "12", "--replicas", "2", "--capacity-tokens", "200000",
                  "--page-size", "512", "--routers", "round-robin,cache-aware", "--host-capacity-tokens", "400000",
                  "--out", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert json.loads(out.read_text())["rows"] == rows
    assert [r["options"].split("--router ")[1] for r in rows] == [
        "round-robin", "cache-aware", "round-robin --host-capacity-tokens 400000 --storage sim"]
    assert rows[0]["vs_first"] == 1.0 and "storage_hit_rate" in rows[2] and rows[2]["requests_per_replica"] == [6, 6]
    assert list(tmp_path.iterdir()) == [out]  # a simulated store writes nothing


@pytest.mark.parametrize("script, argv, fragment", [
    ("replay_cluster.py", ["--replicas", "0"], "expected a positive replica count"),
    ("replay_cluster.py", ["--routers", "bogus"], "unknown routing policy 'bogus'"),
    ("replay_cluster.py", ["--limit", "0"], "limit must be a positive int"),
    ("replay_cluster.py", ["--routers", "", "--shared-storage", ""], "nothing to replay"),
    ("replay_cluster.py", ["--out", "/nonexistent-kvmem/x.json"], "its folder does not exist"),
    ("replay_tiers.py", ["--device", "100000", "--host", "400000", "--write-policy", "bogus"], "invalid choice"),
    ("replay_tiers.py", ["--device", "100000", "--jobs", "0"], "expected a positive int"),
])
def test_the_table_scripts_refuse_bad_options_before_any_replay_in_one_line(capsys, monkeypatch, script, argv,
                                                                           fragment):
    path = Path(__file__).resolve().parents[1] / "scripts" / script
    monkeypatch.syspath_prepend(str(path.parent))
    main_ = runpy.run_path(str(path), run_name="script")["main"]
    try:
        code = main_([str(default_trace_path()), *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err
