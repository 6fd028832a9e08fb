# Session 30, first device call: dq_ordered's first GPU run. Its bitwise test and features
# suite (two pytest processes), then onepass_ordered.py at the headline, both masks; the
# ordered variants are timed only if the bitwise test passed (a hang would eat the call).
TEST_GROUPS="ordered_backward_is_bitwise;TestMosaicGpuOrderedDq and not D256" TEST_S=${TEST_S:-190} \
  GATE="ordered_backward_is_bitwise: .*passed" \
  NC="arrival,ordered,wait first,late release,pair" CA="arrival,ordered,pair" \
  SAFE_NC="arrival,no waits,pair" SAFE_CA="arrival,pair" NC_S=200 CA_S=160 \
  bash "$(dirname "$0")/ordered_tests_then_time.sh"
