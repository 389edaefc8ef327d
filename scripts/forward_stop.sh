# Sourced (not run) by the training scripts: launch_forwarding_stop runs a launcher (mpirun, srun) and passes a
# stop request that reaches this script on to it as SIGUSR1; requeue_after_notice puts a Slurm job that the
# advance notice stopped back in the queue.
#
# Why SIGUSR1: train_gpt stops after its current step with a checkpoint on the first SIGTERM, SIGINT, SIGUSR1 or
# SIGUSR2 (exit 5), however long the step and the checkpoint take. OpenMPI's mpirun passes SIGUSR1 on to every
# rank and then exits with the ranks' status, 5; a SIGTERM, though, makes mpirun abort the job: it waits
# odls_base_sigkill_timeout seconds (1 by default), sends the ranks SIGTERM, waits as long again, kills them,
# and exits 1. srun passes both on. So a SIGTERM (a time limit, scancel, kill) or SIGUSR1 (the advance notice
# `sbatch --signal=B:USR1@SECONDS` asks for) sent to this script reaches the ranks as SIGUSR1, and the job's exit
# status is 5, the trainer's own.
#
# After it returns: the launcher's exit status is its return value, and STOP_SIGNAL names the first signal this
# script received (SIGTERM, SIGINT, SIGUSR1, SIGUSR2), or is empty.

STOP_SIGNAL=""
launcher_pid=""
launcher_interrupted=0

# the trap of each stop signal: say it once, pass SIGUSR1 on
forward_stop() {
    launcher_interrupted=1
    if [ -z "$STOP_SIGNAL" ]; then
        STOP_SIGNAL=$1
        echo "${0##*/}: $1: asking the ranks to stop after their step with a checkpoint (SIGUSR1 to pid $launcher_pid)" >&2
    fi
    kill -USR1 "$launcher_pid" 2>/dev/null || true
}

# launch_forwarding_stop COMMAND ARGS...: runs COMMAND in the background, forwarding stop signals, until it ends
launch_forwarding_stop() {
    local sig status
    for sig in TERM INT USR1 USR2; do trap "forward_stop SIG$sig" "$sig"; done
    "$@" &
    launcher_pid=$!
    # a signal that came before the launcher had a pid
    if [ -n "$STOP_SIGNAL" ]; then kill -USR1 "$launcher_pid" 2>/dev/null || true; fi
    # a trapped signal ends `wait` early (status 128 + the signal) with the launcher still running: wait again
    # until it has ended (bash keeps an ended child's status for the next wait)
    while :; do
        launcher_interrupted=0
        status=0
        wait "$launcher_pid" || status=$?
        [ "$launcher_interrupted" = 1 ] || break
    done
    trap - TERM INT USR1 USR2
    return "$status"
}

# requeue_after_notice STATUS: after launch_forwarding_stop under Slurm, requeues the job when the advance SIGUSR1
# stopped it (STATUS, the launcher's, is 5, or the status srun gives when --kill-on-bad-exit ends the tasks still
# finalizing after the first one left): the checkpoint is written, and the requeued job resumes from it. A
# SIGTERM (scancel, or the time limit itself) is not requeued.
requeue_after_notice() {
    if [ "$STOP_SIGNAL" = SIGUSR1 ] && [ "$1" != 0 ]; then
        echo "job $SLURM_JOB_ID: stopped by the advance SIGUSR1 (exit $1); requeued to go on from its checkpoint"
        scontrol requeue "$SLURM_JOB_ID"
    fi
}
