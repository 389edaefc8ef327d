#!/usr/bin/python3
"""Run several of this directory's reference scripts in one interpreter that imports torch once.

    /usr/bin/python3 test/reference/make_references.py 'make_reference.py --out DIR' 'make_llama_reference.py --kv 2 --out DIR2' ...

Each argument is one script's command line (the script by its name in this directory). Importing torch takes
about 2 of the 2.5 CPU-seconds a reference model costs, so the test build's 17 references take about 10 seconds
this way instead of 45. Each script runs in a child forked after the import, with its module loaded afresh (the
scripts keep their shapes in module globals, which a run sets for itself), exactly as it runs alone; the first
that fails stops the rest and sets the exit status.
"""

import importlib
import os
import shlex
import sys
import traceback

import numpy  # noqa: F401  (loaded once, before the forks)
import torch  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))


def run(command):
    script, *args = shlex.split(command)
    pid = os.fork()
    if pid == 0:
        try:
            sys.path.insert(0, HERE)
            sys.argv = [os.path.join(HERE, script)] + args
            importlib.import_module(os.path.splitext(script)[0]).main()
            status = 0
        except SystemExit as e:  # argparse's errors among them
            status = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main():
    for command in sys.argv[1:]:
        status = run(command)
        if status != 0:
            print(f"make_references.py: {command}: exit status {status}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
