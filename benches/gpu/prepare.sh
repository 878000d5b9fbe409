#!/usr/bin/env bash
# Builds, on this machine, what benches/gpu/run.sh runs on a lent GPU machine (which has no Rust
# toolchain and no network): rollout-relay's test binaries with the NCCL feature, copied into
# .gpu/ (ignored by git; name it in the device call's `carry`).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cargo test -p rollout-relay --features nccl --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl":
        shutil.copy(m["executable"], ".gpu/relay-nccl-tests")
        print("copied", m["executable"], "to .gpu/relay-nccl-tests")
'
test -x .gpu/relay-nccl-tests
# Debug info is not needed there, and everything carried counts towards the 64 MiB a call takes.
strip .gpu/relay-nccl-tests && ls -l .gpu/relay-nccl-tests
