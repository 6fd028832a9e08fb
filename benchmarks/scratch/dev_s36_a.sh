# Session 36: dq_stagger (the compute warpgroups half a step apart). Its GPU tests, then the
# headline fwd+bwd against the deterministic default, both masks, with ptxas's spill report.
. "$(dirname "$0")/../device_env.sh"
# TGROUPS: pytest -k expressions separated by ';'.
IFS=';' read -ra groups <<< "${TGROUPS:-staggered;TestMosaicGpuOrderedDqStagger}"
gpu_test_groups ${TEST_S:-200} "${groups[@]}"
# The two bwd_config_ab runs through dev_s36_c.sh (its AB list).
AB="noncausal ${VARIANTS_NC:-dq_stagger=true};causal --causal ${VARIANTS_C:-fused_delta=false dq_stagger=true,fused_delta=false}" \
  AB_S=${AB_S:-170} TAIL=${TAIL:-10} bash "$(dirname "$0")/dev_s36_c.sh"
