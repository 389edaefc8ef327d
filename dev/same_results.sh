#!/usr/bin/env bash
# Does a change leave the CPU results alone? Runs the same training, planning and conversion commands with a
# baseline binary (built from the commit before the change) and with ./train_gpt, and compares what they print
# (timings removed), their main.log lines and every checkpoint file, byte for byte. A refactor that claims "the
# same bits" proves it here; the commands cover one rank, -r 2, accumulation with weight decay, experts, and
# under mpirun tp+sp, ZeRO-3, a zero-bubble pipeline, ep with ZeRO-1, cp and tp x pp; a Llama of GPT-2's 50257
# tokens (a vocab that is no multiple of 128, padded in memory), untied and tied, on one rank, under tp 2, ZeRO-2
# and pp 2, resumed under tp 2 and converted to llm.c's and Hugging Face's files, and with -r 2, experts, a
# zero-bubble pipeline and cp 2 x tp 2 with sp; --plan on both devices, --search and --convert.
#
#   git worktree add /tmp/before HEAD~1 && make -C /tmp/before train_gpt
#   bash dev/same_results.sh /tmp/before/train_gpt
#
# Needs the SOTU data (make train prepares it) and, for the layouts, mpirun. Exit code 1 when anything differs.
set -u
BASE=${1:?usage: dev/same_results.sh BASELINE_TRAIN_GPT}
NEW=${NEW:-./train_gpt}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader \
    OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_WAIT_POLICY=passive
MPIRUN="mpirun --oversubscribe --bind-to none"
same=0 differ=0

# timings and the paths of the two runs are the only things allowed to differ in what they print
strip() { sed -E -e 's/[0-9.]+ ms \| [0-9.]+ tok\/s( \| [0-9.]+% MFU)?/T/' -e 's/ in [0-9.]+ to [0-9.]+ s/ in T/g' \
                 -e 's/bubble [0-9.]+ measured \([^)]*\)/bubble T/' -e 's/step [0-9.]+ ms$/step T/' \
                 -e "s#$WORK/(base|new)#OUT#g" -e 's/ in [0-9.]+ s$//'; }

# case NAME LAUNCH FLAGS...: LAUNCH is "" for one process or "mpirun N"; -o goes to a directory of each run's own
run_case() {
    local name=$1 launch=$2; shift 2
    for side in base new; do
        local bin=$BASE; [ $side = new ] && bin=$NEW
        local out=$WORK/$side/$name cmd
        mkdir -p "$WORK/$side"
        if [ -n "$launch" ]; then cmd="$MPIRUN -np ${launch#mpirun } -x OMP_NUM_THREADS=1 $bin"; else cmd=$bin; fi
        # shellcheck disable=SC2086
        (eval "$cmd $* ${OUTFLAG:+-o $out}") >"$WORK/$side/$name.txt" 2>&1
        echo "exit $?" >>"$WORK/$side/$name.txt"
        strip <"$WORK/$side/$name.txt" >"$WORK/$side/$name.stripped"
    done
    local bad=""
    cmp -s "$WORK/base/$name.stripped" "$WORK/new/$name.stripped" || bad="output"
    if [ -n "${OUTFLAG:-}" ]; then
        for f in $(cd "$WORK/base/$name" && find . -type f ! -name train_gpt.lock | sort); do
            cmp -s "$WORK/base/$name/$f" "$WORK/new/$name/$f" || bad="$bad $f"
        done
        [ "$(cd "$WORK/base/$name" && find . -type f | sort)" = "$(cd "$WORK/new/$name" && find . -type f | sort)" ] ||
            bad="$bad (file lists)"
    fi
    if [ -z "$bad" ]; then
        same=$((same + 1)); echo "same    $name"
    else
        differ=$((differ + 1)); echo "DIFFERS $name:$bad"
        diff "$WORK/base/$name.stripped" "$WORK/new/$name.stripped" | head -20
    fi
}

