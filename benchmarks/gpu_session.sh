#!/usr/bin/env bash
# Everything the project measures on the lent GPU machine, by stage (its own torch; the wheels it lacks carried in
# .whl/ — see benchmarks/README.md). Stages run in the order given:
#   tests                 pytest -m cuda (recorder, optimiser replay, trainer, metrics), log to $OUT/results/pytest_cuda.log
#   NB.ipynb... notebooks every cell of those notebooks (run_notebooks.py), outputs saved at 1x, copied to $OUT
#   warm                  a tiny fit first: a fresh machine's first process reads every library from disk
#   ref<b>x<n>[@<k>]      reference_run.py: n alternating rounds of $ARMS (default native,step,ul) at batch b; @k numbers
#                         them from k and writes the part _r<k> (join the parts with reference_run.py --merge)
#   validation            validation_speed.py on the GPU ($VAL_ARGS; alternating with $BASELINE's post-processing if set)
#   memory                profile_fit.py memory: the reference fit's peaks epoch by epoch, native and whole step ($MEMORY_ARGS)
#   step<b>               profile_fit.py step at batch b, each arm of $STEP_ARMS (default native step)
#   startup               profile_fit.py startup: the seconds before the first step, by stage, under cProfile
#   learns                it_learns.py: 100 epochs from scratch on the 128 images (about 5 minutes on the H200), each arm of
#                         $LEARNS_ARMS at each seed of $LEARNS_SEEDS, side by side (default segment, 0; detect: the detector;
#                         segment@base: the library in $LUCID_NB_BASELINE, whose commit its file COMMIT names; ul-segment,
#                         ul-detect: Ultralytics' own trainer, its last.pt scored by lucid's COCOeval). A seed moves
#                         the result more than most changes do: compare libraries by the median over >= 5 seeds
#   hooks                 a 4-epoch fit under Lightning's SimpleProfiler (its report to $OUT/results)
# e.g. LUCID_NB_COMMIT=$(git rev-parse --short HEAD) ARMS=native,step,ul bash benchmarks/gpu_session.sh warm tests ref4x2@0
# .whl/ holds CPython 3.12 manylinux wheels of what that image lacks: pycocotools, ultrafast-pycocotools, jsonargparse,
# docstring-parser, typeshed-client, fastcore, nbdev, execnb, fastgit, ghapi, asttokens, astunparse, watchdog, and for
# the notebooks stage IPython with ipython-pygments-lexers, traitlets, decorator, jedi, parso, matplotlib-inline,
# pexpect, ptyprocess, prompt-toolkit, wcwidth, pygments, stack-data, executing, pure-eval.
# Results go to $OUT/results (copy them into benchmarks/results/). Export LUCID_NB_COMMIT=<commit> first: the copied
# tree's .git may be stale on that machine, and env_info() records this value.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null || exit 1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
LUCID='import sys; from lucid_nb.cli import main; sys.argv[0] = "lucid"; main()'   # the `lucid` command, as installed
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))"
status=0; nbs=()
for stage in "$@"; do case $stage in *.ipynb) nbs+=("$stage") ;; esac; done
for stage in "$@"; do
  t=$SECONDS
  case $stage in
    *.ipynb) continue ;;
    tests) python3 -m pytest -q -m cuda -p no:cacheprovider -W ignore tests/ > "$OUT/results/pytest_cuda.log" 2>&1 || status=1
           grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/results/pytest_cuda.log" | tail -12 ;;
    notebooks) python3 -c 'import IPython' 2>/dev/null || { echo "notebooks: IPython is not installed: add its wheels to .whl/ (see the header)"; status=1; continue; }
               python3 benchmarks/run_notebooks.py "${nbs[@]}" 2>&1 | grep -E "PASSED|FAILED|Error|error" | tail -20 || status=1
               cp "${nbs[@]}" "$OUT/" ;;
    warm) python3 -c "$LUCID" fit --config configs/coco128-seg-n.yaml \
            --trainer.max_steps 2 --trainer.limit_val_batches 1 --trainer.logger false --trainer.enable_progress_bar false \
            --trainer.default_root_dir /tmp/warm > /dev/null 2>&1 || status=1 ;;
    ref*) b=${stage#ref}; b=${b%%x*}; n=${stage#*x}; part=()
          case $n in *@*) first=${n#*@}; n=${n%@*}; part=(--first-round "$first" --part "r$first") ;; esac
          python3 benchmarks/reference_run.py --rounds "$n" --batch-size "$b" --arms "${ARMS:-native,step,ul}" \
            "${part[@]}" --out "$OUT/results" 2>&1 | grep -E "^round|->|Error|error" || status=1 ;;
    validation) python3 benchmarks/validation_speed.py --device cuda ${VAL_ARGS:-} ${BASELINE:+--baseline "$BASELINE"} \
                  --out "$OUT/results" 2>&1 | tail -8 || status=1 ;;
    memory) for arm in native step; do
              python3 benchmarks/profile_fit.py memory --out "$OUT/results" --tag "$arm" -- \
                $([ $arm = step ] && echo --model.capture_train_step true) ${MEMORY_ARGS:-} 2>&1 | grep -E "peak reserved|Error|error" || status=1
            done ;;
    step*) for arm in ${STEP_ARMS:-native step}; do
             python3 benchmarks/profile_fit.py step --batch-size "${stage#step}" --arm "$arm" --out "$OUT/results" 2>&1 | grep -E "total|->|Error|error" || status=1
           done ;;
    startup) python3 benchmarks/profile_fit.py startup --out "$OUT/results" 2>&1 | grep -E " s$|->" || status=1 ;;
    learns) pids=()   # the arms of $LEARNS_ARMS side by side (mostly CPU-bound: loader and COCOeval)
            for arm in ${LEARNS_ARMS:-segment}; do for seed in ${LEARNS_SEEDS:-0}; do
              task=${arm%@base} pp=$PYTHONPATH commit=$LUCID_NB_COMMIT tag= lib=lucid
              case $task in ul-*) task=${task#ul-} lib=ultralytics ;; esac
              if [ "${arm%@base}" != "$arm" ]; then   # the library in $LUCID_NB_BASELINE (its commit in COMMIT there), the data of this checkout
                [ -e "$LUCID_NB_BASELINE/lucid_nb/embedded" ] || ln -s "$PWD/lucid_nb/embedded" "$LUCID_NB_BASELINE/lucid_nb/embedded"
                pp=$LUCID_NB_BASELINE:$PYTHONPATH commit=$(cat "$LUCID_NB_BASELINE/COMMIT" 2>/dev/null || echo base) tag=base
              fi
              PYTHONPATH=$pp LUCID_NB_COMMIT=$commit python3 benchmarks/it_learns.py --out "$OUT/results" --task "$task" --tag "$tag" --library "$lib" \
                --seed "$seed" > "$OUT/results/it_learns_${arm/@/_}_$seed.log" 2>&1 & pids+=($!)
            done; done
            for pid in "${pids[@]}"; do wait "$pid" || status=1; done
            for arm in ${LEARNS_ARMS:-segment}; do for seed in ${LEARNS_SEEDS:-0}; do
              echo "$arm seed $seed: $(tail -n 1 "$OUT/results/it_learns_${arm/@/_}_$seed.log")"; done; done ;;
    hooks) python3 -c "$LUCID" fit --config configs/coco128-seg-n.yaml \
             --trainer.max_epochs 4 --trainer.enable_progress_bar false --trainer.default_root_dir /tmp/hooks \
             --trainer.profiler '{"class_path": "lightning.pytorch.profilers.SimpleProfiler", "init_args": {"dirpath": "'"$OUT/results"'", "filename": "simple_profiler"}}' \
             > "$OUT/results/hooks.log" 2>&1 || status=1
           ls "$OUT/results" | grep simple_profiler ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
  echo "== $stage: $((SECONDS - t)) s"
done
exit $status
