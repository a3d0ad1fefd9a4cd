"""Smoke test of benchmarks/oobleck_templates.py on a tiny model: both planners run and agree."""

from __future__ import annotations

import math

from benchmarks.oobleck_templates import PaperDP, llama2_70b, measure, paper_time
from controlplane.recovery.policies.oobleck.templates import build_templates


def test_core_and_paper_dp_agree_on_12_layers_and_4_nodes() -> None:
    row = measure(llama2_70b(12), 4, baseline_budget_s=10.0, repeats=1)
    assert row["paper_dp_complete"]
    assert row["templates"] == row["templates_checked"] == 3  # 1 … N − f·n0 nodes
    assert 0 <= row["ranked_splits_moved"] <= row["templates"] and row["rank_s"] > 0
    assert all(
        math.isclose(a, b, rel_tol=1e-9)
        for a, b in zip(row["template_time_s"], row["paper_dp_template_time_s"], strict=True)
    )


def test_one_gpu_per_stage_with_eight_gpus_per_node() -> None:
    row = measure(llama2_70b(12), 2, gpus_per_node=8, baseline_budget_s=10.0, repeats=1)
    assert row["paper_dp_complete"] and row["templates_checked"] == row["templates"] == 1


def test_paper_dp_reports_eq_1_to_3_of_its_split() -> None:
    # the heavier first and last layers still leave the even split best on 3 stages
    profile = llama2_70b(12)
    found = PaperDP(profile, 1).template(3)
    assert found is not None
    split, t = found
    assert [b - a for a, b in split] == [4, 4, 4]
    assert math.isclose(t, paper_time(profile, split), rel_tol=1e-12)
    built = build_templates(profile, 4, 1, 1)
    assert built is not None and math.isclose(built.templates[-1].time_s, t, rel_tol=1e-9)
