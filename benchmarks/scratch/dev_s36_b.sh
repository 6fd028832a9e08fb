# Session 36: dq_stagger with turns as the non-causal ordered default: its GPU tests
# (TGROUPS, ';'-separated), then ncu's warp-stall samples per SASS instruction of the new
# default backward (dev_s35_f.sh) unless NCU=0.
. "$(dirname "$0")/../device_env.sh"
IFS=';' read -ra groups <<< "${TGROUPS:-TestMosaicGpuOrderedDqStagger;staggered_dq_gives and True and persistent;TestMosaicGpuFeaturesDeterministic and not D64 and not D256}"
gpu_test_groups ${TEST_S:-280} "${groups[@]}"
[ "${NCU:-1}" = 1 ] && bash benchmarks/scratch/dev_s35_f.sh
true
