"""Search: SP-MCTS finds optima of synthetic cost functions within a budget; exhaustive
search sees every valid config once; both are deterministic under a seed.

Synthetic functions (the optimum is known by enumeration):
- `interacting`: 5 knobs, 4200 configs under a validity predicate (b <= a), the cost
  depends on a*b jointly and on a pair of other knobs together;
- `bowl`: a separable multiplicative bowl over 4 knobs of 5 values (625 configs), the
  shape where a search must get every knob right at once;
- a timing model over the real map-reduce knob space of an RMSNorm kernel (about 460 configs).
"""
from __future__ import annotations

import math
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import loop_fixtures as fx  # noqa: E402

from tilefuse.tune import mapreduce as mrs  # noqa: E402
from tilefuse.tune.search import SPMCTS, Exhaustive, make_searcher  # noqa: E402
from tilefuse.tune.space import Dim, Space  # noqa: E402

INTERACTING = Space("interacting", (
    Dim("a", (64, 128, 256, 512, 1024)), Dim("b", (1, 2, 4, 8, 16, 32, 64)), Dim("c", (1, 2, 3, 4, 5, 6, 7, 8)),
    Dim("d", ("x", "y", "z")), Dim("e", (0, 1, 2, 3, 4))), valid=lambda k: k["b"] <= k["a"], default=(256, 1, 1, "y", 0))


def interacting(cfg) -> float:
    a, b, c, d, e = cfg
    return (1 + abs(math.log2(a * b) - 9) + 0.3 * abs(c - 3) + (0 if d == "x" else 0.5) + 0.1 * (e - 2) ** 2
            + (0.7 if a >= 512 and c > 4 else 0))


BOWL = Space("bowl", tuple(Dim(f"k{i}", tuple(range(5))) for i in range(4)), default=(0, 0, 0, 0))


def bowl(cfg) -> float:
    return 10 * math.prod(1 + 0.1 * (v - t) ** 2 for v, t in zip(cfg, (3, 1, 4, 2)))


