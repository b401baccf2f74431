# Sourced by the GPU run scripts (tests/gpu/run_one_gpu.sh, tests/multi_gpu/device_env.sh):
# guarded SECONDS CMD... runs CMD under `timeout` (which makes itself a process-group leader),
# then kills whatever is left of that group -- emulators, daemons or trainers of a test that
# timed out or exited early -- and returns CMD's exit status.
guarded() {
  local t=$1
  shift
  timeout "$t" "$@" &
  local pid=$!
  wait "$pid"
  local rc=$?
  kill -KILL -- -"$pid" 2>/dev/null
  return "$rc"
}
