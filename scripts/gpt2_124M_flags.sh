# Sourced (not run) by scripts/run_gpt2_124M.sh and scripts/multi_node/mpirun_hostfile.sh: the training settings
# of llm.c's GPT-2 124M (d12) recipe, each read from the environment with its default set here in
# `: "${NAME:=default}"` form, and TRAIN_GPT_ARGS, the train_gpt flag list built from them (EXTRA_ARGS last).
# The sourcing script launches `./train_gpt "${TRAIN_GPT_ARGS[@]}"` under its own launcher.
#
# Variables (set in the environment; default in brackets):
#   DEVICE        cuda | cpu, passed as --device                                            [cuda]
#   COMM          communication backend, passed as --comm                [nccl for cuda, mpi for cpu]
#   TRAIN_DATA    train shards (glob), -i                                                   [data/sotu/train.bin]
#   VAL_DATA      val shards (glob), -j                                                     [data/sotu/val.bin]
#   MODEL         -e: a descriptor (d12 = GPT-2 124M) or an llm.c model file                [d12]
#   OUT_DIR       -o: main.log and checkpoints                                              [log124M]
#   MICRO_BATCH   -b: sequences per rank per micro-step                                     [64]
#   SEQ_LEN       -t: sequence length                                                       [1024]
#   TOTAL_BATCH   -d: tokens per optimizer step                                             [524288]
#   LR            -l: peak learning rate                                                    [6e-4]
#   FINAL_LR_FRAC -q: final learning rate as a fraction of LR                               [0.0]
#   WARMUP        -u: warmup steps                                                          [700]
#   WEIGHT_DECAY  -c                                                                        [0.1]
#   MAX_STEPS     -x: training steps, -1 = one epoch of TRAIN_DATA                          [-1]
#   VAL_EVERY     -v: validate every N steps                                                [250]
#   SAMPLE_EVERY  -s: sample every N steps                                                  [20000]
#   GEN_TOKENS    -g: tokens per sample                                                     [144]
#   CKPT_EVERY    -n: checkpoint every N steps                                              [5000]
#   RESUME        -y: 1 = resume from the newest checkpoint in OUT_DIR (or start fresh)     [1]
#   ZERO          -z: ZeRO stage                                                            [1]
#   EXTRA_ARGS    more train_gpt flags, split on spaces                                     []

: "${DEVICE:=cuda}"
if [ "$DEVICE" = cuda ]; then : "${COMM:=nccl}"; else : "${COMM:=mpi}"; fi
: "${TRAIN_DATA:=data/sotu/train.bin}"
: "${VAL_DATA:=data/sotu/val.bin}"
: "${MODEL:=d12}"
: "${OUT_DIR:=log124M}"
: "${MICRO_BATCH:=64}"
: "${SEQ_LEN:=1024}"
: "${TOTAL_BATCH:=524288}"
: "${LR:=6e-4}"
: "${FINAL_LR_FRAC:=0.0}"
: "${WARMUP:=700}"
: "${WEIGHT_DECAY:=0.1}"
: "${MAX_STEPS:=-1}"
: "${VAL_EVERY:=250}"
: "${SAMPLE_EVERY:=20000}"
: "${GEN_TOKENS:=144}"
: "${CKPT_EVERY:=5000}"
: "${RESUME:=1}"
: "${ZERO:=1}"
: "${EXTRA_ARGS:=}"

read -r -a extra_args <<< "$EXTRA_ARGS"
TRAIN_GPT_ARGS=(
    --device "$DEVICE"
    --comm "$COMM"
    -i "$TRAIN_DATA"
    -j "$VAL_DATA"
    -o "$OUT_DIR"
    -e "$MODEL"
    -b "$MICRO_BATCH" -t "$SEQ_LEN"
    -d "$TOTAL_BATCH"
    -l "$LR" -q "$FINAL_LR_FRAC" -u "$WARMUP"
    -c "$WEIGHT_DECAY"
    -x "$MAX_STEPS"
    -v "$VAL_EVERY" -s "$SAMPLE_EVERY" -g "$GEN_TOKENS"
    -n "$CKPT_EVERY" -y "$RESUME"
    -z "$ZERO"
    "${extra_args[@]}"
)
