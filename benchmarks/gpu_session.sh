#!/usr/bin/env bash
# Everything the project measures on the lent GPU machine, by stage (its own torch; the wheels it lacks carried in
# .whl/, Ultralytics' comparator in .ulcmp/ — see benchmarks/README.md):
#   bash benchmarks/gpu_session.sh tests                 # pytest -m cuda: recorder, optimiser replay, metrics, no-sync step
#   bash benchmarks/gpu_session.sh notebooks NB...       # every cell of the notebooks, outputs saved at 1x, copied to $OUT
#   bash benchmarks/gpu_session.sh validation            # benchmarks/validation_speed.py on the GPU (A/B vs $BASELINE)
#   bash benchmarks/gpu_session.sh exit                  # exit_time.py: a 1-epoch reference fit, quick and ordinary exit
#   bash benchmarks/gpu_session.sh memory startup        # memory_probe.py, profile_startup.py
#   bash benchmarks/gpu_session.sh ref4x3                # reference_run.py: 3 rounds of native, head+optim, ul at batch 4
#   bash benchmarks/gpu_session.sh warm ref4x2@3         # a tiny fit first (loads every library), then rounds 3 and 4 of a split
#                                                        # series (part file _<LUCID_NB_COMMIT>_r3, so parts of different
#                                                        # libraries never share a name; join with --merge)
#   bash benchmarks/gpu_session.sh lean hooks            # startup_lean.py; a 4-epoch fit under Lightning's SimpleProfiler
#   bash benchmarks/gpu_session.sh importgc             # import_gc.py: start-up to a built Trainer, collector on / paused (GPU config)
#   AB_ARGS='--arm cf82686 --arm HEAD ...' bash benchmarks/gpu_session.sh ab   # postprocess_ab.py: post-processing arms alternating
#   MEPOCHS_TAG=step_g27 MEPOCHS_ARGS='--model.capture_train_step true --model.val_group_pixels 134217728' \
#     bash benchmarks/gpu_session.sh mepochs             # memory_epochs.py: a reference fit's peaks epoch by epoch and what
#                                                        # the allocator holds at each validation's start
#   bash benchmarks/gpu_session.sh vparts                # validation_parts.py: a 6-epoch fit, its validation split by part,
#                                                        # one validation under torch.profiler (host vs kernel time)
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
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))"
status=0; nbs=()
for stage in "$@"; do case $stage in *.ipynb) nbs+=("$stage") ;; esac; done
for stage in "$@"; do
  t=$SECONDS
  case $stage in
    *.ipynb) continue ;;
    tests) python3 -m pytest -q -m cuda -p no:cacheprovider -W ignore tests/test_recorder_cuda.py tests/test_optim.py \
             tests/test_trainer_cuda.py tests/test_metrics.py > "$OUT/results/pytest_cuda.log" 2>&1 || status=1
           grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/results/pytest_cuda.log" | tail -12 ;;
    notebooks) python3 -c 'import IPython' 2>/dev/null || { echo "notebooks: IPython is not installed: add its wheels to .whl/ (see the header)"; status=1; continue; }
               python3 benchmarks/run_notebooks.py "${nbs[@]}" 2>&1 | grep -E "PASSED|FAILED|Error|error" | tail -20 || status=1
               cp "${nbs[@]}" "$OUT/" ;;
    validation) python3 benchmarks/validation_speed.py --device cuda --baseline "${BASELINE:-7a13c73}" --out "$OUT/results" 2>&1 | tail -8 || status=1 ;;
    exit) for fast in 1 0; do
            LUCID_NB_FAST_EXIT=$fast python3 benchmarks/exit_time.py --runs 3 --tag "$([ $fast = 0 ] && echo _ordinary_exit)" \
              --out "$OUT/results" -- --config configs/coco128-seg-n.yaml --trainer.max_epochs 1 2>&1 | tail -3 || status=1
          done ;;
    memory) python3 benchmarks/memory_probe.py --out "$OUT/results" 2>&1 | grep -A3 '"peaks"' || status=1
            python3 benchmarks/memory_probe.py --out "$OUT/results" --tag step -- --model.capture_train_step true 2>&1 \
              | grep -A3 '"peaks"' || status=1 ;;
    startup) python3 benchmarks/profile_startup.py --out "$OUT/results" 2>&1 | grep " s$" || status=1 ;;
    warm) python3 -c 'import sys; from lucid_nb.cli import main; sys.argv[0] = "lucid"; main()' fit --config configs/coco128-seg-n.yaml \
            --trainer.max_steps 2 --trainer.limit_val_batches 1 --trainer.logger false --trainer.enable_progress_bar false \
            --trainer.default_root_dir /tmp/warm > /dev/null 2>&1 || status=1 ;;   # a fresh machine's first process reads every library from disk
    importgc) python3 benchmarks/import_gc.py --rounds "${IMPORTGC_ROUNDS:-5}" --config configs/coco128-seg-n.yaml \
                --out "$OUT/results" 2>&1 | grep -E "imports|Error|error" || status=1 ;;
    lean) python3 benchmarks/startup_lean.py --rounds "${LEAN_ROUNDS:-3}" --out "$OUT/results" 2>&1 | grep -E "^round|median|Error|error" || status=1 ;;
    ab) python3 benchmarks/postprocess_ab.py ${AB_ARGS:?set AB_ARGS} --out "$OUT/results" 2>&1 | grep -vE "^(lucid_nb data|input problems|notes):" || status=1 ;;
    mepochs) python3 benchmarks/memory_epochs.py --out "$OUT/results" --tag "${MEPOCHS_TAG:-native}${LUCID_NB_COMMIT:+_$LUCID_NB_COMMIT}" \
               -- ${MEPOCHS_ARGS:-} 2>&1 | grep -E "peak reserved|Error|error" || status=1 ;;
    vparts) python3 benchmarks/validation_parts.py --trainer.max_epochs "${VPARTS_EPOCHS:-6}" --trainer.enable_progress_bar false \
              --trainer.default_root_dir /tmp/vparts > "$OUT/results/validation_parts.log" 2>&1 || status=1
            cp "$OUT/validation_parts.json" "$OUT/results/" 2>/dev/null; grep -A3 "under torch.profiler" "$OUT/results/validation_parts.log" | head -4 ;;
    hooks) python3 -c 'import sys; from lucid_nb.cli import main; sys.argv[0] = "lucid"; main()' fit --config configs/coco128-seg-n.yaml \
             --trainer.max_epochs 4 --trainer.enable_progress_bar false --trainer.default_root_dir /tmp/hooks \
             --trainer.profiler '{"class_path": "lightning.pytorch.profilers.SimpleProfiler", "init_args": {"dirpath": "'"$OUT/results"'", "filename": "simple_profiler"}}' \
             > "$OUT/results/hooks.log" 2>&1 || status=1
           ls "$OUT/results" | grep simple_profiler ;;
    ref*) b=${stage#ref}; b=${b%%x*}; n=${stage#*x}; first=0; part=()
          case $n in *@*) first=${n#*@}; n=${n%@*}; part=(--first-round "$first" --part "${LUCID_NB_COMMIT:+${LUCID_NB_COMMIT}_}r$first") ;; esac
          python3 benchmarks/reference_run.py --rounds "$n" --batch-size "$b" --arms "${ARMS:-native,head+optim,ul}" \
            "${part[@]}" --out "$OUT/results" 2>&1 | grep -E "^round|->|Error|error" || status=1 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
  echo "== $stage: $((SECONDS - t)) s"
done
exit $status
