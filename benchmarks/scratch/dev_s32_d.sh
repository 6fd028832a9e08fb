# Session 32: the persistent backward's first GPU run. Its bitwise tests (several key blocks
# per CTA; rotated walks on 16 CTAs) and features suites (ordered and arrival order, seven
# CTAs), then onepass_ordered.py at the headline against today's grids, both masks, only if
# the bitwise test passed (a deadlock would eat the call).
TEST_GROUPS="ordered_backward_is_bitwise and persistent;TestMosaicGpuPersistent and not Arrival;TestMosaicGpuPersistentArrival" \
  TEST_S=${TEST_S:-200} GATE="ordered_backward_is_bitwise and persistent: [0-9]* passed" \
  NC="arrival,all+rotate,arrival+persistent,all+rotate+persistent" \
  CA="arrival,send warp+two slots,arrival+persistent,send warp+two slots+persistent" \
  SAFE_NC="arrival" SAFE_CA="arrival" NC_S=${NC_S:-130} CA_S=${CA_S:-120} \
  bash "$(dirname "$0")/ordered_tests_then_time.sh"
