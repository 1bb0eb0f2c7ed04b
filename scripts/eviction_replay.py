"""Which records a full history should drop: oldest first against least used, measured offline.

Replays a stream of texts through the suffix index (app/drafters/suffix.py) under a token
bound, each text drafted from the history before it is recorded, and reports per eviction
policy how much of the stream the history drafts. The stream is every version of this
repository's files in commit order (`git log`): the code-edit workload of issue 46, where a
file is pasted again after a change. Each text is its own reply and the target agrees with
it (an oracle: a draft token is accepted when it equals the text's next token), so a policy
is judged by drafts alone, with no model and no timing noise. Drafting is the history member's:
the longest history match (the request's own tokens are not matched, so only what the
history holds counts), a chain as deep as the match earns (max_spec_factor 1, at most --k),
one step per verify (the accepted tokens and the target's own token).

Policies: `oldest` (what app/store/history.py does), `least-recent` (a record whose
continuation was accepted moves to the back), `least-used` (fewest accepted tokens drafted
from it, the oldest of equals first). Eviction goes down to the store's LOW_WATER share of
the bound, as the store does.

    python scripts/eviction_replay.py --bounds 50000,200000 --paths app backends

Prints one line per (bound, policy) and the whole result as one JSON line last.
Knows: git, the suffix index and its drafting rule, the store's low water.
Must not know: models, files under SPECDECK_HOME.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.drafters.suffix import MAX_SPEC_FACTOR, SuffixIndex, continuations  # noqa: E402
from app.store.history import LOW_WATER  # noqa: E402

POLICIES = ("oldest", "least-recent", "least-used")
MIN_MATCH = 4  # the chain's history member needs as long a match (CHAIN_LOOKUP_MIN_N)
_WORDS = re.compile(r"\w+|[^\w\s]|\s+")


@dataclass
class Kept:
    """One record in the history: its tokens, when it was last drafted from, how much."""

    tokens: list[int]
    added: int
    last_used: int
    used: int = 0


def file_versions(repo: Path, paths: list[str], exts: tuple[str, ...]) -> list[str]:
    """The text of every added or modified file under paths, commit by commit, oldest first."""
    log = subprocess.run(["git", "-C", str(repo), "log", "--reverse", "--format=@%H",
                          "--name-only", "--diff-filter=AM", "--", *paths],
                         check=True, capture_output=True, text=True).stdout
    texts, commit = [], ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit = line[1:]
        elif line.endswith(exts):
            texts.append(subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{line}"],
                                        check=True, capture_output=True, text=True).stdout)
    return texts


def tokenize(texts: list[str]) -> list[list[int]]:
    """Words, punctuation and runs of space as ids: a stand-in for a BPE that keeps
    repeats repeated (the policies' ranking depends on what repeats, not on the vocabulary)."""
    vocab: dict[str, int] = {}
    return [[vocab.setdefault(w, len(vocab)) for w in _WORDS.findall(t)] for t in texts]


def draft_text(index: SuffixIndex, kept: list[Kept], tokens: list[int], k: int, now: int
               ) -> tuple[int, int, int]:
    """(steps, drafted, accepted) of one text drafted from the history; records whose
    continuation was accepted are marked used."""
    steps = drafted = accepted = 0
    at = 1
    while at < len(tokens):
        match = index.match(tokens[max(at - 64, 0):at], MIN_MATCH) if kept else None
        n = 0
        if match is not None:
            depth = min(k, int(match.length * MAX_SPEC_FACTOR))
            draft, _ = continuations(match, depth, tree=False)
            truth = tokens[at:at + len(draft.tokens)]
            while n < len(truth) and draft.tokens[n] == truth[n]:
                n += 1
            drafted += len(draft.tokens)
            if n:
                records = np.searchsorted(index.record_starts, match.starts, "right") - 1
                for r in set(records.tolist()):
                    kept[r].last_used, kept[r].used = now, kept[r].used + n
        accepted += n
        steps += 1
        at += n + 1
    return steps, drafted, accepted


def evict(kept: list[Kept], bound: int, policy: str) -> list[Kept]:
    """The records left after the policy drops its victims down to the low water mark."""
    total = sum(len(r.tokens) for r in kept)
    if total <= bound:
        return kept
    key = {"oldest": lambda r: r.added, "least-recent": lambda r: (r.last_used, r.added),
           "least-used": lambda r: (r.used, r.added)}[policy]
    dropped: set[int] = set()
    for r in sorted(kept[:-1], key=key):  # the text just recorded has had no chance to be used
        if total <= bound * LOW_WATER:
            break
        dropped.add(id(r))
        total -= len(r.tokens)
    return [r for r in kept if id(r) not in dropped]  # the index keeps insertion order


def replay(stream: list[list[int]], bound: int, policy: str, k: int) -> dict[str, float]:
    kept: list[Kept] = []
    index = SuffixIndex.empty()
    steps = drafted = accepted = tokens = evictions = 0
    for now, text in enumerate(stream):
        s, d, a = draft_text(index, kept, text, k, now)
        steps, drafted, accepted, tokens = steps + s, drafted + d, accepted + a, \
            tokens + max(len(text) - 1, 0)
        kept.append(Kept(text, now, now))
        left = evict(kept, bound, policy)
        if len(left) != len(kept):
            evictions += 1
            index = SuffixIndex.build([(r.tokens, False) for r in left])
        else:
            index = index.added([(text, False)])
        kept = left
    return {"bound": bound, "policy": policy, "texts": len(stream), "tokens": tokens,
            "accepted_share": accepted / max(tokens, 1),
            "tokens_per_step": tokens / max(steps, 1),
            "acceptance_rate": accepted / max(drafted, 1), "evictions": evictions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--paths", nargs="+", default=["app", "backends"])
    parser.add_argument("--ext", nargs="+", default=[".py"])
    parser.add_argument("--bounds", default="50000,200000",
                        help="history bounds in tokens, comma-separated")
    parser.add_argument("--k", type=int, default=8, help="the deepest draft")
    args = parser.parse_args()
    stream = tokenize(file_versions(Path(args.repo), args.paths, tuple(args.ext)))
    total = sum(len(t) for t in stream)
    print(f"{len(stream)} texts, {total} tokens", file=sys.stderr)
    results = []
    for bound in (int(b) for b in args.bounds.split(",")):
        for policy in POLICIES:
            result = replay(stream, bound, policy, args.k)
            results.append(result)
            print(f"bound {bound:>8}  {policy:<12}  accepted {result['accepted_share']:.3f} "
                  f"of tokens  {result['tokens_per_step']:.2f} tokens/step  acceptance "
                  f"{result['acceptance_rate']:.3f}  rebuilds {result['evictions']}",
                  file=sys.stderr, flush=True)
    print(json.dumps({"texts": len(stream), "stream_tokens": total, "k": args.k,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
