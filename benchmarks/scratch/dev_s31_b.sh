# Session 31 (written in session 30): is the ordered one-pass kernel (a CTA per key head
# looping over its query heads) worth a `_gqa_ordered` section? onepass_ordered.py at
# B=4 T=4096 Hq/Hkv=32/8 D=128, both masks: arrival (the tuned GQA kernel, a CTA per query
# head), ordered, and the pair that GQA calls run today. Then `d128[_causal]_gqa_ordered`
# if ordered beats the pair.
. "$(dirname "$0")/../device_env.sh"
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for c in "" "--causal"; do
  timeout -k 5 ${LIMIT_S:-240} python3 benchmarks/scratch/onepass_ordered.py --rounds 3 \
    --kv-heads 8 --variants "${VARIANTS:-arrival,ordered,pair}" $c 2>&1 \
    | grep -v -i -E "warn|^$" | tee $OUT/gqa$c.log
done
