# Session 31 (written in session 30): dq_ordered's send warp, two dQ slots and rotated walks
# (their bitwise test and features suite), then onepass_ordered.py at the headline, both
# masks; the ordered variants only if the bitwise test finished.
TEST_GROUPS="ordered_backward_is_bitwise and send_warp;TestMosaicGpuOrderedDqSendWarp" \
  TEST_S=${TEST_S:-190} GATE="ordered_backward_is_bitwise and send_warp: .*in [0-9.]*s" \
  NC="arrival,ordered,send warp,send warp+two slots,all+rotate,pair" \
  CA="arrival,ordered,send warp+two slots,pair" \
  SAFE_NC="arrival,pair" SAFE_CA="arrival,pair" NC_S=240 CA_S=150 \
  bash "$(dirname "$0")/ordered_tests_then_time.sh"
