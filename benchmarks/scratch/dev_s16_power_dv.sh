# Session 16: power and clock of the floor, the default loss (cuBLAS, "dv" 1,024) and the
# all-Mosaic loss (0.245 GiB) under sustained load: energy per call = power x time.
. "$(dirname "$0")/../device_env.sh"
. "$(dirname "$0")/power_sample.sh"
export LCE_LAYOUT=dv REPS=40
{
sample floor floor 1024
sample memeff default 1024
sample memeff all-mosaic 1024 LCE_GEMMS=logits+dx+dw LCE_DW=tma_add LCE_FUSED_LSE=1
sample floor floor 1024
} 2>&1 | tee $OUT/power-dv.log
