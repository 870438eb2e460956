#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with a CUDA GPU (CI has none; a lent GPU machine
# runs this): install mpitree over the machine's own torch/CuPy/JAX, run every cuda-marked
# test at 1, 2 and 3 ranks sharing the GPU, then benchmarks/gpu_decode.py (1 and 2 ranks,
# batch 4 with kv_len, float32).
# Wheels the machine lacks (mpi4py and the mpich wheel, mpi-pytest, setuptools, transformers)
# may wait in .whl/ when it cannot reach PyPI. Logs go to $OUT (default /tmp/gpu-check).
#
#     bash tests/gpu_check.sh [benchmark tokens, default 131072]
#
# SELECT=<pytest -k expression> narrows the tests (default: cuda); BENCH=0 skips the benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tokens=${1:-131072}
py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
if compgen -G ".whl/*.whl" >/dev/null; then
    $py -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || exit 1
fi
if ! $py -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    tail -20 "$OUT/install.log"
    exit 1
fi
$py - <<'EOF' || exit 1
import importlib, mpi4py, torch
from mpi4py import MPI
import mpitree
from mpitree import extend
print("python", __import__("sys").version.split()[0], "| mpitree", mpitree.__version__,
      "| mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("cupy", "jax", "transformers", "flash_attn"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "unavailable:", type(exc).__name__, str(exc)[:120])
print("native op:", mpitree.native_op_available(), "| kernel ISA:", extend.tools.kernel_isa())
EOF
status=0
echo "== cuda-marked tests, 1, 2 and 3 ranks"
timeout 270 $py tests/run.py --nprocs 1,2,3 --leg-timeout 150 -k "${SELECT:-cuda}" \
    tests/test_cuda_mpi.py tests/test_torch_mpi.py tests/test_cupy_mpi.py \
    tests/test_flash_attn_mpi.py tests/test_triton_decode.py tests/test_triton_mpi.py \
    tests/test_device_node_mpi.py tests/test_nccl_mpi.py tests/test_plan_graph_mpi.py \
    tests/test_static_cache_mpi.py \
    >"$OUT/tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)|^E  |mpitree tests:" "$OUT/tests.log" | cut -c1-400 | head -60
bench() {
    echo "== $*"
    timeout 60 "$@" 2>&1 | tee -a "$OUT/bench.log" | tail -12 || status=1
}
[ "${BENCH:-1}" = 0 ] && exit $status
bench $py benchmarks/gpu_decode.py --tokens "$tokens" --profile
bench mpiexec -n 2 $py benchmarks/gpu_decode.py --tokens $((tokens / 2))
bench $py benchmarks/gpu_decode.py --tokens $((tokens / 4)) --batch 4 --kv-len
bench $py benchmarks/gpu_decode.py --tokens "$tokens" --dtype float32
exit $status
