"""Time to build every Oobleck pipeline template, against the paper's divide-and-conquer DP.

An 80-layer Llama-2-70B-like model (the first layer also holds the embedding, the last the head)
on N = 8, 16, 32, 64 nodes of M GPUs (M = 1 as in Oobleck's evaluation), f = 1, no memory filter
(Oobleck's DP has none), so n0 = 1 and there is one template for each of
1 … min(N − 1, L / M) nodes. We time, in the same run:

* ``ours``: ``build_templates`` (``controlplane/recovery/policies/oobleck/templates.py``) from
  cold caches, the exact min-max partition search over the stages of each template;
* ``rank``: ``split_at`` for every template at ``--micro-batches`` per pipeline, from cold
  caches: the eq. 11 ranking Oobleck does when it instantiates a template for a pipeline's
  share (only for the sizes it uses, once per stage count and share; timed here for all);
* ``paper DP``: a plain transcription of Oobleck §4.1.2, ``T(S', u, v, d)`` over layers
  [u, v), S' stages and d GPUs, divided at every (s, k, m) (s stages and m GPUs left of layer k;
  nodes split whole, GPUs split only inside one node), combined with eq. 1-3 and the conquer case
  eq. 4, with N_b = 4S' and one memo shared by all templates, as the paper says. A sub-problem is
  ∞ when it has more stages than layers or GPUs, or fewer stages than nodes (pigeonhole); the
  ranges of s are taken from those rules rather than tried and discarded. It stops at
  ``--baseline-budget`` seconds per N: a cut run is marked ">" and gives a lower bound on the
  ratio, and the templates it finished are still checked.

Agreement. For every template size both must give the same best template time within a relative
1e-9 (asserted): the core's ``PipelineTemplate.time_s`` and the paper DP's T(n·M, 0, L, n·M).
That holds for this model but is not a theorem; two documented differences can separate them:

1. k*: the core's ``template_time`` takes the stage whose T2 + T3 is largest (the critical
   path), the paper the slowest stage; the two differ when a later stage is nearly as slow, and
   the core's value is never the smaller for the same split.
2. Substructure: the paper's DP keeps, per sub-problem, the split best for that sub-problem
   alone (its own S', N_b = 4S' and k*) and combines those, a heuristic; the core's min-max
   search is exact on its objective.

Brute force on random spiky profiles (8-14 layers, 3-7 stages) finds (1) in about 4% of cases
and (2) in under 1%; on this model's near-uniform layers neither shows at any size measured.
Also asserted: the paper DP's T is eq. 1-3 of the split it returns, and the core's time is no
more than the core's cost of that split. Where costs tie the splits may differ
(``templates_same_split``), and the paper DP's split can then have a longer critical path than its
T says (7 nodes × 1 GPU: 60.405 s against 60.255 s).

The paper's eq. 1 starts the right half at layer k + 1, which would drop layer k; Oobleck's code
(and this transcription) uses [u, k) and [k, v). M = 8 means one GPU per stage (the core's
``stages_per_node = M``, tp = 1), so the paper DP is run at S = n·M only: Oobleck also loops S
over n … L with stage times profiled on d GPUs, which the core's profile does not have.

With 80 layers and M = 8 that caps templates at L / M = 10 nodes.

For reference (other hardware and code, so only an order of magnitude): Oobleck's Table 3 times
planning one template, 8 nodes × 1 GPU at 9.65 s for 64 layers and 68.50 s for 96, 16 nodes at
66.35 / 540.36 s, 24 nodes at 262.47 / 1,477.54 s (no 80 layers, nothing above 24 nodes); the
developers' guide's bar is 58 s for 80 layers on 64 nodes.

    python benchmarks/oobleck_templates.py [--nodes 8,16,32,64] [--gpus-per-node 1]
        [--layers 80] [--micro-batches 32] [--baseline-budget SECONDS] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results import write_results
from controlplane.recovery.model import Layers, ModelProfile
from controlplane.recovery.policies.oobleck import templates as core

GB = 1e9
NODES = [8, 16, 32, 64]
LAYERS = 80
MICRO_BATCHES = 32
F = 1
REL_TOL = 1e-9
# Oobleck Table 3 (s): nodes → GPUs per node → {layers: seconds}
PAPER_TABLE3_S = {
    8: {1: {64: 9.65, 96: 68.50}, 4: {64: 11.58, 96: 74.56}, 8: {64: 20.98, 96: 109.76}},
    16: {1: {64: 66.35, 96: 540.36}, 4: {64: 108.10, 96: 649.67}, 8: {64: 176.04, 96: 1213.63}},
    24: {1: {64: 262.47, 96: 1477.54}, 4: {64: 472.53, 96: 2153.84}, 8: {64: 520.08, 96: 3297.92}},
}
GUIDE_BAR_S = {64: 58.0}  # developers' guide: 80 layers on 64 nodes


def llama2_70b(layers: int = LAYERS) -> ModelProfile:
    """Llama-2-70B-like layers, sequence 4,096, micro-batch 1, about 50% of an A100's bf16 rate.

    A decoder layer has about 856 M parameters (7.6 TFLOP forward per micro-batch, 0.05 s);
    the first layer adds the 262 M-parameter embedding (a lookup: +10% time), the last the
    262 M-parameter head and the loss (+30% time). Backward is twice forward.
    """
    fwd = [0.05] * layers
    params = [0.856e9] * layers
    fwd[0] *= 1.1
    fwd[-1] *= 1.3
    params[0] += 0.262e9
    params[-1] += 0.262e9
    return ModelProfile(
        name=f"llama-2-70b-like-{layers}",
        fwd_s=tuple(fwd),
        bwd_s=tuple(2 * x for x in fwd),
        m_p=tuple(2 * p for p in params),  # bf16
        m_o=tuple(12 * p for p in params),  # fp32 master + Adam
        m_g=tuple(2 * p for p in params),
        m_a=(34 * 4096 * 8192,) * layers,  # Korthikanti et al., no recomputation
    )


# --- the paper's DP, written plainly ------------------------------------------------------------


class OverBudget(Exception):
    """The paper DP ran past its time budget."""


class Sub(NamedTuple):
    """The best mapping found for one sub-problem T(S', u, v, d) and its eq. 1-3 terms."""

    t: float  # T1 + T2 + T3
    t1: float
    t3: float
    kstar: int  # slowest stage, 0-based within the sub-problem
    kstar_s: float  # its F + B
    choice: tuple[int, int, int] | None  # (s, k, m), None for one stage


class PaperDP:
    """Oobleck §4.1.2 ``T(S', u, v, d)`` with one memo for every template of a profile."""

    def __init__(self, profile: ModelProfile, gpus_per_node: int, deadline: float = math.inf):
        self.profile = profile
        self.m = gpus_per_node
        self.deadline = deadline
        self.memo: dict[tuple[int, int, int, int], Sub | None] = {}

    def stage_s(self, u: int, v: int) -> float:
        """Eq. 4: F + B of layers [u, v) (at the profile's own parallel degree)."""
        return self.profile.fwd(u, v) + self.profile.bwd(u, v)

    def feasible(self, stages: int, u: int, v: int, d: int) -> bool:
        nodes = -(-d // self.m)
        return 1 <= stages <= v - u and nodes <= stages <= d

    def solve(self, stages: int, u: int, v: int, d: int) -> Sub | None:
        key = (stages, u, v, d)
        if key in self.memo:
            return self.memo[key]
        if time.perf_counter() > self.deadline:
            raise OverBudget
        best: Sub | None = None
        if not self.feasible(stages, u, v, d):
            pass
        elif stages == 1:
            # eq. 4: T1 = F+B, T2 = 2(F+B), T3 = F+B; d > M GPUs would span nodes (∞)
            c = self.stage_s(u, v)
            best = Sub(t=4 * c, t1=c, t3=c, kstar=0, kstar_s=c, choice=None)
        else:
            nb = 4 * stages
            # nodes split whole; the GPUs of one node split any way
            gpu_splits = range(self.m, d, self.m) if d > self.m else range(1, d)
            for k in range(u + 1, v):
                for m in gpu_splits:
                    right_nodes = -(-(d - m) // self.m)
                    low = max(1, -(-m // self.m), stages - (d - m), stages - (v - k))
                    high = min(stages - 1, m, k - u, stages - right_nodes)
                    for s in range(low, high + 1):
                        left = self.solve(s, u, k, m)
                        right = self.solve(stages - s, k, v, d - m)
                        if left is None or right is None:
                            continue
                        # eq. 1-3: k* is the slower of the halves' slowest stages (ties: right)
                        t1 = left.t1 + right.t1
                        if left.kstar_s > right.kstar_s:
                            kstar, kstar_s, t3 = left.kstar, left.kstar_s, left.t3 + right.t1
                        else:
                            kstar, kstar_s, t3 = s + right.kstar, right.kstar_s, right.t3
                        t = t1 + (nb - stages + kstar - 1) * kstar_s + t3
                        if best is None or t < best.t:
                            best = Sub(t, t1, t3, kstar, kstar_s, (s, k, m))
        self.memo[key] = best
        return best

    def split(self, stages: int, u: int, v: int, d: int) -> Layers:
        """The layer ranges of the memoised best mapping of T(stages, u, v, d)."""
        sub = self.memo[(stages, u, v, d)]
        assert sub is not None
        if sub.choice is None:
            return ((u, v),)
        s, k, m = sub.choice
        return self.split(s, u, k, m) + self.split(stages - s, k, v, d - m)

    def template(self, nodes: int) -> tuple[Layers, float] | None:
        """The template of ``nodes`` nodes, one GPU per stage: T(n·M, 0, L, n·M)."""
        stages = nodes * self.m
        found = self.solve(stages, 0, self.profile.layers, stages)
        if found is None:
            return None
        return self.split(stages, 0, self.profile.layers, stages), found.t


def paper_time(profile: ModelProfile, layers: Layers) -> float:
    """Eq. 1-3 for one split, k* the slowest stage (the last of equals), N_b = 4S."""
    work = [profile.fwd(*r) + profile.bwd(*r) for r in layers]
    stages = len(work)
    kstar = max(range(stages), key=lambda k: (work[k], k))
    return sum(work) + (3 * stages + kstar - 1) * work[kstar] + sum(work[kstar:])


# --- measurement --------------------------------------------------------------------------------


def _cold_build(profile: ModelProfile, nodes: int, gpus_per_node: int) -> core.TemplateSet | None:
    core._tables.cache_clear()
    core.best_split.cache_clear()
    core.build_templates.cache_clear()
    core.split_at.cache_clear()
    return core.build_templates(profile, nodes, gpus_per_node, F)


def _rank_all(profile: ModelProfile, built: core.TemplateSet, micro_batches: int) -> int:
    """Rank every template's splits at ``micro_batches``; how many move off the template's."""
    core.split_at.cache_clear()
    moved = 0
    for template in built.templates:
        split = core.split_at(profile, template.stages, 1, math.inf, micro_batches)
        moved += split != template.layers
    return moved


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=0.0)


def measure(
    profile: ModelProfile,
    nodes: int,
    gpus_per_node: int = 1,
    baseline_budget_s: float = 180.0,
    repeats: int = 3,
    micro_batches: int = MICRO_BATCHES,
) -> dict[str, Any]:
    """Time both on one cluster size and check them against each other (AssertionError if not)."""
    ours_s = math.inf
    built = None
    for _ in range(repeats):
        started = time.perf_counter()
        built = _cold_build(profile, nodes, gpus_per_node)
        ours_s = min(ours_s, time.perf_counter() - started)
    assert built is not None, "no template fits (the benchmark has no memory limit)"
    started = time.perf_counter()
    moved = _rank_all(profile, built, micro_batches)
    rank_s = time.perf_counter() - started

    started = time.perf_counter()
    dp = PaperDP(profile, gpus_per_node, deadline=started + baseline_budget_s)
    found: dict[int, tuple[Layers, float] | None] = {}
    complete = True
    try:
        for template in built.templates:  # smallest first, so a cut run still checks some
            found[template.nodes] = dp.template(template.nodes)
    except OverBudget:
        complete = False
    paper_s = time.perf_counter() - started

    same_split = 0
    paper_times: list[float] = []
    for template in built.templates:
        if template.nodes not in found:
            continue
        result = found[template.nodes]
        assert result is not None, f"paper DP found no split for {template.nodes} nodes"
        split, reported = result
        paper_times.append(reported)
        assert _close(reported, paper_time(profile, split)), (template.nodes, split, reported)
        # the core is exact on its own objective (critical-path k*)
        theirs_core = core.template_time(profile, split)
        assert template.time_s <= theirs_core * (1 + REL_TOL), (template.nodes, theirs_core)
        assert _close(template.time_s, reported), (
            f"{template.nodes} nodes: core {template.time_s!r} s, paper DP {reported!r} s "
            "(see the module docstring: k* and substructure)"
        )
        same_split += template.layers == split
    return {
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "layers": profile.layers,
        "f": F,
        "templates": len(built.templates),
        "template_nodes": [built.n0, built.n_max],
        "ours_s": ours_s,
        "micro_batches": micro_batches,
        "rank_s": rank_s,
        "ranked_splits_moved": moved,
        "paper_dp_s": paper_s,
        "paper_dp_complete": complete,
        "paper_dp_templates_done": len(found),
        "paper_dp_memo_entries": len(dp.memo),
        "ratio_paper_over_ours": paper_s / ours_s,
        "templates_checked": len(found),
        "templates_same_split": same_split,
        "template_time_s": [t.time_s for t in built.templates],
        "paper_dp_template_time_s": paper_times,
        "paper_table3_s": PAPER_TABLE3_S.get(nodes, {}).get(gpus_per_node),
        "guide_bar_s": GUIDE_BAR_S.get(nodes),
    }


def _reference(row: dict[str, Any]) -> str:
    """Table 3's 64- and 96-layer figures at this size (or the largest below it), or the bar."""
    if row["guide_bar_s"]:
        return f"{row['guide_bar_s']:g} (guide, 80 L)"
    below = [n for n in PAPER_TABLE3_S if n <= row["nodes"]]
    table3 = PAPER_TABLE3_S[max(below)].get(row["gpus_per_node"]) if below else None
    if not table3:
        return "-"
    at = "" if max(below) == row["nodes"] else f"{max(below)} n: "
    return f"{at}{table3[64]:.2f}-{table3[96]:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'nodes':>5} {'M':>2} {'templates':>9} {'ours s':>8} {'rank s':>7} {'paper DP s':>11} "
        f"{'ratio':>8} {'checked':>8} {'Oobleck s (64-96 L)':>26}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cut = "" if r["paper_dp_complete"] else ">"
        paper = cut + format(r["paper_dp_s"], ".2f")
        ratio = cut + format(r["ratio_paper_over_ours"], ".0f") + "x"
        checked = f"{r['templates_checked']}/{r['templates']}"
        lines.append(
            f"{r['nodes']:>5} {r['gpus_per_node']:>2} {r['templates']:>9} {r['ours_s']:>8.4f} "
            f"{r['rank_s']:>7.2f} {paper:>11} {ratio:>8} {checked:>8} {_reference(r):>26}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", default=",".join(map(str, NODES)))
    parser.add_argument("--gpus-per-node", type=int, default=1, metavar="M")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--micro-batches", type=int, default=MICRO_BATCHES, metavar="M")
    parser.add_argument("--baseline-budget", type=float, default=180.0, metavar="SECONDS")
    parser.add_argument("--out", default="benchmarks/results", metavar="DIR")
    args = parser.parse_args()
    profile = llama2_70b(args.layers)
    measure(llama2_70b(12), 4, args.gpus_per_node, repeats=1)  # warm up imports and numpy
    rows = []
    for nodes in (int(s) for s in args.nodes.split(",")):
        rows.append(
            measure(profile, nodes, args.gpus_per_node, args.baseline_budget, 3, args.micro_batches)
        )
        print(table(rows).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    write_results(
        Path(args.out) / "oobleck_templates.json",
        {"model": profile.name, "baseline_budget_s": args.baseline_budget, "rows": rows},
    )


if __name__ == "__main__":
    main()
