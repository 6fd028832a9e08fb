# The loss with XLA Triton GEMMs instead of cuBLAS (lce_xla_gemms.py), one process per
# variant: XLA's in-process autotuning cache ignores compiler options, so a variant after a
# cuBLAS one would reuse its choice. VARIANTS: ';'-separated JSON lists of [layout, chunk,
# options]; a variant may start with "ENV=value " for process-wide XLA_FLAGS.
. "$(dirname "$0")/../device_env.sh"
unset JAX_COMPILATION_CACHE_DIR
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
IFS=';' read -ra VS <<< "$VARIANTS"
for v in "${VS[@]}"; do
  flags=; case "$v" in XLA_FLAGS=*) flags=${v%% \[*}; flags=${flags#XLA_FLAGS=}; v="[${v#* \[}";; esac
  echo "=== $flags $v"
  XLA_FLAGS="$flags" timeout ${XLA_GEMMS_S:-150} python3 benchmarks/scratch/lce_xla_gemms.py "[$v]" 2>&1 \
    | grep -v -i -E "warning|^\s*$" | tail -20
done | tee $OUT/xla_gemms.log
