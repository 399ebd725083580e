"""benchmarks/bench_recovery.py --smoke: a real `tercet serve` (tiny model,
float32), its scheduler killed -9 under load; every request completes with
the fault-free text."""

import json

import pytest

from .conftest import run_benchmark

pytestmark = pytest.mark.slow  # kills the scheduler of a real server


def test_bench_recovery_smoke(tmp_path):
    """The deterministic mode off (--deterministic off): every other server-level recovery test runs the
    default (on), so the off mode's resume is checked here, through a real server and a real kill."""
    stdout, report = run_benchmark("bench_recovery", "--smoke", "--deterministic", "off",
                                   json_path=tmp_path / "recovery.json", timeout=900)
    assert stdout.count("recovery (kill -> first resumed token") == 1  # the table
    assert report["deterministic"] is False
    check(report)


def test_deterministic_both_runs_each_mode_and_compares_their_identity(monkeypatch, tmp_path, capsys):
    """--deterministic both: off, then on (each a real run like the smoke above), one line comparing
    their identity to the fault-free runs; here on reports made up for it."""
    from benchmarks import bench_recovery

    seen = []

    async def made_up(args):
        seen.append(args.deterministic_now)
        same = 4 if args.deterministic_now else 3
        return {"model": "m", "dtype": "float32", "requests": 4, "output_len": 1, "kills": 1, "replicas": 1,
                "deterministic": args.deterministic_now, "standby": True, "model_load_s": 5.0, "recovery_s": 1.0,
                "restart_s": 0.5, "server_start_s": 9.0, "max_gap_s": 1.0, "completed": 4, "failed": 0,
                "errors": [], "identical_count": same, "identical_to_fault_free": same == 4, "per_kill": []}

    monkeypatch.setattr(bench_recovery, "benchmark", made_up)
    assert bench_recovery.main(["--deterministic", "both", "--json", str(tmp_path / "r.json")]) == 0
    assert seen == [False, True]
    out = capsys.readouterr().out
    assert out.count("recovery (kill -> first resumed token") == 2  # a table each
    assert "identical to the fault-free run: deterministic off 3/4, deterministic on 4/4" in out
    reports = json.loads((tmp_path / "r.json").read_text())
    assert list(reports) == ["off", "on"] and reports["on"]["deterministic"] is True


def check(report):
    for key in ("recovery_s", "max_gap_s", "completed", "failed", "model_load_s", "restart_s",
                "identical_to_fault_free", "target_met", "per_kill"):
        assert key in report, key
    assert report["failed"] == 0 and report["errors"] == []
    assert report["completed"] == report["requests"] > 0
    assert report["identical_to_fault_free"] is True
    assert report["restarts"] == report["kills"] == len(report["per_kill"]) == 1
    # the new scheduler had to start and load the model: no token comes back at once
    assert report["model_load_s"] > 0 and report["restart_s"] > 0
    kill = report["per_kill"][0]
    assert 0 < kill["down_s"] < kill["up_s"] and kill["down_s"] < report["recovery_s"]
    assert report["max_gap_s"] >= report["recovery_s"] - kill["down_s"]


def test_bench_recovery_replica_kill_smoke(tmp_path):
    """--replicas 2: replica 1's scheduler killed; its requests finish on replica 0 before it is back."""
    stdout, report = run_benchmark("bench_recovery", "--smoke", "--replicas", "2",
                                   json_path=tmp_path / "replica.json", timeout=900)
    assert "migration (kill -> first token of a moved request)" in stdout
    assert report["failed"] == 0 and report["completed"] == 4 and report["identical_to_fault_free"] is True
    assert report["migrated"] > 0 and report["restarts"] == 1
    assert 0 < report["migration_s"] < report["restart_s"] and report["target_met"] is True


def test_standby_both_alternates_the_runs_and_compares_each_pair(monkeypatch, tmp_path, capsys):
    """--standby both --rounds 2: off, on, off, on (each a real run in the smoke above: the default is on,
    off is one YAML field); here only the alternation and the ratio of each pair are checked, on reports
    made up for them."""
    from benchmarks import bench_recovery

    seen = []

    async def made_up(args):
        seen.append((args.standby_now, args.deterministic_now))
        recovery = 1.0 if args.standby_now else 4.0
        return {"model": "m", "dtype": "float32", "requests": 1, "output_len": 1, "kills": 1, "replicas": 1,
                "deterministic": True, "standby": args.standby_now, "model_load_s": 5.0, "recovery_s": recovery,
                "restart_s": recovery - 0.5, "server_start_s": 9.0, "max_gap_s": recovery, "completed": 1,
                "failed": 0, "errors": [], "identical_count": 1, "identical_to_fault_free": True, "per_kill": []}

    monkeypatch.setattr(bench_recovery, "benchmark", made_up)
    assert bench_recovery.main(["--standby", "both", "--rounds", "2", "--json", str(tmp_path / "r.json")]) == 0
    assert seen == [(False, True), (True, True), (False, True), (True, True)]
    out = capsys.readouterr().out
    assert out.count("recovery without a spare 4.000 s, with 1.000 s (0.25x); server restart 3.500 -> 0.500 s") == 2
    assert "a spare scheduler process" in out and "no spare process" in out
    reports = json.loads((tmp_path / "r.json").read_text())
    assert list(reports) == ["standby off 1", "standby on 1", "standby off 2", "standby on 2"]
