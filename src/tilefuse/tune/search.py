"""Search over a knob space: single-player MCTS, or every config when the space is small.

Both searchers speak ask/tell, so one driver feeds any number of benchmark workers:
`ask()` proposes a config nobody has proposed before (None: nothing to propose now),
`tell(config, cost)` reports its cost (lower is better; None: it failed), `finished` says
when to stop (budget spent, patience run out, or the space exhausted).

SP-MCTS (single-player MCTS, after Schadd et al. 2008): the tree branches on one knob per level, in the space's order. Each iteration selects a
path by UCB, expands one untried value, completes the config at random (a rollout over
admitted, valid, not yet proposed configs), and backs up the result along the path. Since
only the best config matters, a node's value is the *maximum* reward below it, not the
mean; rewards are -log(cost), normalised to [0, 1] by the range seen so far, so the
exploration constant does not depend on the kernel's time scale. A search stops after
`patience` results in a row that do not beat the best by `min_improvement`; then, with
`polish` > 0, it measures every untried valid neighbour of the best config that differs in
one knob, again around each new best, up to `polish` more candidates. The tree ranks the
last knobs least, so a search can end one knob away from a better config: on an H100 the
8192x11008x4096 GEMM's pick differed from the whole space's best only in group_m (8 vs 16),
9.6% slower (bench/results/tune_eval_gemm_full_h100_f.json).

Budgets are small (tens of candidates, not the thousands of playouts a game gets), so two
choices make the most of each one: a rollout is, with probability `greedy`, the best
config so far with each remaining knob changed with probability 1/(knobs left) (a local
move in the node's subtree) rather than a uniform draw; and the exploration constant
shrinks by `depth_decay` per level, so the first knobs (few values, most influence) are
revisited with the newest best config while deep knobs are exploited. Both were chosen
on synthetic spaces (tests/cpu/test_tune_search.py) and map-reduce spaces with a timing
model.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

from .space import Space


@dataclass
class Trial:
    config: tuple
    cost: float | None  # None: failed


class _Base:
    """Budget, patience, history and the best config so far."""

    def __init__(self, space: Space, budget: int | None, patience: int | None, min_improvement: float):
        self.space = space
        self.budget = budget
        self.patience = patience
        self.min_improvement = min_improvement
        self.asked: list[tuple] = []
        self.history: list[Trial] = []
        self.best: tuple | None = None
        self.best_cost: float | None = None
        self._stale = 0  # results since the last improvement
        self._exhausted = False

    @property
    def finished(self) -> bool:
        if self.budget is not None and len(self.asked) >= self.budget:
            return True
        if self.patience is not None and self._stale >= self.patience:
            return True
        return self._exhausted

    def ask(self) -> tuple | None:
        if self.finished:
            return None
        config = self._propose()
        if config is None:
            self._exhausted = True
            return None
        self.asked.append(config)
        return config

    def tell(self, config: tuple, cost: float | None) -> None:
        self.history.append(Trial(config, cost))
        if cost is not None and (self.best_cost is None or cost < self.best_cost * (1 - self.min_improvement)):
            self._stale = 0
        else:
            self._stale += 1
        if cost is not None and (self.best_cost is None or cost < self.best_cost):
            self.best, self.best_cost = config, cost
        self._observe(config, cost)

    def _propose(self) -> tuple | None:
        raise NotImplementedError

    def _observe(self, config: tuple, cost: float | None) -> None:
        pass


class Exhaustive(_Base):
    """Every valid config, the default first, then in dimension order."""

    def __init__(self, space: Space, budget: int | None = None, configs: list | None = None):
        """`configs`: the space's valid configs when the caller has enumerated them already."""
        super().__init__(space, budget, None, 0.0)
        first = [space.default] if space.default is not None and space.is_valid(space.default) else []
        self.configs = first + [c for c in (space.configs() if configs is None else configs) if c != space.default]
        self._it = iter(self.configs)

    def _propose(self):
        return next(self._it, None)


@dataclass(eq=False)
class _Node:
    prefix: tuple
    parent: "_Node | None"
    untried: list
    children: dict = field(default_factory=dict)
    visits: int = 0
    best: float | None = None  # max reward below
    done: bool = False          # every config below proposed or invalid


