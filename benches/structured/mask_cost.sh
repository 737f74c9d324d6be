#!/usr/bin/env bash
# What the structured-output token mask costs in decode speed on SmolLM2:
# `llama-graph run` on the same chat prompt, greedy, exactly N tokens,
# without and with a JSON schema (one whose answer is longer than N tokens,
# so both runs end at -n), interleaved (plain, schema, plain, ...). Prints
# each round's decode tokens/s and the ratio schema/plain, then the median
# ratio, and the share of the schema runs' decode time spent in constrained
# sampling (mask, sample, grammar step; timed inside the same run, so it
# holds even when other work slows both runs). Usage: benches/structured/mask_cost.sh [ROUNDS] [N] [THREADS]
set -euo pipefail
ROUNDS=${1:-5}
N=${2:-128}
THREADS=${3:-2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release/llama-graph}
MODEL=${MODEL:-$HOME/.cache/llama-graph/SmolLM2-135M-Instruct.Q4_1.gguf}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cat > "$TMP/schema.json" <<'JSON'
{"type": "object", "properties": {
  "cities": {"type": "array", "minItems": 40, "maxItems": 60, "items": {
    "type": "object", "properties": {
      "name": {"type": "string", "minLength": 3, "maxLength": 30},
      "country": {"type": "string", "minLength": 3, "maxLength": 30},
      "population": {"type": "integer", "minimum": 1000}},
    "required": ["name", "country", "population"], "additionalProperties": false}}},
  "required": ["cities"], "additionalProperties": false}
JSON
PROMPT="List the largest cities of the world with their country and population, as JSON."
run() {
  "$BIN" run -m "$MODEL" -t "$THREADS" --temp 0 --chat -p "$PROMPT" -n "$N" --ignore-eos \
    --stats-json "$TMP/stats.json" "$@" > "$TMP/out.txt" 2> "$TMP/err.txt" ||
    { cat "$TMP/err.txt" >&2; exit 1; }
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["decode_tokens_per_s"], s["generated_tokens"], s["constrained_sampling_s"] / s["decode_s"], 1e3 * s["constrained_sampling_s"] / s["generated_tokens"])' "$TMP/stats.json"
}
ratios=()
shares=()
for r in $(seq 1 "$ROUNDS"); do
  read -r plain np _ _ < <(run)
  read -r schema ns share ms < <(run --json-schema "$TMP/schema.json")
  ratio=$(python3 -c "print(f'{$schema / $plain:.3f}')")
  ratios+=("$ratio")
  shares+=("$share")
  echo "round $r: plain $plain tok/s ($np tokens), schema $schema tok/s ($ns tokens), ratio $ratio; constrained sampling $(python3 -c "print(f'{100 * $share:.1f}')")% of the schema run's decode time ($(python3 -c "print(f'{$ms:.3f}')") ms per token)"
done
echo "last schema answer: $(head -c 300 "$TMP/out.txt")..."
python3 -c "import statistics,sys; r=sorted(map(float,sys.argv[1:])); print(f'median ratio schema/plain over {len(r)} rounds: {statistics.median(r):.3f} (min {r[0]:.3f}, max {r[-1]:.3f})')" "${ratios[@]}"
python3 -c "import statistics,sys; r=sorted(map(float,sys.argv[1:])); print(f'median share of decode time in constrained sampling: {100 * statistics.median(r):.1f}% (min {100 * r[0]:.1f}%, max {100 * r[-1]:.1f}%)')" "${shares[@]}"
