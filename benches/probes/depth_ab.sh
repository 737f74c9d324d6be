#!/bin/sh
# Decode at depth, A/B of two llama-graph binaries, interleaved (the machine
# is shared: compare ratios, not absolute rates):
#   benches/probes/depth_ab.sh BEFORE_BIN AFTER_BIN MODEL [rounds] [depth] [threads] [n_gen]
# e.g. BEFORE_BIN = a non-incremental release build of the base commit's
# llama-graph, AFTER_BIN = target/release/llama-graph, MODEL = the
# SmolLM2-135M-Instruct Q4_1 GGUF in ~/.cache/llama-graph. Each run is
# `bench -p 0 -n N_GEN -d DEPTH -r 1 --no-warmup` (the depth's prefill is
# untimed but takes most of the run); prints each run's tgN row.
set -eu
before=$1 after=$2 model=$3 rounds=${4:-2} depth=${5:-4096} threads=${6:-2} ngen=${7:-32}
i=0
while [ "$i" -lt "$rounds" ]; do
    for which in before after; do
        eval bin=\$$which
        printf '%-6s ' "$which"
        "$bin" bench -m "$model" -t "$threads" -p 0 -n "$ngen" -d "$depth" -r 1 --no-warmup 2>&1 |
            grep "tg$ngen" || echo "(no tg$ngen row)"
    done
    i=$((i + 1))
done
