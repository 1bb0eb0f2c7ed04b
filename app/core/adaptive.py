"""Cost-aware draft length: choose k per step to maximise expected committed tokens per second.

Knows: the cost model of ALGORITHMS.md 9.1 (E(k) = 1 + sum_j prod_{i<=j} a_i committed tokens
for T(k) = k * t_draft + T_verify(rows(k)) + overhead seconds), running estimates of the
per-position conditional acceptance a_j, the measured verify cost curve, the draft cost per
token and the rows a draft of depth k verifies: k + 1 for a chain, its nodes + 1 for a tree
(an EAGLE-2 tree of depth 4 and 16 nodes: 17), learned from the steps observed. For a tree,
"position j" is depth j: a_j is how often its accepted path went one level deeper, and
t_draft its cost per level. Must not know: models, backends, the engine's loop (it is fed
observations).

k = 0 means plain decoding for that step. While speculation does not pay it stays off, but
after `explore_every` steps one step drafts again so a change in the text (a quoted block of
code, say) is noticed; each exploration that leaves it off doubles the wait (up to
`max_explore_gap`), since with a 0.5B drafter every exploration cost a few percent of a
prompt's time; an exploration that commits tokens faster than a plain step brings the wait
back to `explore_every`, and a new generation caps it at `new_text_gap`. Evidence ages only as
drafts are observed, so a long stretch off keeps what was measured instead of drifting back
to the prior. Likewise every `explore_every` steps a speculating controller drafts one token
more than it would: positions past the chosen k are never examined otherwise, and their prior
alone kept k=1 on a pair whose k=3 ran 1.4x faster (measured, int8 Qwen pair). And after
`plain_every` steps on, a speculating controller takes one plain step to re-time it: the
one-row cost is otherwise known only from the probe, and a probe slowed by another process
(3x, in a bench) kept a head at 18% acceptance drafting for a whole run, 0.85x plain. The wait
doubles (up to `max_explore_gap`) while the re-timing agrees with the estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from app.core.types import Draft


@dataclass(frozen=True)
class Load:
    """What the other live streams put in the step's forward (batched streams): their count
    and their rows. A stream alone is Load()."""

    streams: int = 0
    rows: int = 0


@dataclass
class KController:
    """Running cost and acceptance estimates, and the k they recommend."""

    k_max: int = 8
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0  # pseudo-steps of belief in the prior
    decay: float = 0.95  # per-step decay of old evidence (about 20 steps of memory)
    explore_every: int = 16
    max_explore_gap: int = 256
    new_text_gap: int = 64  # a new generation waits at most this long to explore
    # share of the acceptance evidence a new generation keeps: acceptance belongs to the text,
    # and a server's next request may be another kind of text (the default pair's chain ran a
    # chat reply after code replies at 0.77x plain, drafting on the code's 76% acceptance
    # until its own 45% had outweighed it)
    new_text_keep: float = 0.5
    plain_every: int = 32  # steps on before a plain step re-times the one-row cost
    retime_tolerance: float = 0.2  # a re-timing within this of the estimate agrees with it
    # drafting must promise this much more than plain to be chosen: near break-even the
    # estimates' error decides the sign, and a loss is what the user sees (the default pair's
    # chain on chat prompts: about 50% acceptance at 0.35 of a target step per draft token,
    # break-even by this model)
    pay_margin: float = 0.05
    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds (EMA)
    # seconds per drafted token (EMA) for each drafter that proposed (a chain's members each
    # have their own): a free lookup must not make model drafting look free
    draft_costs: dict[str, float] = field(default_factory=dict)
    overhead_s: float = 0.0  # per-step time outside draft and verify (EMA)
    # depth -> verify rows beyond a chain's depth + 1 (EMA): a tree drafter's steps priced
    # at k + 1 rows looked cheap and kept EAGLE-2 trees on at 0.6-0.7x plain (measured)
    extra_rows: dict[int, float] = field(default_factory=dict)
    # context rows read before drafting (a draft model's prompt, or what it missed while off)
    # and their seconds: read_pays prices a prompt read with them
    read_rows: int = 0
    read_s: float = 0.0
    # the other streams' share of the next step (batched streams): k is priced by what it
    # adds to a forward they already fill, and by the tokens they commit meanwhile
    load: Load = field(default_factory=Load)
    off_by_load: bool = False  # the last choice was 0 where alone it would have drafted
    _reached: list[float] = field(default_factory=list)
    _accepted: list[float] = field(default_factory=list)
    _steps_off: int = 0
    _off_gap: int = 0  # steps off before the next exploration; 0 = explore_every
    _steps_on: int = 0
    _idle: int = 0  # plain steps since the last step that drafted
    _exploring: bool = False  # the step being chosen is an exploration
    _since_plain: int = 0  # steps on since the last plain step
    _plain_gap: int = 0  # steps on before the next re-timing; 0 = plain_every
    _retiming: bool = False  # the step being chosen is a plain step that re-times

    def __post_init__(self) -> None:
        self._reached = [0.0] * self.k_max
        self._accepted = [0.0] * self.k_max

    def seed_costs(self, verify_s: Mapping[int, float]) -> None:
        """Start from a probed verify cost curve (rows -> seconds)."""
        self.verify_s.update({int(n): float(s) for n, s in verify_s.items()})

    def new_text(self) -> None:
        """A new generation begins: while off, the wait for the next exploration is capped at
        `new_text_gap` steps, so a new kind of text is noticed within a few dozen steps rather
        than after the longest gap an earlier text earned (256 steps: two or three answers).
        Not reset to `explore_every`: reset so, an EAGLE-2 tree explored about 3.5 times per
        96-token answer and ran 0.96x plain (HumanEval 20; 0.99x in an earlier run that kept
        the gap across answers)."""
        gap = self._off_gap or self.explore_every
        self._off_gap = min(gap, self.new_text_gap)
        self._age(self.new_text_keep)

    def acceptance(self) -> list[float]:
        """a_j: probability that draft j survives given drafts 1..j-1 did."""
        w, prior = self.prior_weight, self.prior_acceptance
        return [(a + w * prior) / (r + w) for a, r in zip(self._accepted, self._reached)]

    def expected_tokens(self, k: int, acceptance: list[float] | None = None) -> float:
        """Tokens a step of depth k commits, by the estimates (or the acceptance given)."""
        total, survive = 1.0, 1.0
        for a in (self.acceptance() if acceptance is None else acceptance)[:k]:
            survive *= a
            total += survive
        return total

    @property
    def draft_token_s(self) -> float | None:
        """The dearest member's cost per draft token (None: no draft seen yet).

        k is chosen before a chain knows which member will draft, so it is priced for the
        member that costs most: the one that runs whenever the cheap ones have nothing.
        """
        return max(self.draft_costs.values()) if self.draft_costs else None

    def step_seconds(self, k: int) -> float:
        """A step's seconds at depth k, the other streams' rows in its forward."""
        draft = k * (self.draft_token_s or 0.0)
        return draft + self.verify_cost(self.load.rows + self.rows(k)) + self.overhead_s

    def _rates(self) -> list[float]:
        """Committed tokens per second of the step, every stream's, at each k: drafting
        pays only where it adds more tokens than the slower forward costs the others."""
        return [(self.load.streams + self.expected_tokens(k)) / self.step_seconds(k)
                for k in range(self.k_max + 1)]

    def _pays_alone(self) -> bool:
        """Whether some k > 0 would pay for this stream alone (why a 0 under load is load's)."""
        load, self.load = self.load, Load()
        try:
            rates = self._rates()
        finally:
            self.load = load
        return max(rates[1:], default=0.0) >= rates[0] * (1 + self.pay_margin)

    def rows(self, k: int) -> float:
        """The verify rows of a draft of depth k: as observed, else k + 1 (a chain's).

        An unseen depth gets at least the rows of the deepest shallower one seen: a tree holds
        its shallower cuts (Draft.within), and priced as a chain every deeper depth would look
        cheap until tried.
        """
        if k in self.extra_rows:
            return k + 1 + self.extra_rows[k]
        shallower = [d + 1 + extra for d, extra in self.extra_rows.items() if d < k]
        return max([k + 1, *shallower])

    def verify_cost(self, rows: float) -> float:
        """Measured cost of a forward over `rows` tokens, interpolated between known sizes.

        One row is the least work of any forward, so its cost is capped by the cheapest
        forward measured: one slow plain step (79 ms among 39-45 ms ones) had raised it above
        the two-row cost and kept the default pair's chain drafting at a loss.
        """
        if rows <= 1 and self.verify_s:
            return min(self.verify_s.values())
        if rows in self.verify_s:
            return self.verify_s[rows]
        known = sorted(self.verify_s)
        if not known:
            return 1.0 + 0.1 * (rows - 1)  # shape only: with no data, longer still costs more
        below = [n for n in known if n < rows]
        above = [n for n in known if n > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            t = (rows - lo) / (hi - lo)
            return self.verify_s[lo] * (1 - t) + self.verify_s[hi] * t
        if below:  # extrapolate with the slope of the last two points (or flat)
            lo = below[-1]
            prev = below[-2] if len(below) > 1 else None
            slope = ((self.verify_s[lo] - self.verify_s[prev]) / (lo - prev)) if prev else 0.0
            return self.verify_s[lo] + max(slope, 0.0) * (rows - lo)
        return self.verify_s[above[0]]

    def read_pays(self, rows: int, horizon: int) -> bool:
        """Whether reading `rows` of context before the next draft (a draft model's prompt,
        or what it missed while off) can be repaid within `horizon` more tokens: what the
        best k saves per committed token over plain, times horizon, against the read's cost
        at the rows' measured price. An exploration asks it of a text as good as the prior:
        a catch-up read costs a share of the plain stretch it follows (a 0.5B draft's rows:
        about 7% of the 1.5B target's steps), so exploring where even a good text could not
        repay it lost that share of every reply.

        True while drafting or reading is unpriced (the first read measures both). A 0.5B
        draft reading a 512-token window took 1.3 s of a rag reply's 8, to draft a dozen tokens.
        """
        if rows <= 0 or self.draft_token_s is None or not self.read_rows:
            return True
        acceptance = [self.prior_acceptance] * self.k_max if self._exploring else None
        per_token = min((self.step_seconds(k) / self.expected_tokens(k, acceptance)
                         for k in range(1, self.k_max + 1)), default=self.step_seconds(0))
        return (self.step_seconds(0) - per_token) * horizon > rows * self.read_s / self.read_rows

    def choose(self) -> int:
        """The k with the most expected tokens per second; 0 when speculation does not pay."""
        if self.draft_token_s is None and self.k_max:
            # drafting cost unknown: a long first draft priced as free cost a 0.5B drafter
            # 8 forwards on prompts where speculation then did not pay; one token measures it
            return 1
        rates = self._rates()
        best = max(range(len(rates)), key=rates.__getitem__)
        if rates[best] < rates[0] * (1 + self.pay_margin):
            best = 0
        self.off_by_load = best == 0 and bool(self.load.rows) and self._pays_alone()
        if self.off_by_load:
            return 0  # no exploration: alone it pays, so only the load is to watch
        if best == 0:
            self._since_plain = 0
            self._steps_off += 1
            gap = self._off_gap or self.explore_every
            if self._steps_off >= gap:
                self._steps_off = 0
                self._off_gap = min(2 * gap, self.max_explore_gap)
                self._exploring = True
                return max(range(1, self.k_max + 1), key=rates.__getitem__)
            return best
        self._steps_off = self._off_gap = 0
        self._since_plain += 1
        if self._since_plain >= (self._plain_gap or self.plain_every):
            self._since_plain, self._retiming = 0, True
            return 0
        self._steps_on += 1
        if self._steps_on % self.explore_every == 0:
            return min(best + 1, self.k_max)
        return best

    def cut(self, survival: Sequence[float]) -> int:
        """How much of a drafted chain to verify, given the drafter's own per-node estimate
        that the node and every one before it are accepted (DSpark's confidence head): the
        prefix with the most expected tokens per second of verify, its drafting already paid.
        It reads only the draft, never the target, so verification stays exact."""
        return max(range(1, len(survival) + 1), default=0,
                   key=lambda n: self._survival_rate(survival[:n], n))

    def depth_for(self, draft: Draft) -> int:
        """The depth to verify of a draft that prices itself (its survival per node, a tree's
        too): as cut, the depth with the most expected tokens per second of verify, but 0
        where none beats a plain step by pay_margin, since no k was chosen before it."""
        depths = draft.depths()

        def rate(depth: int) -> float:
            kept = [s for s, d in zip(draft.survival, depths) if d <= depth]
            return self._survival_rate(kept, len(kept))

        best = max(range(1, max(depths, default=0) + 1), key=rate, default=0)
        return best if best and rate(best) >= rate(0) * (1 + self.pay_margin) else 0

    def _survival_rate(self, survival: Sequence[float], nodes: int) -> float:
        """Committed tokens per second of a verify of these nodes, every stream's."""
        seconds = self.verify_cost(self.load.rows + nodes + 1) + self.overhead_s
        return (self.load.streams + 1.0 + sum(survival)) / seconds

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float,
                other_s: float, source: str = "", rows: int | None = None,
                catch_up_s: float = 0.0, catch_up_rows: int = 0,
                reads_prompt: bool = False, load_rows: int = 0) -> None:
        """Fold one step's outcome and timings into the estimates.

        source: the drafter that proposed; rows: the verify forward's rows when the draft was
        a tree (n_drafted is then its depth and n_accepted its accepted path), else
        n_drafted + 1. draft_s: drafting time without catch-up. catch_up_s, catch_up_rows:
        what the drafter spent reading context it had missed (the prompt, or the tokens of a
        plain stretch), and how many rows: they price later reads (read_pays), and unless it
        was this reply's prompt (paid once a reply however drafting goes) the time is charged
        to the exploration that paid it, never to the per-step overhead, where plain steps
        carried it too, so drafting looked relatively cheaper. load_rows: the other streams'
        rows in the same forward; verify_s is that whole forward's, so it prices its rows.
        """
        rows = rows or n_drafted + 1
        if catch_up_rows:
            self.read_rows += catch_up_rows
            self.read_s += catch_up_s
        if reads_prompt:
            catch_up_s = 0.0
        # kept as rows beyond depth + 1: a chain's stay exactly 0, so its k is priced at
        # exactly the probed k + 1 rows (an EMA of k + 1 itself may round off them)
        if n_drafted:
            self.extra_rows[n_drafted] = _ema(self.extra_rows.get(n_drafted),
                                              rows - n_drafted - 1)
        forward_rows = rows + load_rows
        old = self.verify_s.get(forward_rows)
        if self._retiming and not n_drafted:
            self._retime(forward_rows, old, verify_s)
        else:
            self.verify_s[forward_rows] = _settle(old, verify_s)
        self.overhead_s = _ema(self.overhead_s or None, other_s)
        if n_drafted:
            # catch-up reads stay out of the cost per token: in a run that priced them in (and
            # halved evidence per reply) the default pair's HumanEval median over HTTP fell
            # from 1.33x to 1.04x plain (chain: the model reads what lookup steps committed)
            cost = self.draft_costs.get(source)
            self.draft_costs[source] = _ema(cost, draft_s / n_drafted)
            # evidence ages with the drafts seen, and faster after a long plain stretch (the
            # text may have changed); aged every step, the prior took over while speculation
            # was off and turned it back on (an EAGLE-3 head at 13% acceptance: 0.94x plain)
            self._age(self.decay ** (1 + self._idle / self.explore_every))
            self._idle = 0
            if self._exploring and self._paid(n_accepted,
                                              draft_s + verify_s + other_s + catch_up_s):
                self._off_gap = 0  # look again soon rather than after the longest gap
        else:
            self._idle += 1
        self._exploring = self._retiming = False
        for j in range(min(n_drafted, n_accepted + 1, self.k_max)):
            self._reached[j] += 1.0  # draft j+1 was examined: every earlier one survived
        for j in range(min(n_accepted, self.k_max)):
            self._accepted[j] += 1.0

    def _retime(self, rows: int, old: float | None, seconds: float) -> None:
        """Fold a deliberate plain step's time into the cost of its forward's rows (one,
        alone). Another process only ever slows a step, so a faster time than believed is
        taken as it is."""
        agrees = old is not None and abs(seconds / old - 1) <= self.retime_tolerance
        self.verify_s[rows] = seconds if old is None or seconds < old else _ema(old, seconds)
        gap = self._plain_gap or self.plain_every
        self._plain_gap = min(2 * gap, self.max_explore_gap) if agrees else self.plain_every

    def _paid(self, n_accepted: int, seconds: float) -> bool:
        """Whether a step committed tokens faster than a plain step would have. Not "every draft
        accepted": a tree's accepted first level, verified over 17 rows, would count as paying
        (with that rule an EAGLE-2 tree explored in 67 of 1,859 steps, 0.94x plain, HumanEval)."""
        return (n_accepted + 1) * self.step_seconds(0) > seconds

    def _age(self, factor: float) -> None:
        """Old evidence loses weight as new evidence comes, never while speculation is off."""
        for j in range(self.k_max):
            self._reached[j] *= factor
            self._accepted[j] *= factor


def _settle(old: float | None, new: float) -> float:
    """A forward's cost: a faster time moves it ten times as much as a slower one. Another
    process or a draft's forward only ever slows a step; averaged evenly, one-row costs on the
    default pair wandered 33-62 ms around a true 38-40 and decided whether drafting paid."""
    return _ema(old, new, 0.5 if old is None or new < old else 0.05)


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first observation is taken as is."""
    return new if old is None else (1 - weight) * old + weight * new
