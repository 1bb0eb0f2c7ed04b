#!/usr/bin/env bash
# One CUDA GPU, under 8 minutes: the CUDA tests (tests/test_cuda.py: oracle equivalence on tiny
# fp32 models for every drafter, SmolLM2's greedy identity when it is installed) and a short
# bench on the GPU. Prints progress on stderr; the last line of stdout is one JSON object
# (schema specdeck.gpu_check/1), "ok" true only when every step passed. Exit status 0 iff ok.
#
#   scripts/gpu_check.sh                      # PY=python to use, PAIR=pair to bench
#
# The bench runs the installed PAIR (default qwen2.5-coder-1.5b+0.5b) in bfloat16, else
# SmolLM2 (smollm2-135m+ngram) drafting for itself, else a tiny random model saved on the
# spot (that one checks the GPU path runs, its speed means nothing); the JSON says which.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
PAIR=${PAIR:-qwen2.5-coder-1.5b+0.5b}
TESTS_S=${TESTS_S:-300}  # the two steps' limits keep the whole under 8 minutes
BENCH_S=${BENCH_S:-150}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
say() { echo "gpu_check: $*" >&2; }

# 1. a GPU torch can use, or one JSON line saying why not
if ! "$PY" - >"$WORK/gpu.json" 2>"$WORK/gpu.err" <<'EOF'
import json, sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA GPU: install "
             "a CUDA build of torch, check nvidia-smi and CUDA_VISIBLE_DEVICES")
props = torch.cuda.get_device_properties(0)
print(json.dumps({"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                  "torch": torch.__version__, "cuda": torch.version.cuda}))
EOF
then
  "$PY" -c 'import json, sys; print(json.dumps({"schema": "specdeck.gpu_check/1", "ok": False,
    "error": sys.argv[1].strip().splitlines()[-1] if sys.argv[1].strip() else "python failed"}))' \
    "$(cat "$WORK/gpu.err")" 2>/dev/null \
    || echo '{"schema": "specdeck.gpu_check/1", "ok": false, "error": "no python to run the check"}'
  exit 1
fi
say "GPU: $(cat "$WORK/gpu.json")"

# 2. the CUDA tests, slow ones included (a missing GPU fails them instead of skipping)
say "CUDA tests (limit ${TESTS_S} s)"
SPECDECK_REQUIRE_CUDA=1 timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_cuda.py --junitxml="$WORK/junit.xml" >"$WORK/tests.log" 2>&1
TESTS_RC=$?
tail -n 5 "$WORK/tests.log" >&2

# 3. a short bench on the GPU
BENCH_ARGS=(--prompts humaneval --limit 2 --max-new-tokens 64 --device cuda --warmup 1)
installed() { "$PY" -m app models 2>/dev/null | awk -v p="$1" '$1 == p && $2 == "installed" {f=1} END {exit !f}'; }
if installed "$PAIR"; then
  MODEL="$PAIR"
  BENCH_ARGS+=(--pair "$PAIR" --dtype bfloat16 --drafters ngram,draft --k 4)
elif installed smollm2-135m+ngram; then
  MODEL="smollm2-135m+ngram (drafting for itself)"
  TARGET=$("$PY" -c 'from app import store; print(store.installed_paths("smollm2-135m+ngram", "torch")[0])')
  BENCH_ARGS+=(--target "$TARGET" --draft "$TARGET" --dtype bfloat16 --drafters ngram,draft --k 4)
else
  MODEL="tiny random model (no pair installed: its speed means nothing)"
  "$PY" -c 'import sys; from pathlib import Path; from tests.serving import save_tiny_model
save_tiny_model(Path(sys.argv[1]))' "$WORK/tiny" >&2
  BENCH_ARGS+=(--target "$WORK/tiny" --draft "$WORK/tiny" --dtype float32 --drafters ngram,draft
               --k 4 --no-chat)
fi
say "bench on $MODEL (limit ${BENCH_S} s)"
timeout "$BENCH_S" "$PY" -m app bench "${BENCH_ARGS[@]}" --json "$WORK/bench.json" \
  >"$WORK/bench.out" 2>"$WORK/bench.err"
BENCH_RC=$?
grep -v '^{' "$WORK/bench.out" >&2 || true

# 4. one JSON line
"$PY" - "$WORK" "$TESTS_RC" "$BENCH_RC" "$MODEL" "$START" <<'EOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

work, tests_rc, bench_rc, model, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
    sys.argv[4], int(sys.argv[5])

def tests() -> dict:
    try:
        suite = ET.parse(work / "junit.xml").getroot()
    except (OSError, ET.ParseError):
        log = (work / "tests.log").read_text(errors="replace") if (work / "tests.log").exists() else ""
        why = "timed out" if tests_rc == 124 else "pytest wrote no report"
        return {"ok": False, "error": f"{why}: {log.strip()[-300:]}"}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = suite.findall("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None
              or c.find("error") is not None]
    skipped = [c.get("name") for c in cases if c.find("skipped") is not None]
    return {"ok": tests_rc == 0 and not failed, "passed": len(cases) - len(failed) - len(skipped),
            "failed": failed, "skipped": skipped}

def bench() -> dict:
    lines = (work / "bench.out").read_text(errors="replace").strip().splitlines() \
        if (work / "bench.out").exists() else []
    if bench_rc != 0 or not lines or not lines[-1].startswith("{"):
        err = (work / "bench.err").read_text(errors="replace") if (work / "bench.err").exists() else ""
        why = "timed out" if bench_rc == 124 else f"exit {bench_rc}"
        return {"ok": False, "model": model, "error": f"{why}: {err.strip()[-300:]}"}
    summary = json.loads(lines[-1])
    identical = [r.get("identical") for r in summary["results"].values() if r]
    return {"ok": True, "model": model, "summary": summary,
            "greedy_identical": all(i is not False for i in identical)}

t, b = tests(), bench()
print(json.dumps({"schema": "specdeck.gpu_check/1", "ok": t["ok"] and b["ok"],
                  "gpu": json.loads((work / "gpu.json").read_text()), "tests": t, "bench": b,
                  "seconds": int(time.time()) - start}))
sys.exit(0 if t["ok"] and b["ok"] else 1)
EOF
