# Headline with every peer, then a sweep of the Triton backward's tiles (fwd+bwd minus fwd).
. "$(dirname "$0")/../device_env.sh"
echo "=== headline $(date +%T)"
timeout 250 python3 benchmarks/flash_attention.py --set headline --out $OUT/results/flash_attention.jsonl \
  --providers memeff,memeff:pallas_triton,cudnn,tokamax:mosaic,tokamax:triton,xla 2>&1 | grep TFLOP | tee $OUT/headline.log
echo "=== sweep $(date +%T)"
P=""
for c in 64:128:8:2 128:64:8:2 64:64:4:3 128:128:8:2 64:128:4:2 32:128:4:2; do
  IFS=: read bq bk w s <<< "$c"
  P="$P,memeff:pallas_triton:bwd_block_q=$bq:bwd_block_k=$bk:bwd_num_warps=$w:bwd_num_stages=$s"
done
timeout 250 python3 benchmarks/flash_attention.py --set headline --out $OUT/sweep.jsonl --providers ${P#,} 2>&1 | grep TFLOP | tee $OUT/sweep.log
echo "=== done $(date +%T)"