class SPMCTS(_Base):
    """Single-player MCTS with max-reward backup, normalised UCB and a patience stop."""

    def __init__(self, space: Space, budget: int = 64, *, seed: int = 0, patience: int | None = 16,
                 min_improvement: float = 0.005, exploration: float = 0.6, greedy: float = 0.8,
                 depth_decay: float = 0.6, polish: int = 0):
        super().__init__(space, budget, patience, min_improvement)
        self.polish = polish
        self.polished = 0            # candidates asked after the tree search ended
        self._around = None          # the best config the polish queue was built around
        self._queue: list = []
        self._tree_over = False      # latched: a gain while polishing does not reopen the tree search
        self.rng = random.Random(seed)
        self.c = exploration
        self.greedy = greedy
        self.decay = depth_decay
        self._seen: set = set()      # proposed configs
        self._valid: dict = {}       # config -> validity (memo: `valid` may render a kernel)
        self._paths: dict = {}       # config -> tree nodes it was credited to
        self._rmin = self._rmax = None
        self.root = self._node((), None)
        self._initial = [space.default] if space.default is not None else []

    # ---------------------------------------------------------------- tree
    def _node(self, prefix: tuple, parent) -> _Node:
        untried = self.space.children(prefix) if len(prefix) < len(self.space.dims) else []
        self.rng.shuffle(untried)
        return _Node(prefix, parent, untried)

    def _child(self, node: _Node, value) -> _Node:
        if value not in node.children:
            node.untried.remove(value)
            node.children[value] = self._node(node.prefix + (value,), node)
        return node.children[value]

    def _mark_done(self, node: _Node):
        node.done = True
        p = node.parent
        while p is not None and not p.untried and all(c.done for c in p.children.values()):
            p.done = True
            p = p.parent

    def _ucb(self, parent: _Node, node: _Node) -> float:
        if node.best is None:
            q = 0.0
        elif self._rmax is None or self._rmax <= self._rmin:
            q = 1.0
        else:
            q = (node.best - self._rmin) / (self._rmax - self._rmin)
        c = self.c * self.decay ** len(parent.prefix)
        return q + c * math.sqrt(math.log(max(parent.visits, 1)) / max(node.visits, 1))

    def _is_valid(self, config: tuple) -> bool:
        if config not in self._valid:
            self._valid[config] = self.space.is_valid(config)
        return self._valid[config]

    def _rollout(self, prefix: tuple, guide: tuple | None, mutate: float = 0.0) -> tuple | None:
        """A valid, never proposed completion of `prefix`, depth first, values in random
        order; when guided, each knob first tries the guide's value unless it mutates
        (probability `mutate`), so the completion is the best config so far, changed a little."""
        if len(prefix) == len(self.space.dims):
            return prefix if prefix not in self._seen and self._is_valid(prefix) else None
        values = self.space.children(prefix)
        self.rng.shuffle(values)
        g = guide[len(prefix)] if guide is not None else None
        if g in values and self.rng.random() >= mutate:
            values.remove(g)
            values.insert(0, g)
        for v in values:
            found = self._rollout(prefix + (v,), guide, mutate)
            if found is not None:
                return found
        return None

    # ---------------------------------------------------------------- polish
    @property
    def finished(self) -> bool:
        return self._tree_finished() and not self._polish_left()

    def _tree_finished(self) -> bool:
        self._tree_over = self._tree_over or _Base.finished.fget(self)
        return self._tree_over

    def ask(self):
        if not self._tree_finished():
            return super().ask()
        if not self._polish_left():
            return None
        config = self._queue.pop(0)
        self._seen.add(config)
        self.polished += 1
        self.asked.append(config)
        return config

    def _polish_left(self) -> bool:
        """Whether a one-knob neighbour of the best config is left to ask (the queue is rebuilt
        whenever the best moves), within the polish allowance."""
        if self.best is None or self.polished >= self.polish:
            return False
        if self.best != self._around:
            self._around = self.best
            self._queue = self._neighbours(self.best)
        else:  # asked meanwhile by the tree search's last proposals
            self._queue = [c for c in self._queue if c not in self._seen]
        return bool(self._queue)

    def _neighbours(self, config: tuple) -> list:
        out = []
        for i, dim in enumerate(self.space.dims):
            for v in dim.values:
                c = config[:i] + (v,) + config[i + 1:]
                if v != config[i] and c not in self._seen and self._is_valid(c):
                    out.append(c)
        return out

    # ---------------------------------------------------------------- ask / tell
    def _propose(self):
        while self._initial:
            config = self._initial.pop(0)
            if config in self._seen or not self._is_valid(config):
                continue
            node, path = self.root, [self.root]
            for v in config:
                node = self._child(node, v)
                path.append(node)
            return self._claim(config, path)
        while not self.root.done:
            node, path = self.root, [self.root]
            while True:
                if len(node.prefix) == len(self.space.dims):
                    break
                if node.untried:
                    node = self._child(node, self.rng.choice(node.untried))
                    path.append(node)
                    break
                live = [c for c in node.children.values() if not c.done]
                if not live:
                    self._mark_done(node)
                    break
                node = max(live, key=lambda c: self._ucb(path[-1], c))
                path.append(node)
            if node.done:
                continue
            guide = self.best if self.best is not None and self.rng.random() < self.greedy else None
            rest = len(self.space.dims) - len(node.prefix)
            config = self._rollout(node.prefix, guide, 1.0 / max(rest, 1))
            if config is None:
                self._mark_done(node)
                continue
            return self._claim(config, path)
        return None

    def _claim(self, config: tuple, path: list) -> tuple:
        self._seen.add(config)
        self._paths[config] = path
        for n in path:
            n.visits += 1  # counted now, so concurrent asks spread out before results arrive
        if len(path[-1].prefix) == len(self.space.dims):
            self._mark_done(path[-1])
        return config

    def _observe(self, config, cost):
        if cost is None or cost <= 0:
            return
        r = -math.log(cost)
        self._rmin = r if self._rmin is None else min(self._rmin, r)
        self._rmax = r if self._rmax is None else max(self._rmax, r)
        for n in self._paths.get(config, ()):
            n.best = r if n.best is None else max(n.best, r)


def make_searcher(space: Space, budget: int = 64, *, exhaustive: bool = False, threshold: int = 48,
                  seed: int = 0, patience: int | None = 16, min_improvement: float = 0.005, polish: int = 0):
    """Exhaustive when asked, when at most `threshold` configs pass `admits`, or when the
    space holds at most `space.exhaustive_upto` valid configs; else SP-MCTS."""
    if exhaustive or sum(1 for _ in itertools.islice(space.admitted(), threshold + 1)) <= threshold:
        return Exhaustive(space)
    if space.exhaustive_upto:
        few = list(itertools.islice(space.configs(), space.exhaustive_upto + 1))
        if len(few) <= space.exhaustive_upto:
            return Exhaustive(space, configs=few)  # enumerated once: `valid` renders
    return SPMCTS(space, budget, seed=seed, patience=patience, min_improvement=min_improvement, polish=polish)
