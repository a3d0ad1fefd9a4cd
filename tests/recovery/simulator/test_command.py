"""The ``simulate`` command: the files it writes, their contract, and its errors on bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from controlplane.recovery.cli import main
from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import Cluster
from controlplane.recovery.simulator.traces import TraceSpec, generate, save_csv

ROOT = Path(__file__).resolve().parents[3]
ENTRY_KEYS = {
    "samples_mean",
    "samples_ci95",
    "throughput_mean",
    "downtime_s_mean",
    "recoveries_mean",
}


def scenario(tmp_path: Path) -> Path:
    """A 4-stage × 2-pipeline job on 8 devices, nodes of 4, with free communication."""
    data: dict[str, Any] = {
        "model": {"layers": 8, "fwd_s": 1.0, "bwd_s": 2.0, "m_p": 1, "m_o": 6, "m_g": 1, "m_a": 2},
        "cluster": {"devices": 8, "devices_per_node": 4, "failure_rate_per_device_hour": 0.2},
        "training": {"global_batch": 8},
        "plan": {
            "pipelines": [
                {
                    "stages": [
                        {"devices": [4 * p + s], "layers": [2 * s, 2 * s + 2]} for s in range(4)
                    ],
                    "micro_batches": 4,
                }
                for p in range(2)
            ]
        },
        "failed": [3],
    }
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(data))
    return path


def test_simulate_writes_summary_timeline_and_self_contained_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["simulate", str(scenario(tmp_path)), "--hours", "3", "--seeds", "3"]
    code = main([*args, "--policies", "odyssey,rerouting", "--out", str(out), "--save-traces"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert list(summary["policies"]) == ["odyssey", "rerouting"]
    for entry in summary["policies"].values():
        assert set(entry) >= ENTRY_KEYS
        lo, hi = entry["samples_ci95"]
        assert lo <= entry["samples_mean"] <= hi
    ratios = summary["ratios"]
    assert ratios["odyssey"] == 1.0
    odyssey, rerouting = (summary["policies"][n]["samples_mean"] for n in ("odyssey", "rerouting"))
    assert ratios["rerouting"] == pytest.approx(odyssey / rerouting)
    # the ideal ran on the same seeds and bounds every policy's samples
    ideal = summary["ideal"]["samples_mean"]
    assert ideal >= max(odyssey, rerouting)
    for name in ("odyssey", "rerouting"):
        share = summary["share_of_ideal"][name]
        assert share["ci95"][0] <= share["mean"] <= share["ci95"][1]
    timeline = json.loads((out / "timeline.json").read_text())
    assert [run["seed"] for run in timeline["odyssey"]] == [0, 1, 2]
    assert [run["seed"] for run in timeline["ideal"]] == [0, 1, 2]
    assert sorted(p.name for p in (out / "traces").iterdir()) == [
        "seed-0.csv",
        "seed-1.csv",
        "seed-2.csv",
    ]
    report = (out / "report.html").read_text()
    assert "Plotly.newPlot" in report and "Recovery timeline" in report
    assert "Share of the ideal" in report
    # plotly.js is inlined (megabytes), nothing is loaded from elsewhere
    assert "<script src=" not in report and len(report) > 1_000_000


def test_replayed_trace_gives_the_runs_of_the_drawn_one(tmp_path: Path) -> None:
    path = scenario(tmp_path)
    common = ["--hours", "3", "--seeds", "1", "--policies", "odyssey,dynamic", "--no-report"]
    drawn = tmp_path / "drawn"
    assert main(["simulate", str(path), *common, "--seed", "4", "--out", str(drawn)]) == 0
    trace = generate(TraceSpec(failure_rate_per_device_hour=0.2), Cluster(8, 4), 3 * 3600.0, 4)
    save_csv(trace, tmp_path / "trace.csv")
    replayed = tmp_path / "replayed"
    csv = f"csv:{tmp_path / 'trace.csv'}"
    assert main(["simulate", str(path), *common, "--trace", csv, "--out", str(replayed)]) == 0
    assert (drawn / "timeline.json").read_text().replace('"seed": 4', '"seed": 0') == (
        replayed / "timeline.json"
    ).read_text()


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("--hours", "x", "--hours"),
        ("--hours", "0", "--hours"),
        ("--seeds", "1.5", "--seeds"),
        ("--seeds", "0", "--seeds"),
        ("--failure-rate", "-1", "--failure-rate"),
        ("--policies", "odyssey,nope", "unknown_policy"),
        ("--trace", "gamma", "--trace"),
        ("--trace", "csv:/nonexistent.csv", "--trace"),
        ("--node-failure-prob", "2", "--node-failure-prob"),
        ("--spares", "-1", "--spares"),
        ("--seed", "x", "--seed"),
        ("--burst-size", "2.5", "--burst-size"),
        ("--weibull-shape", "0", "--weibull-shape"),
        ("--repair-hours", "0", "--repair-hours"),
        ("--node-failure-rate", "-1", "--node-failure-rate"),
    ],
)
def test_bad_option_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, field: str
) -> None:
    args = ["simulate", str(scenario(tmp_path)), "--out", str(tmp_path / "o"), option, value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error [") and field in err


def test_out_that_is_a_file_exits_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    assert main(["simulate", str(scenario(tmp_path)), "--out", str(taken)]) == 2
    assert capsys.readouterr().err.startswith("error [invalid_scenario]: --out: ")


def test_bad_csv_trace_exits_2_naming_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,devices\n10,1\n20,42\n")
    args = ["simulate", str(scenario(tmp_path)), "--out", str(tmp_path / "o")]
    assert main([*args, "--trace", f"csv:{bad}"]) == 2
    assert f"{bad}:3:devices: device 42 does not exist" in capsys.readouterr().err


def test_simulator_doc_python_example_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The typed API as docs/simulator.md shows it: the example runs and writes the files."""
    doc = (ROOT / "docs" / "simulator.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    monkeypatch.chdir(tmp_path)
    exec(code.replace('"examples/', f'"{ROOT}/examples/'), {})
    share = float(capsys.readouterr().out)
    assert 0 < share <= 1
    assert {p.name for p in (tmp_path / "sim").iterdir()} == {"summary.json", "timeline.json"}


def test_experiment_errors_name_its_fields_not_flags(tmp_path: Path) -> None:
    from controlplane.recovery import simulator
    from controlplane.recovery.scenario import load_scenario

    spec = TraceSpec()
    with pytest.raises(InvalidScenario) as caught:
        simulator.Experiment(hours=0, policies=("odyssey",), trace=spec)
    assert caught.value.field == "hours"
    with pytest.raises(InvalidScenario) as caught:
        simulator.Experiment(hours=1, policies=("odyssey",), trace=spec, seeds=0)
    assert caught.value.field == "seeds"
    taken = tmp_path / "file"
    taken.write_text("")
    experiment = simulator.Experiment(hours=1, policies=("odyssey",), trace=spec)
    with pytest.raises(InvalidScenario) as caught:
        simulator.run(load_scenario(scenario(tmp_path)).state, experiment, out_dir=taken)
    assert caught.value.field == "out_dir"
