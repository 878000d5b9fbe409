#!/usr/bin/env bash
# What cudarc and NCCL can show on one GPU, in one command on a lent GPU machine, well within
# 10 minutes. Prepare here first (bash benches/gpu/prepare.sh), then run there with `.gpu`
# carried: bash benches/gpu/run.sh. Writes gpu.log to $OUT (or ./.gpu/out).
#
# 1. nvidia-smi; 2. libnccl from the machine's PyTorch (nvidia-nccl wheel: libnccl.so.2 only,
# so a libnccl.so link for cudarc is made in a temporary directory); 3. the relay's NCCL tests:
# the no-GPU refusal must now find the GPU, the one-rank communicator broadcasts on device 0,
# and the two-GPU broadcast reports that it needs a second device.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-.gpu/out}"
mkdir -p "$out"
exec > >(tee "$out/gpu.log") 2>&1
echo "== $(date -u +%FT%TZ) $(uname -m)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi failed"
nccl_dir="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
if [ -z "$nccl_dir" ] || [ ! -e "$nccl_dir/libnccl.so.2" ]; then
  nccl_dir="$(dirname "$(ldconfig -p | awk '/libnccl.so.2/ {print $NF; exit}')" 2>/dev/null)"
fi
echo "== libnccl.so.2 from: ${nccl_dir:-none found}"
links="$(mktemp -d)"
[ -n "$nccl_dir" ] && ln -sf "$nccl_dir/libnccl.so.2" "$links/libnccl.so"
export LD_LIBRARY_PATH="$links${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ ! -x .gpu/relay-nccl-tests ]; then
  echo "no .gpu/relay-nccl-tests: run benches/gpu/prepare.sh here and carry .gpu"; exit 2
fi
echo "== relay NCCL tests (one GPU)"
timeout 300 .gpu/relay-nccl-tests --include-ignored --nocapture --test-threads 1
status=$?
echo "== exit $status"
exit $status
