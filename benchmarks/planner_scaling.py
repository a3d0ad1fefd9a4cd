"""Planner decision time from 32 to 16,384 devices, against straightforward Algorithm 1.

For each cluster size, one device of a PP × DP Llama-2-7B job fails and we time:

* ``decision``: Odyssey's whole decision (rerouting candidate, fast branch-and-bound re-plan,
  Kuhn-Munkres placement, estimates, eq. 8), the figure to compare with Chameleon's 19.25 s at
  1,024 and 40.48 s at 2,048 cards (seed 001 §V-F);
* ``search``: the fast planner alone;
* ``proved``: whether the decision and the search finished without a budget cutting them short
  (a decision that did not carries the ``search_incomplete`` caveat);
* ``baseline``: Algorithm 1 as the paper writes it, in the same run: every partition of the
  survivors into DP ± 1 pipelines whose lengths lie within one of the mean, the paper's batch
  rule, and every remainder placement of every pipeline timed with eq. 11, nothing memoised or
  pruned. It stops at ``--baseline-budget`` seconds; a cut run gives a lower bound on the ratio.

    python -m benchmarks.planner_scaling [--sizes 32,64,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from benchmarks.results import write_results
from controlplane.recovery.model import (
    Assumptions,
    Cluster,
    ClusterState,
    ExecutionPlan,
    Failure,
    FailureKind,
    ModelProfile,
    Pipeline,
    Stage,
    Training,
)
from controlplane.recovery.planner import dp_window, forget, search, usable_groups
from controlplane.recovery.policies.odyssey import choose_family

GB = 1e9
PAPER_DECISION_S = {1024: 19.25, 2048: 40.48}
SIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PIPELINE_DEPTH = 8
MICRO_BATCHES_PER_PIPELINE = 8


def llama2_7b() -> ModelProfile:
    """32 layers at about 45% of a 910B's bf16 rate, sequence 4,096, micro-batch 1."""
    return ModelProfile.uniform(
        name="llama-2-7b",
        layers=32,
        fwd_s=0.0137,
        bwd_s=0.0274,
        m_p=0.4 * GB,
        m_o=2.4 * GB,
        m_g=0.4 * GB,
        m_a=0.5 * GB,
    )


def failed_state(devices: int) -> ClusterState:
    profile = llama2_7b()
    dp = devices // PIPELINE_DEPTH
    per_stage = profile.layers // PIPELINE_DEPTH
    pipelines = tuple(
        Pipeline(
            stages=tuple(
                Stage(
                    devices=(p * PIPELINE_DEPTH + s,), layers=(s * per_stage, (s + 1) * per_stage)
                )
                for s in range(PIPELINE_DEPTH)
            ),
            micro_batches=MICRO_BATCHES_PER_PIPELINE,
        )
        for p in range(dp)
    )
    return ClusterState(
        profile=profile,
        cluster=Cluster(
            devices=devices,
            devices_per_node=8,
            device_memory_bytes=64 * GB,
            intra_node_gbps=400,
            inter_node_gbps=200,
            failure_rate_per_device_hour=0.1,
        ),
        training=Training(global_batch=dp * MICRO_BATCHES_PER_PIPELINE),
        plan=ExecutionPlan(pipelines=pipelines),
        failed=frozenset({5}),
        assumptions=Assumptions(),
    )


def measure(devices: int, baseline_budget_s: float) -> dict[str, Any]:
    state = failed_state(devices)
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    forget()  # a cold decision, as a worker's first at this size
    started = time.perf_counter()
    decision = choose_family("odyssey", state)
    decision_s = time.perf_counter() - started

    groups = len(usable_groups(state))
    common = {
        "groups": groups,
        "tp": 1,
        "dp_options": dp_window(state.plan.dp, groups),
    }
    forget()  # the decision above asked this very search: time it cold
    started = time.perf_counter()
    fast = search(state.profile, state.cluster, state.training, top_k=1, **common)  # type: ignore[arg-type]
    search_s = time.perf_counter() - started

    started = time.perf_counter()
    baseline = search(
        state.profile,
        state.cluster,
        state.training,
        top_k=1,
        exhaustive=True,
        memo=False,
        spread=1,
        node_budget=None,
        time_budget_s=baseline_budget_s,
        **common,  # type: ignore[arg-type]
    )
    baseline_s = time.perf_counter() - started
    del failure
    best = fast.shapes[0].compute_time_s
    reference = baseline.shapes[0].compute_time_s if baseline.shapes else float("nan")
    return {
        "devices": devices,
        "decision_s": decision_s,
        "decision_family": decision.plan.family.value if decision.plan else None,
        # the decision's caveats: search_incomplete when a budget kept it from a proof
        "decision_caveats": [str(c) for c in decision.caveats],
        "search_s": search_s,
        "search_complete": fast.complete,
        "search_nodes": fast.nodes,
        "baseline_s": baseline_s,
        "baseline_complete": baseline.complete,
        "ratio_baseline_over_search": baseline_s / search_s,
        "fast_step_s": best,
        "baseline_step_s": reference,
        "paper_decision_s": PAPER_DECISION_S.get(devices),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'devices':>8} {'decision s':>11} {'proved':>6} {'search s':>9} {'proved':>6} "
        f"{'baseline s':>11} {'ratio':>9} {'paper s':>8} {'step s (fast/base)':>19}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cut = "" if r["baseline_complete"] else ">"
        paper = f"{r['paper_decision_s']:.2f}" if r["paper_decision_s"] else "-"
        proved = "yes" if r["search_complete"] else "no"
        decided = "no" if r["decision_caveats"] else "yes"
        baseline = cut + format(r["baseline_s"], ".2f")
        ratio = cut + format(r["ratio_baseline_over_search"], ".0f") + "x"
        lines.append(
            f"{r['devices']:>8} {r['decision_s']:>11.3f} {decided:>6} {r['search_s']:>9.3f} "
            f"{proved:>6} {baseline:>11} {ratio:>9} {paper:>8} "
            f"{r['fast_step_s']:>9.4f}/{r['baseline_step_s']:.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--baseline-budget", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR")
    args = parser.parse_args()
    choose_family("odyssey", failed_state(32))  # warm up: imports and caches outside the timing
    rows = []
    for devices in (int(s) for s in args.sizes.split(",")):
        rows.append(measure(devices, args.baseline_budget))
        print(table(rows).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    unproved = sum(1 for r in rows if r["decision_caveats"] or not r["search_complete"])
    print(f"{unproved} of {len(rows)} sizes not proven optimal (a search budget ended them)")
    write_results(Path(args.out) / "planner_scaling.json", {"rows": rows})


if __name__ == "__main__":
    main()