def timing_model(C: int):
    """A plausible map-reduce time: stage, chunk width, occupancy, chunks per thread, cluster."""
    def cost(k) -> float:
        per = (C // k["vector"]) / (k["group"] * k["cluster"])
        occ = min(2048, k["threads"] * max(k["min_blocks"], 1024 // k["threads"]))
        t = 100.0 * {"smem": 1.0, "regs": 1.04, "stream": 1.2}[k["stage"]]
        t *= (1.0 if k["vector"] == 8 else 1.12) * (1 + 0.25 * (1 - occ / 2048))
        t *= (1 + 0.05 * (math.log2(max(per, 0.5)) - 2) ** 2) * (1 + 0.03 * math.log2(k["cluster"]))
        return t * (1 + 0.01 * math.log2(k["threads"] / 64))
    return cost


def run(searcher, cost, as_dict=False):
    while (cfg := searcher.ask()) is not None:
        searcher.tell(cfg, cost(searcher.space.as_dict(cfg) if as_dict else cfg))
    return searcher


def first_hit(searcher, best) -> int | None:
    return next((i + 1 for i, t in enumerate(searcher.history) if t.cost == best), None)


def test_mcts_finds_the_optimum_of_an_interacting_function_within_100_of_4200():
    best = min(interacting(c) for c in INTERACTING.configs())
    hits = [first_hit(run(SPMCTS(INTERACTING, 100, seed=s, patience=None), interacting), best) for s in range(10)]
    assert all(h is not None for h in hits), hits


def test_mcts_finds_a_bowls_optimum_far_sooner_than_random_search():
    """Every knob must be right at once; random search needs 313 of 625 on average."""
    hits = [first_hit(run(SPMCTS(BOWL, 160, seed=s, patience=None), bowl), 10.0) for s in range(10)]
    assert sum(h is not None for h in hits) >= 8, hits
    assert statistics.median(h or 161 for h in hits) <= 100, hits


def test_mcts_gets_within_3_percent_of_the_best_mapreduce_schedule_with_64_measurements():
    kernel = fx.rmsnorm_kernel(256, 4096, "bf16")
    cost = timing_model(4096)
    space = mrs.space(kernel, "sm_90a")
    best = min(cost(space.as_dict(c)) for c in space.configs())
    for seed in range(3):
        s = run(SPMCTS(mrs.space(kernel, "sm_90a"), 64, seed=seed, patience=None), cost, as_dict=True)
        assert len(s.history) == 64 and s.best_cost <= 1.03 * best, (seed, s.best_cost, best)


def test_mcts_is_deterministic_under_a_seed():
    a = run(SPMCTS(INTERACTING, 40, seed=7, patience=None), interacting)
    b = run(SPMCTS(INTERACTING, 40, seed=7, patience=None), interacting)
    c = run(SPMCTS(INTERACTING, 40, seed=8, patience=None), interacting)
    assert a.asked == b.asked and a.best == b.best
    assert a.asked != c.asked


def test_mcts_proposes_the_default_first_then_only_new_valid_configs_within_budget():
    s = run(SPMCTS(INTERACTING, 300, seed=1, patience=None), interacting)
    assert s.asked[0] == INTERACTING.default
    assert len(s.asked) == 300 == len(set(s.asked))
    assert all(INTERACTING.is_valid(c) for c in s.asked)


def test_mcts_on_a_space_smaller_than_its_budget_ends_having_seen_it_all():
    small = Space("small", (Dim("a", (1, 2, 3)), Dim("b", (1, 2, 3, 4))), valid=lambda k: (k["a"] + k["b"]) % 3 != 0)
    s = run(SPMCTS(small, 100, seed=0, patience=None), lambda c: c[0] * 10 + c[1])
    assert sorted(s.asked) == sorted(small.configs()) and s.finished and s.ask() is None
    assert s.best == (1, 1)


def test_concurrent_asks_before_any_tell_are_distinct():
    s = SPMCTS(INTERACTING, 64, seed=3, patience=None)
    batch = [s.ask() for _ in range(8)]
    assert len(set(batch)) == 8
    for c in batch:
        s.tell(c, interacting(c))
    assert s.best_cost == min(interacting(c) for c in batch)


def test_failures_are_never_the_best_and_the_search_goes_on():
    def flaky(cfg):
        return None if cfg[0] >= 512 else interacting(cfg)

    s = SPMCTS(INTERACTING, 60, seed=2, patience=None)
    while (cfg := s.ask()) is not None:
        s.tell(cfg, flaky(cfg))
    assert len(s.history) == 60 and s.best[0] < 512
    assert any(t.cost is None for t in s.history)


def test_patience_stops_a_search_that_stopped_improving():
    s = run(SPMCTS(INTERACTING, 500, seed=0, patience=10), lambda c: 1.0)
    assert len(s.history) == 11 and s.finished  # the first result, then 10 without a gain


@pytest.mark.parametrize("seed", range(4))
def test_polish_ends_on_a_config_no_single_knob_change_improves(seed):
    """With polish, once the tree search stops (a short patience here) every valid config one
    knob away from the final best has been measured, so the pick is a local optimum along
    each knob, and the extra candidates stay within the allowance, each one new."""
    s = run(SPMCTS(INTERACTING, 200, seed=seed, patience=6, polish=60), interacting)
    assert s.finished and s.ask() is None and 0 < s.polished <= 60
    assert len(s.asked) == len(set(s.asked))
    if s.polished < 60:
        for i, dim in enumerate(INTERACTING.dims):
            for v in dim.values:
                c = s.best[:i] + (v,) + s.best[i + 1:]
                if INTERACTING.is_valid(c):
                    assert c in s.asked and interacting(c) >= s.best_cost


def test_polish_recovers_a_last_knob_the_tree_search_left_wrong():
    """The tree ranks the last knob least: with the other knobs right and only the last one
    off, a search stopped by patience still ends on the optimum once it polishes."""
    space = Space("late", (Dim("a", (1, 2, 3)), Dim("z", (0, 1, 2, 3, 4, 5, 6, 7))), default=(2, 0))

    def cost(c):
        return (1 + abs(c[0] - 2)) * (1 + (0.1 if c[1] != 6 else 0.0))

    plain = run(SPMCTS(space, 100, seed=0, patience=1), cost)
    polished = run(SPMCTS(space, 100, seed=0, patience=1, polish=10), cost)
    assert polished.best == (2, 6)
    assert len(polished.asked) <= len(plain.asked) + 10


def test_exhaustive_sees_every_valid_config_once_default_first():
    s = run(Exhaustive(INTERACTING), interacting)
    configs = list(INTERACTING.configs())
    assert s.asked[0] == INTERACTING.default
    assert sorted(s.asked, key=repr) == sorted(configs, key=repr) and len(s.asked) == len(configs)
    assert s.best_cost == min(interacting(c) for c in configs)


def test_make_searcher_is_exhaustive_at_or_under_the_threshold():
    assert isinstance(make_searcher(BOWL, threshold=625), Exhaustive)
    assert isinstance(make_searcher(BOWL, threshold=624), SPMCTS)
    assert isinstance(make_searcher(BOWL, threshold=10, exhaustive=True), Exhaustive)


def test_make_searcher_measures_a_space_of_few_valid_configs_whole():
    """A space admitting many configs of which few are valid (its `exhaustive_upto` counts
    the valid ones) is searched exhaustively; one more valid config than that and SP-MCTS
    searches it. The exhaustive searcher gets every valid config once, the default first."""
    few = replace(BOWL, valid=lambda k: k["k0"] < 2)  # 2 x 125 = 250 valid of 625
    assert sum(1 for _ in few.configs()) == 250
    whole = make_searcher(replace(few, exhaustive_upto=250), threshold=48)
    assert isinstance(whole, Exhaustive)
    assert whole.configs[0] == few.default and sorted(whole.configs) == sorted(few.configs())
    assert isinstance(make_searcher(replace(few, exhaustive_upto=249), threshold=48), SPMCTS)
    assert isinstance(make_searcher(few, threshold=48), SPMCTS)  # 0: only the admitted count decides


@pytest.mark.parametrize("bad, match", [
    (lambda: Space("s", (Dim("a", (1,)), Dim("a", (2,)))), "named twice"),
    (lambda: Dim("a", (1, 1)), "twice"),
    (lambda: Dim("a", ()), "no candidate"),
    (lambda: Space("s", (Dim("a", (1, 2)),), default=(3,)), "not a candidate"),
])
def test_malformed_spaces_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_random_search_baseline_for_the_bowl_is_what_the_docstring_says():
    order = random.Random(0)
    firsts = []
    configs = list(BOWL.configs())
    for _ in range(200):
        shuffled = order.sample(configs, len(configs))
        firsts.append(next(i + 1 for i, c in enumerate(shuffled) if bowl(c) == 10.0))
    assert 250 < statistics.mean(firsts) < 380
