# Sourced by the test drivers' build.sh (it/grpc-driver, it/remoting-driver, it/go-driver): the cache they share.
# A driver is built into a directory under $HOME/.cache/popgate (never inside the repository) and reused while the
# content hash of its inputs (not their mtimes, so a fresh checkout does not rebuild needlessly) is the one stamped
# beside it. One build at a time per directory, also when several test binaries ask at once.

# "<name>  <sha256>" for each file named on stdin (paths relative to the current directory).
file_hashes() {
  while read -r f; do
    printf '%s  ' "$f"; sha256sum < "$f"
  done
}

# Prints ARTIFACT and exits when STAMP says it was built from inputs hashed WANT (and FORCE is empty); otherwise
# returns holding the build lock of STAMP's directory (fd 9), with the stamp removed: the caller builds, then
# writes WANT to STAMP.
reuse_or_lock() {
  local artifact="$1" stamp="$2" want="$3" force="$4"
  # A stamp may go between the test and the read: another caller is rebuilding.
  up_to_date() { [[ -z "$force" && -f "$artifact" && "$(cat "$stamp" 2>/dev/null)" == "$want" ]]; }
  if up_to_date; then
    echo "$artifact"
    exit 0
  fi
  exec 9>"$(dirname "$stamp")/.build.lock"
  flock 9
  # Another caller may have built it while this one waited for the lock.
  if up_to_date; then
    echo "$artifact"
    exit 0
  fi
  rm -f "$stamp"
}
