#!/usr/bin/env bash
# One prepared run of every GPU check of issues 38 and 40, for a machine with a CUDA GPU
# that has torch but maybe not Pyro (the project's lent H100 or H200: under 10 minutes).
#
#   bash benchmarks/gpu_session.sh [CARRY]        # from the repository root
#
# CARRY (default .gpu_carry, a folder that .git/info/exclude ignores) holds what the
# machine lacks: wheels/ (pyro-ppl and pyro-api: pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d
# CARRY/wheels pyro-ppl pyro-api) and data/ (a PYRO_TREES_DATA cache holding
# mnist/, uci/kin40k/ and, for the bhme_vb part, kin8nm/, copied from ../shared/data).
# Results go to $OUT (default
# /tmp/gpu_out, at most 8 files as the device tool returns them): log.txt (the card, each
# part's exit and seconds, the tail of its output) and one NAME.tar a part with the
# result files it wrote, as soon as it ends (step_cost, device_fits, TreeVI's start stage
# at 70,000 images with the protocol's pretraining and with the Glorot + layer-wise
# recipe). Each part has its own time limit and a failure does not stop the next part.
# PARTS (default: all five) names the parts to run, e.g. PARTS="cuda_tests step_cost";
# BACKGROUND names parts that run beside the ones after them (by default the two TreeVI
# parts, whose ACC does not depend on it, run beside the CUDA tests; their seconds per
# epoch then share the card). GPU=0 runs them on the CPU at smoke sizes (to check the
# script: about 3 minutes).
set -uo pipefail
PARTS=${PARTS:-step_cost device_fits treevi_start treevi_recipes cuda_tests}
BACKGROUND=${BACKGROUND-treevi_start treevi_recipes}
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

run_part() {  # run_part NAME SECONDS RESULTS COMMAND...: run, keep the tail of its output,
    local name=$1 limit=$2 results=$3 start=$SECONDS  # note the time, archive RESULTS
    shift 3
    timeout "$limit" "$@" >"/tmp/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s" | tee -a "$out/log.txt"
    tail -c 12000 "/tmp/$name.log" >>"$out/log.txt"
    # shellcheck disable=SC2086  # RESULTS is a glob
    [ -z "$results" ] || tar -cf "$out/$name.tar" $results 2>/dev/null
}

part() {  # part NAME SECONDS RESULTS COMMAND...: run_part when PARTS names it (in the
    case " $PARTS " in  # background when BACKGROUND names it too)
        *" $1 "*) ;;
        *) return ;;
    esac
    case " $BACKGROUND " in
        *" $1 "*) run_part "$@" & ;;
        *) run_part "$@" ;;
    esac
}

res=benchmarks/results
# ms, kernels, syncs and busy share per step, eager and compiled (issue 38, item 6)
part step_cost 180 "$res/variants/step_cost_cuda.*" python3 -m benchmarks.step_cost \
    --device "$device" --families vart,vart_forest,vart_classification,hme,heteroscedastic_gp \
    --rows "$rows" \
    --threads 1 --modes "$modes" --name step_cost_cuda
# TreeVI's and the deep GP's tensor-program losses against their traced ones (not in the
# default PARTS: about 3 minutes; PARTS="... step_cost_programs" adds it)
part step_cost_programs 180 "$res/variants/step_cost_programs_cuda.*" python3 -m benchmarks.step_cost \
    --device "$device" --families treevi,treevi_program,deep_gp,deep_gp_program \
    --rows "$rows" --threads 1 --modes "$modes" --name step_cost_programs_cuda
# the Bayesian HME's VB search, eager and compiled (not in the default PARTS: about 4
# minutes; PARTS="... bhme_vb" adds it)
part bhme_vb 300 "$res/variants/bhme_vb_compiled_cuda.*" python3 -m benchmarks.bhme_vb_compiled \
    --device "$device" --name bhme_vb_compiled_cuda
# every estimator at 400 rows on both devices; the forest on kin40k
kin40k=--kin40k
[ "${GPU:-1}" = 1 ] || kin40k=
part device_fits 140 "$res/device_fits.*" python3 -m benchmarks.device_fits \
    --rows "$fit_rows" $kin40k
# TreeVI's start at 70,000 images: pretraining seconds per epoch and ACC (issue 40), with
# the protocol's pretraining and after a Glorot start and layer-wise pretraining
part treevi_start 200 "$res/variants/treevi_start_gpu.*" python3 -m benchmarks.treevi_clustering \
    --stage start --seeds 1 --device "$device" --num-images "$images" \
    --ae-epochs "$ae_epochs" --name treevi_start_gpu
part treevi_recipes 260 "$res/variants/treevi_start_gpu_layerwise.*" \
    python3 -m benchmarks.treevi_clustering --stage start --seeds 1 --device "$device" \
    --num-images "$images" --ae-epochs "$ae_epochs" --ae-init glorot \
    --ae-layerwise-epochs "$ae_epochs" --name treevi_start_gpu_layerwise
# the GPU contract (estimators, Pyro pairs, compiled losses on CUDA); 150 s was too short
# on an H200 beside the TreeVI parts (its first run was cut there), and the slowest tests
# are listed so that the next run can be planned
part cuda_tests 240 "" python3 -m pytest -q -p no:cacheprovider --durations=15 -m cuda tests
wait  # for the background parts
ls "$out"
