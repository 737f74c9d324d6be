#!/bin/sh
# The cost of a step of a few tokens (a speculative verification step), A/B
# of two llama-graph binaries, interleaved (the machine is shared: compare
# ratios, not absolute times):
#   benches/probes/small_step_ab.sh BEFORE_BIN AFTER_BIN MODEL [rounds] [threads] [sizes]
# e.g. BEFORE_BIN = a non-incremental release build of the base commit's
# llama-graph, AFTER_BIN = target/release/llama-graph, MODEL = the
# SmolLM2-135M-Instruct F16 or F32 GGUF; sizes default 1,2,3,5,9. Each run is
# `bench -p SIZES -n 0 -r 3` (a prefill of S tokens is one step of S tokens);
# prints every run's step time per S, then per S the median step time of each
# binary, after/before, and the step's cost in one-token steps (S=1 of the
# same binary) when S=1 is among the sizes.
set -eu
before=$1 after=$2 model=$3 rounds=${4:-3} threads=${5:-1} sizes=${6:-1,2,3,5,9}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
i=0
while [ "$i" -lt "$rounds" ]; do
    for which in before after; do
        eval bin=\$$which
        "$bin" bench -m "$model" -t "$threads" -p "$sizes" -n 0 -r 3 2>/dev/null |
            awk -v w="$which" -F'|' '$6 ~ /pp[0-9]/ {
                s = $6; gsub(/[ p]/, "", s); split($7, a, " ");
                printf "%s %d %.2f\n", w, s, 1000 * s / a[1] }' | tee -a "$out"
    done
    i=$((i + 1))
done
echo "S  before_ms  after_ms  after/before  before_in_S1  after_in_S1"
sort -k2,2n -k1,1 -k3,3n "$out" | awk '
    { v[$1 " " $2] = v[$1 " " $2] " " $3; n[$1 " " $2]++; if (!($2 in seen)) { seen[$2] = 1; ss[++m] = $2 } }
    function med(key,   a, c) { c = split(v[key], a, " "); return a[int((c + 1) / 2)] }
    END {
        b1 = med("before 1"); a1 = med("after 1")
        for (i = 1; i <= m; i++) {
            s = ss[i]; b = med("before " s); a = med("after " s)
            printf "%-2d %9.2f %9.2f %12.3f %12s %11s\n", s, b, a, a / b,
                (b1 ? sprintf("%.2f", b / b1) : "-"), (a1 ? sprintf("%.2f", a / a1) : "-")
        }
    }'
