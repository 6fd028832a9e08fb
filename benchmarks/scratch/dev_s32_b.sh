# Session 32: dq_interleave's first GPU run. Its bitwise test (call to call, and the
# reference's gradients; three causal/dense/window calls), then onepass_ordered.py causal at
# the headline: today's causal default (send warp+two slots) against it with 2-16 heads
# interleaved, arrival order for scale; the interleaved ones only if the test finished.
. "$(dirname "$0")/../device_env.sh"
TEST_GROUPS="ordered_backward_is_bitwise and interleave" TEST_S=${TEST_S:-150} \
  GATE="ordered_backward_is_bitwise and interleave: [0-9]* passed" \
  NC="send warp+rotate" SAFE_NC="send warp+rotate" NC_S=${NC_S:-1} \
  CA="arrival,send warp+two slots,send warp+two slots+interleave 4,send warp+two slots+interleave 8,send warp+two slots+interleave 16" \
  SAFE_CA="send warp+two slots" CA_S=${CA_S:-300} \
  bash "$(dirname "$0")/ordered_tests_then_time.sh"
