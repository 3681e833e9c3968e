# Sourced at the start of every device command: makes this checkout importable as `fleetscope`
# without network access (carried wheels, a namespace-package link tree) and keeps NVLink
# multicast off.
set -u
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
repo="$(pwd)"
mkdir -p /tmp/fsroot/fleetscope
for package in cli launcher trainer traces analysis; do
  ln -sfn "$repo/$package" "/tmp/fsroot/fleetscope/$package"
done
export PYTHONPATH="/tmp/fsroot:/tmp/site:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
