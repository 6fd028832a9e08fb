# Session 33: dev_s33_d.sh again with the unseen step run apart, before the walk (the branch
# around the full step made the ordered causal kernel 18% slower).
. "$(dirname "$0")/dev_s33_d.sh"
