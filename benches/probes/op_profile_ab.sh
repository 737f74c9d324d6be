#!/bin/sh
# Prefill A/B of two op_profile binaries, interleaved (the machine is shared:
# compare ratios, not absolute times):
#   benches/probes/op_profile_ab.sh BEFORE_BIN AFTER_BIN MODEL [rounds] [prefill] [threads]
# e.g. BEFORE_BIN = a build of the base commit's `--example op_profile`,
# AFTER_BIN = target/release/examples/op_profile. Prints each run's step wall
# time and the share of the attention ops (AttnScores, Softmax, AttnValues,
# Attention) and of GeluTanh.
set -eu
before=$1 after=$2 model=$3 rounds=${4:-2} prefill=${5:-512} threads=${6:-2}
i=0
while [ "$i" -lt "$rounds" ]; do
    for which in before after; do
        eval bin=\$$which
        PREFILL=$prefill "$bin" "$model" 1 "$threads" 2>&1 | awk -v w="$which" '
            /us per step wall/ { step = $1 / 1e6 }
            $1 ~ /^(AttnScores|AttnValues|Softmax|Attention)$/ { att += $4 }
            $1 == "GeluTanh" { gelu = $4 }
            END { printf "%-6s step %.2f s  attention %.1f%%  gelu %.1f%%\n", w, step, att, gelu }'
    done
    i=$((i + 1))
done
