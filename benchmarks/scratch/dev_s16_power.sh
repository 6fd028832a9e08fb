# Session 16: power draw and SM clock while the light setting, the floor and Liger-Kernel
# run back to back ("vd", 512-token chunks): is the loss at the power cap? (The floor needs
# W as [D, V]: run with "dv" in dev_s16_power_dv.sh.)
. "$(dirname "$0")/../device_env.sh"
. "$(dirname "$0")/power_sample.sh"
export REPS=40
{
sample memeff light 512 LCE_GEMMS=logits+dx+dw LCE_DW=tma_add LCE_FUSED_LSE=1 LCE_LAYOUT=vd
sample liger liger 512
} 2>&1 | tee $OUT/power.log
