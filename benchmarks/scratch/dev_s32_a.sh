# Session 32 (written in session 31): dq_convert's first GPU run. Its bitwise tests (call to
# call, and against the float32 path) and features suite, then onepass_ordered.py at the
# headline, both masks: today's defaults against the same with dq_convert, and with one
# slot (send warp+rotate); the converted variants only if the bitwise test finished (a
# deadlock would eat the call).
TEST_GROUPS="ordered_backward_is_bitwise and convert;converted_dq_is;TestMosaicGpuOrderedDqConvert" \
  TEST_S=${TEST_S:-180} GATE="ordered_backward_is_bitwise and convert: .*in [0-9.]*s" \
  NC="arrival,all+rotate,all+rotate+convert,send warp+rotate,send warp+rotate+convert" \
  CA="arrival,all+rotate,all+rotate+convert" \
  SAFE_NC="arrival,all+rotate" SAFE_CA="arrival,all+rotate" NC_S=220 CA_S=130 \
  bash "$(dirname "$0")/ordered_tests_then_time.sh"