small="-b 3 -t 32 -x 6 -v 3 -m 2 -s 5 -g 8 -l 1e-3 -c 0.1 -d 192"
OUTFLAG=1
run_case one "" -e d2c64h4t64 $small -n 3
run_case recompute2 "" -e d2c64h4t64 $small -r 2 -n 6
run_case experts "" -e d2c48h4t64e4k2 $small -n 6
run_case tp2 "mpirun 2" -e d2c64h4t64 $small --tp 2 -n 6 --debug-check-replicas 1
run_case zero3 "mpirun 2" -e d2c64h4t64 $small -z 3 -n 6
run_case pp2_zb "mpirun 2" -e d4c64h4t64 -b 1 -t 32 -x 4 -v 2 -m 2 -s 0 -l 1e-3 -c 0.1 -d 128 --pp 2 --pp-schedule zb -n 4
run_case ep2_zero1 "mpirun 2" -e d2c48h4t64e4k2 $small --ep 2 -z 1 -n 6
run_case cp2 "mpirun 2" -e d2c64h4t64 $small --cp 2 -n 6
run_case tp2_pp2 "mpirun 4" -e d4c64h4t64 -b 1 -t 32 -x 4 -v 2 -m 2 -s 0 -l 1e-3 -c 0.1 -d 128 --tp 2 --pp 2 -z 1 -n 4
run_case llama "" -e l2c64h4g2t64 $small -n 3
run_case llama_tied "" -e l2c64h4g2t64w $small -n 6
run_case llama_tp2 "mpirun 2" -e l2c64h4g2t64 $small --tp 2 -n 6
run_case llama_zero2 "mpirun 2" -e l2c64h4g2t64 $small -z 2 -n 6
run_case llama_pp2 "mpirun 2" -e l4c64h4g2t64w -b 1 -t 32 -x 4 -v 2 -m 2 -s 0 -l 1e-3 -c 0.1 -d 128 --pp 2 -n 4
run_case llama_recompute2 "" -e l2c64h4g2t64 $small -r 2 -n 6
run_case llama_experts "" -e l2c48h4g2t64e4k2 $small -n 6
run_case llama_pp2_zb "mpirun 2" -e l4c64h4g2t64 -b 1 -t 32 -x 4 -v 2 -m 2 -s 0 -l 1e-3 -c 0.1 -d 128 --pp 2 --pp-schedule zb -r 1 -n 4
run_case llama_cp2_sp "mpirun 4" -e l2c64h4g2t64 $small --cp 2 --tp 2 --sp 1 -n 6
# resumes: the one-rank run's step-3 checkpoint under tp 2, and the tp x pp run's under one rank
for side in base new; do
    bin=$BASE; [ $side = new ] && bin=$NEW
    for run in one llama; do
        cp -r "$WORK/$side/$run" "$WORK/$side/${run}_resumed" && rm -f "$WORK/$side/${run}_resumed/ckpt_00000006/"* &&
            rmdir "$WORK/$side/${run}_resumed/ckpt_00000006"
    done
done
OUTFLAG=
run_case resume_tp2 "mpirun 2" -e d2c64h4t64 $small --tp 2 -y 1 -o '$WORK/$side/one_resumed'
run_case llama_resume_tp2 "mpirun 2" -e l2c64h4g2t64 $small --tp 2 -y 1 -o '$WORK/$side/llama_resumed'
run_case convert "" --convert '$WORK/$side/one/ckpt_00000006' --to '$WORK/$side/converted.bin'
cmp -s "$WORK/base/converted.bin" "$WORK/new/converted.bin" && echo "same    converted.bin" ||
    { differ=$((differ + 1)); echo "DIFFERS converted.bin"; }
run_case convert_bf16 "" --convert '$WORK/$side/one/ckpt_00000006' --to '$WORK/$side/converted16.bin' --dtype bf16
cmp -s "$WORK/base/converted16.bin" "$WORK/new/converted16.bin" && echo "same    converted16.bin" ||
    { differ=$((differ + 1)); echo "DIFFERS converted16.bin"; }
run_case init_from_file "" -e '$WORK/$side/converted.bin' $small -x 2 -s 0
run_case llama_convert "" --convert '$WORK/$side/llama_tied/ckpt_00000006' --to '$WORK/$side/llama.bin'
cmp -s "$WORK/base/llama.bin" "$WORK/new/llama.bin" && echo "same    llama.bin" ||
    { differ=$((differ + 1)); echo "DIFFERS llama.bin"; }
run_case llama_hf "" --convert '$WORK/$side/llama.bin' --to '$WORK/$side/llama_hf' --format hf
for f in config.json model.safetensors; do
    cmp -s "$WORK/base/llama_hf/$f" "$WORK/new/llama_hf/$f" && echo "same    llama_hf/$f" ||
        { differ=$((differ + 1)); echo "DIFFERS llama_hf/$f"; }
done
run_case llama_from_hf "" -e '$WORK/$side/llama_hf' $small -x 2 -s 0
run_case plan_cpu "" -e d12 -b 4 -t 1024 --plan --world 8 --tp 2 --pp 2 -z 1 -r 1
run_case plan_gpu "" -e d48 -b 8 -t 1024 --device cuda --plan --world 64 --tp 4 --pp 4 --pp-schedule interleaved --vpp 2 -z 1 --cp 2
run_case plan_gpu_moe "" -e d12e8k2 -b 4 -t 1024 --device cuda --plan --world 16 --ep 4 -z 2 --pp 2 --pp-schedule zb
run_case search "" -e d36 -t 1024 -d 524288 --device cuda --search --gpus 64
echo "$same same, $differ differ"
[ $differ -eq 0 ]
