"""The server's /metrics: vLLM's spec_decode_* counters and request gauges, as Prometheus text.

Knows: RunStats and Done, the OpenAI finish reasons, app/serve/prometheus.py's renderer. Must not
know: HTTP frameworks or engines.
"""

import threading

from app.core.types import Done
from app.serve import prometheus

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort",
          "error": "error"}


# name under `specdeck:` -> (help, what one finished request adds); vLLM's names and help
COUNTERS = {
    "spec_decode_num_drafts": ("Number of spec decoding drafts.",
                               lambda s: s.drafted_per_position[0] if s.drafted_per_position
                               else 0),
    "spec_decode_num_draft_tokens": ("Number of draft tokens.", lambda s: s.drafted),
    "spec_decode_num_accepted_tokens": ("Number of accepted tokens.", lambda s: s.accepted),
    "prompt_tokens": ("Number of prefill tokens processed.", lambda s: s.n_prompt_tokens),
    "generation_tokens": ("Number of generation tokens processed.", lambda s: s.n_new_tokens),
    # batched streams: "speculation off: the other streams fill the step"
    "load_off_steps": ("Steps that drafted nothing only because the other streams fill the "
                       "step.", lambda s: s.load_off_steps),
}


class Metrics:
    """Counters since the server started, served as Prometheus text at /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.accepted_per_pos: list[int] = []
        self.finished_by: dict[str, int] = {}
        # per drafter name (a chain's members apart): [steps, draft tokens, accepted tokens]
        self.by_drafter: dict[str, list[int]] = {}
        self.running = self.queued = 0

    def queued_one(self) -> None:
        with self._lock:
            self.queued += 1

    def started_one(self) -> None:
        with self._lock:
            self.queued -= 1
            self.running += 1

    def finished(self, done: Done | None, ran: bool) -> None:
        """Count one finished request; done is None when it left the queue unanswered."""
        reason = FINISH[done.stop_reason] if done is not None else "abort"
        with self._lock:
            self.running -= 1 if ran else 0
            self.queued -= 0 if ran else 1
            self.finished_by[reason] = self.finished_by.get(reason, 0) + 1
            if done is None:
                return
            for name, (_, added) in COUNTERS.items():
                self.totals[name] += added(done.stats)
            per_pos = done.stats.accepted_per_position
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
            for j, n in enumerate(per_pos):
                self.accepted_per_pos[j] += n
            for member in done.stats.drafters:
                counts = self.by_drafter.setdefault(member.name, [0, 0, 0])
                for i, n in enumerate((member.steps, member.drafted, member.accepted)):
                    counts[i] += n

    def render(self, model: str) -> str:
        return render_all({model: self})

    def _families(self, label: dict[str, str]) -> list[tuple]:
        families = [(f"specdeck:{name}_total", "counter", doc, [(label, self.totals[name])])
                    for name, (doc, _) in COUNTERS.items()]
        families += [
            ("specdeck:spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Accepted tokens per draft position.",
             [({**label, "position": str(j)}, n) for j, n in enumerate(self.accepted_per_pos)]),
            *self._drafter_families(label),
            ("specdeck:request_success_total", "counter", "Count of finished requests.",
             [({**label, "finished_reason": r}, n) for r, n in sorted(self.finished_by.items())]),
            ("specdeck:num_requests_running", "gauge", "Requests generating now.",
             [(label, self.running)]),
            ("specdeck:num_requests_waiting", "gauge", "Requests queued for the engine.",
             [(label, self.queued)]),
        ]
        return families

    def _drafter_families(self, label: dict[str, str]) -> list[tuple]:
        # specdeck's own names: vLLM has no per-drafter split (a chain's members apart)
        docs = (("spec_decode_drafter_num_drafts", "Drafts proposed, per drafter."),
                ("spec_decode_drafter_num_draft_tokens", "Draft tokens, per drafter."),
                ("spec_decode_drafter_num_accepted_tokens", "Accepted tokens, per drafter."))
        return [(f"specdeck:{name}_total", "counter", doc,
                 [({**label, "drafter": drafter}, counts[i])
                  for drafter, counts in sorted(self.by_drafter.items())])
                for i, (name, doc) in enumerate(docs)]


def render_all(by_model: dict[str, Metrics]) -> str:
    """Several models' counters as one exposition: each family once, a sample per model."""
    merged: dict[str, tuple[str, str, str, list]] = {}
    for model, metrics in by_model.items():
        with metrics._lock:
            families = metrics._families({"model_name": model})
        for name, kind, doc, samples in families:
            merged.setdefault(name, (name, kind, doc, []))[3].extend(samples)
    return "".join(prometheus.render(*family) for family in merged.values())
