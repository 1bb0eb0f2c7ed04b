"""`specdeck bench --remote URL`: a remote engine as one more configuration of the bench.

Knows: how a RemoteEngine's run becomes a bench Record, and which of its statistics it can
stand behind. Must not know: wire formats (app/serve/remote_engine.py), array libraries.

The remote engine gets the very token ids the local configurations decode (the chat template
applied here), so the server must run the same model for its outputs to compare with plain's;
its speed includes the network, as a user of that server sees it.
"""

from __future__ import annotations

from typing import Any

from app.bench.prompts import BenchPrompt
from app.bench.records import Config, Record
from app.core.engine import last_done
from app.core.types import SamplingParams

# bench's engine metrics and the RunStats names they are made of
SOURCES = {"tau": "mean_accepted_length", "acceptance_rate": "acceptance_rate",
           "acceptance_per_position": "acceptance_per_position", "draft_s": "draft_s",
           "verify_s": "verify_s", "other_s": "other_s", "peak_memory_bytes": "peak_memory_bytes",
           "speculation_off_steps": "speculation_off_steps"}


class RemoteRunner:
    """Runs one prompt on a remote engine; shaped like bench's _EngineRunner."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        name = f"remote {engine.kind}:{engine.drafter_name}"
        self.config = Config(name, "remote", engine.k if engine.kind == "specdeck" else "?")

    def run(self, prompt: BenchPrompt, ids: list[int], params: SamplingParams,
            repeat: int) -> Record:
        done = last_done(self.engine.generate(ids, params))
        s = done.stats
        # counts the engine did not report would read as measured zeros: leave them out
        stats = s.to_dict() if "acceptance_rate" in self.engine.reported else None
        return Record(self.config.name, prompt.id, prompt.category, repeat, done.token_ids,
                      s.decode_tok_s, s.decode_s, max(s.n_new_tokens - 1, 0),
                      s.ttft_s + s.decode_s, stats, done.error)

    def describe(self) -> dict[str, Any]:
        """What the report says about this configuration beyond its numbers."""
        missing = [key for key, name in SOURCES.items() if name not in self.engine.reported]
        return {"remote": {"url": self.engine.base_url, "engine": self.engine.kind,
                           "model": self.engine.target.name},
                "unreported": missing,
                "note": "decode tok/s include the network; the server must run the local "
                        "target's model for 'identical' to mean anything"}
