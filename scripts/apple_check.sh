#!/usr/bin/env bash
# One command on an Apple silicon Mac: pull the catalogue's default pair for MLX, bench plain
# decoding against every drafter kind that pair can use on --backend mlx (tok/s, speedup,
# acceptance, and whether each output is identical to plain's), and time the target's verify
# forward of 1..9 rows. Prints a summary; the last line of stdout is one JSON object (schema
# specdeck.apple_check/1), "ok" true only when every step ran and every speculative output
# equalled plain's. Exit status 0 iff ok. Runs on macOS's own bash 3.2, without coreutils.
#
#   scripts/apple_check.sh
#   PAIR=qwen3-4b+0.6b scripts/apple_check.sh           # another catalogue pair
#   APPLE_CHECK_TARGET=DIR [APPLE_CHECK_DRAFT=DIR] scripts/apple_check.sh   # local models, no pull
#
# Knobs: PY (the python with specdeck's MLX extra), K (draft length, 4), TOKENS (new tokens
# per prompt, 128), PROMPTS (humaneval), LIMIT (prompts per category, 2), ROWS (1-9).
# The kinds are bench's `--drafters all`: what app/drafters/kinds.py's check lets run on MLX
# with the pair's models, so a kind added there is benched here without editing this script.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
K=${K:-4}
TOKENS=${TOKENS:-128}
PROMPTS=${PROMPTS:-humaneval}
LIMIT=${LIMIT:-2}
ROWS=${ROWS:-1-9}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/apple_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { echo "apple_check: $*" >&2; }
fail() {  # one JSON line saying why, exit 1
  "$PY" -c 'import json, sys; print(json.dumps({"schema": "specdeck.apple_check/1",
    "ok": False, "step": sys.argv[1], "error": sys.argv[2]}))' "$1" "$2" 2>/dev/null \
    || echo '{"schema": "specdeck.apple_check/1", "ok": false, "error": "no python to run the check"}'
  exit 1
}

# 1. MLX importable by this python, or why not
if ! "$PY" -c 'import mlx.core, mlx_lm' 2>"$WORK/mlx.err"; then
  fail mlx "$PY cannot import mlx and mlx_lm ($(tail -n 1 "$WORK/mlx.err")): pip install -e '.[mlx]' (or PY=the python that has them)"
fi
if [ "$(uname -s)/$(uname -m)" != "Darwin/arm64" ]; then
  say "not Apple silicon ($(uname -s)/$(uname -m)): MLX runs its CPU build, the speeds mean little"
fi

# 2. the models: the pair pulled for MLX (nothing to do when installed), or local folders
if [ -n "${APPLE_CHECK_TARGET:-}" ]; then
  MODEL="$APPLE_CHECK_TARGET${APPLE_CHECK_DRAFT:+ + draft $APPLE_CHECK_DRAFT}"
  MODEL_ARGS=(--target "$APPLE_CHECK_TARGET")
  if [ -n "${APPLE_CHECK_DRAFT:-}" ]; then
    MODEL_ARGS+=(--draft "$APPLE_CHECK_DRAFT")
  fi
else
  PAIR=${PAIR:-$("$PY" -c 'from app.catalogue.registry import load_catalogue
print(load_catalogue().default_pair)')}
  [ -n "$PAIR" ] || fail catalogue "could not read the catalogue's default pair"
  MODEL="$PAIR"
  say "pulling $PAIR for MLX"
  if ! "$PY" -m app pull "$PAIR" --backend mlx >&2; then
    fail pull "specdeck pull $PAIR --backend mlx failed (see above)"
  fi
  MODEL_ARGS=(--pair "$PAIR")
fi

# 3. plain against every kind that runs here, interleaved, then the verify cost by rows
say "bench on $MODEL: --drafters all --k $K, $PROMPTS x $LIMIT, $TOKENS tokens, rows $ROWS"
"$PY" -m app bench --backend mlx "${MODEL_ARGS[@]}" --drafters all --k "$K" \
  --prompts "$PROMPTS" --limit "$LIMIT" --max-new-tokens "$TOKENS" --verify-cost "$ROWS" \
  --json "$WORK/bench.json" >"$WORK/bench.out" 2>"$WORK/bench.err"
BENCH_RC=$?
cat "$WORK/bench.err" >&2
[ "$BENCH_RC" -eq 0 ] && [ -s "$WORK/bench.json" ] \
  || fail bench "specdeck bench exited $BENCH_RC: $(tail -n 1 "$WORK/bench.err")"
grep -v '^{' "$WORK/bench.out" >&2 || true

# 4. the summary and one JSON line
"$PY" - "$WORK/bench.json" "$MODEL" "$(uname -s)/$(uname -m)" <<'EOF'
import json, sys

report, model, platform = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
results, unavailable = {}, {}
for c in report["configs"]:
    if not c["available"]:
        unavailable[c["name"]] = c["reason"]
        continue
    o = c["overall"]
    results[c["name"]] = {"tok_s": o["decode_tok_s"], "speedup": o["speedup_median"],
                          "acceptance": o["acceptance_rate"], "tau": o["tau"],
                          "identical": o["identical"], "errors": o["errors"]}
plain = results.get("plain", {}).get("tok_s") or 0
print(f"{model} on {report['machine']['backend']} {report['machine']['device']} "
      f"{report['machine']['dtype']} ({platform})")
print(f"plain: {plain:.1f} tok/s")
for name, r in results.items():
    if name != "plain":
        print(f"{name}: {r['tok_s'] or 0:.1f} tok/s ({r['speedup'] or 0:.2f}x plain), "
              f"acceptance {r['acceptance'] or 0:.0%}, τ {r['tau'] or 0:.2f}, "
              f"identical to plain: {'yes' if r['identical'] else 'NO'}")
for name, why in unavailable.items():
    print(f"not run: {name}: {why}")
cost = report.get("verify_cost") or {}
print("verify ms by rows: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in
                                         zip(cost.get("rows", []), cost.get("median_ms", []))))
spec = {n: r for n, r in results.items() if n != "plain"}
ok = bool(spec) and bool(cost) and all(r["identical"] and not r["errors"]
                                       for r in results.values())
print(json.dumps({"schema": "specdeck.apple_check/1", "ok": ok, "model": model,
                  "platform": platform, "machine": report["machine"], "results": results,
                  "unavailable": unavailable, "verify_cost": cost}))
sys.exit(0 if ok else 1)
EOF
