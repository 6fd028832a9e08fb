# Session 30, second device call: dq_ordered with the memory warpgroup sending dQ (its bitwise
# test fixed to the reference's cotangents, and its features suite), then onepass_ordered.py at
# the headline, both masks; the ordered variants only if the bitwise test finished.
TEST_GROUPS="ordered_backward_is_bitwise;TestMosaicGpuOrderedDq and not D256" TEST_S=${TEST_S:-170} \
  GATE="ordered_backward_is_bitwise: .*in [0-9.]*s" \
  NC="arrival,ordered,no waits,no landing wait,pair" CA="arrival,ordered,pair" \
  SAFE_NC="arrival,pair" SAFE_CA="arrival,pair" NC_S=210 CA_S=150 \
  bash "$(dirname "$0")/ordered_tests_then_time.sh"
