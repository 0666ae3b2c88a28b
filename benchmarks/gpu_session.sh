#!/usr/bin/env bash
# One prepared run of every GPU check of issues 38 and 40, for a machine with a CUDA GPU
# that has torch but maybe not Pyro (the project's lent H100: about 9 minutes there).
#
#   bash benchmarks/gpu_session.sh [CARRY]        # from the repository root
#
# CARRY (default .gpu_carry, a folder that .git/info/exclude ignores) holds what the
# machine lacks: wheels/ (pyro-ppl and pyro-api: pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d
# CARRY/wheels pyro-ppl pyro-api) and data/ (a PYRO_TREES_DATA cache holding
# mnist/ and uci/kin40k/, copied from ../shared/data). Results go to $OUT (default
# /tmp/gpu_out, at most 8 files as the device tool returns them): log.txt (the card, each
# part's exit and seconds, the tail of its output) and the results of step_cost,
# device_fits and TreeVI's start stage at 70,000 images (.md and .json). Each part has its own time limit and a failure does not stop
# the next part; PARTS (default: the first four) names the parts to run, e.g.
# PARTS="cuda_tests step_cost"; PARTS=treevi_recipes runs the fifth alone. GPU=0 runs them on the CPU at smoke sizes (to check the script: 2 minutes).
set -uo pipefail
carry=${1:-.gpu_carry}
out=${OUT:-/tmp/gpu_out}
mkdir -p "$out"
if ! python3 -c "import pyro" 2>/dev/null; then
    site=$(mktemp -d)
    pip install -q --no-index --no-deps --target "$site" "$carry"/wheels/*.whl
    python3 -m compileall -q "$site"  # else pytest's warnings-as-errors trips on pyro
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYRO_TREES_DATA=${PYRO_TREES_DATA:-$carry/data}
if [ "${GPU:-1}" = 1 ]; then
    device=cuda rows=16384,131072 modes=eager,compiled fit_rows=400 images=0 ae_epochs=10
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$out/log.txt"
else
    device=cpu rows=64 modes=eager fit_rows=40 images=500 ae_epochs=1
fi
python3 -c "import torch, pyro; print('torch', torch.__version__, 'pyro', pyro.__version__)" \
    >>"$out/log.txt"

part() {  # part NAME SECONDS COMMAND...: run, keep the tail of its output, note the time
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    case " ${PARTS:-cuda_tests step_cost device_fits treevi_start} " in
        *" $name "*) ;;
        *) return ;;
    esac
    timeout "$limit" "$@" >"/tmp/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s" | tee -a "$out/log.txt"
    tail -c 12000 "/tmp/$name.log" >>"$out/log.txt"
}

# the GPU contract (estimators, Pyro pairs, compiled losses on CUDA)
part cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda tests
# ms, kernels, syncs and busy share per step, eager and compiled (issue 38, item 6)
part step_cost 200 python3 -m benchmarks.step_cost --device "$device" \
    --families vart,vart_forest,vart_classification,hme --rows "$rows" --threads 1 \
    --modes "$modes" --name step_cost_cuda
# every estimator at 400 rows on both devices; the forest on kin40k
kin40k=--kin40k
[ "${GPU:-1}" = 1 ] || kin40k=
part device_fits 150 python3 -m benchmarks.device_fits --rows "$fit_rows" $kin40k
# TreeVI's start at 70,000 images: pretraining seconds per epoch and ACC (issue 40)
part treevi_start 120 python3 -m benchmarks.treevi_clustering --stage start --seeds 1 \
    --device "$device" --num-images "$images" --ae-epochs "$ae_epochs" --name treevi_start_gpu
# not in the default PARTS (run it alone, PARTS=treevi_recipes, to stay within 8 files):
# the same start after a Glorot start and 10 epochs a layer of layer-wise pretraining
part treevi_recipes 300 python3 -m benchmarks.treevi_clustering --stage start --seeds 1 \
    --device "$device" --num-images "$images" --ae-epochs "$ae_epochs" --ae-init glorot \
    --ae-layerwise-epochs "$ae_epochs" --name treevi_start_gpu_layerwise
cp benchmarks/results/variants/step_cost_cuda.* benchmarks/results/device_fits.* \
    benchmarks/results/variants/treevi_start_gpu.* \
    benchmarks/results/variants/treevi_start_gpu_layerwise.* "$out"/ 2>/dev/null
ls "$out"
