#!/usr/bin/env bash
# One device-machine call running named parts, each under its own time limit, logging to $OUT:
#   bash benchmarks/device_session.sh tests bridge train fit branches attention
# What to run next: the end of benchmarks/NOTES.md.
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
R=$OUT/results
part() {  # part NAME SECONDS command...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" 2>&1 | grep -v -i "warning" | tee "$OUT/$name.log" | tail -${TAIL:-40}
}
for p in "$@"; do
  case $p in
    tests) part tests 220 python3 -m pytest -q -m gpu tests -n 8 -p no:cacheprovider ;;
    bridge) part bridge 330 python3 benchmarks/torch_bridge.py --out $R/torch_bridge.jsonl ;;
    bridge-loss) part bridge-loss ${BRIDGE_S:-240} python3 benchmarks/torch_bridge.py --op loss \
        ${LOSS_PROVIDERS:+--providers $LOSS_PROVIDERS} --out $R/torch_bridge.jsonl ;;
    bridge-attn) part bridge-attn 200 python3 benchmarks/torch_bridge.py --op attention --out $R/torch_bridge.jsonl ;;
    train) part train ${TRAIN_S:-330} python3 benchmarks/train_step.py --config 1b --steps 5 --max-batch 96 --out $R/train_step.jsonl ;;
    train-search) part train-search ${TRAIN_S:-400} python3 benchmarks/train_step.py --config 1b --kernels memeff --steps 3 --search-from ${SEARCH_FROM:-48} --out $R/train_step.jsonl ;;
    fit) part fit ${FIT_S:-240} python3 benchmarks/remat_fit.py --config 1b --out $R/remat_fit.jsonl ;;
    breakdown) for c in ${CHUNKS:-512}; do
        part breakdown-$c 150 python3 benchmarks/lce_breakdown.py --chunk $c; done ;;
    branches) part branches 90 python3 benchmarks/branches.py --out $R/branches.jsonl ;;
    attention) for s in ${ATTN_SETS:-t-sweep d-sweep gqa packed}; do
        part attn-$s ${ATTN_S:-200} python3 benchmarks/flash_attention.py --set $s --out $R/flash_attention.jsonl; done ;;
  esac
done
echo "=== done ($(date +%T))"
