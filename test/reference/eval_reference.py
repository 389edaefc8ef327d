#!/usr/bin/python3
"""Score a multiple-choice eval file (llm.c's format, e.g. HellaSwag) with a Hugging Face model directory.

    /usr/bin/python3 test/reference/eval_reference.py --hf DIR --eval FILE

An independent scoring to compare train_gpt's with, example by example: the float64 GPT-2 and Llama forwards of
hf_reference.py, and a parser of the eval file written from llm.c's dev/data/data_common.py write_evalfile (a
header of 256 int32: 20240522, version 1, N examples, the longest example in bytes; then per example a stream
of uint16: 65535, its length in bytes, its index, the label, the number of completions, the context's token
count and tokens, and each completion's token count and tokens). Each completion is scored as llm.c's
hellaswag.py does: its row is the context followed by the completion, and its loss is the mean cross-entropy
(nats) of the completion's tokens, each predicted from every token before it; the lowest loss is the
prediction (a tie: the lowest index). Prints one line per example, in file order,

    INDEX LABEL PREDICTED L0 L1 ... L{n-1}      (each loss as '%.9g')

then `accuracy CORRECT/N`. Exit 0: scored, 2: a bad input (one line on stderr).
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_reference import ARCHITECTURES, BadInput, Config, Weights, read_headed, read_weights  # noqa: E402

EVAL_MAGIC, EVAL_VERSION, EXAMPLE_START = 20240522, 1, 65535
# config.json's key for the longest row each architecture can take
POSITIONS = {"GPT2LMHeadModel": "n_positions", "LlamaForCausalLM": "max_position_embeddings"}


def read_eval(path):
    """[(index, label, context, [completion, ...])] of an eval file, token lists as Python ints, checked whole."""
    data, h = read_headed(path, EVAL_MAGIC, EVAL_VERSION, "an eval file")
    n, longest = int(h[2]), int(h[3])
    if n <= 0:
        raise BadInput(f"{path}: the header says {n} examples")
    if (len(data) - 1024) % 2:
        raise BadInput(f"{path}: {len(data) - 1024} bytes after the header, not a whole number of uint16")
    s = np.frombuffer(data, dtype="<u2", offset=1024).astype(np.int64).tolist()
    examples, at = [], 0
    for i in range(n):
        where = f"{path}: example {i} (at byte {1024 + 2 * at})"
        if len(s) - at < 2:
            raise BadInput(f"{where}: the file ends, but the header says {n} examples")
        if s[at] != EXAMPLE_START:
            raise BadInput(f"{where}: starts with {s[at]}, not the delimiter {EXAMPLE_START}")
        nbytes = s[at + 1]
        if nbytes % 2 or nbytes < 18:  # 18: the 6 fields, one context token, one completion of one token
            raise BadInput(f"{where}: a length of {nbytes} bytes, odd or too short for one example")
        if at + nbytes // 2 > len(s):
            raise BadInput(f"{where}: a length of {nbytes} bytes runs past the end of the file")
        if nbytes > longest:
            raise BadInput(f"{where}: {nbytes} bytes, longer than the header's longest example ({longest})")
        ex, at = s[at + 2:at + nbytes // 2], at + nbytes // 2  # index, label, completions, then token lists
        index, label, count = ex[:3]
        if index != i:
            raise BadInput(f"{where}: index {index}, expected {i}")
        if count < 1 or label >= count:
            raise BadInput(f"{where}: label {label} of {count} completions")
        lists, k = [], 3
        for j in range(1 + count):  # the context, then each completion: a token count, then the tokens
            part = "its context" if j == 0 else f"completion {j - 1}"
            if k >= len(ex) or k + 1 + ex[k] > len(ex):
                raise BadInput(f"{where}: its {nbytes} bytes end within {part} ({count} completions)")
            if ex[k] < 1:
                raise BadInput(f"{where}: {part} has no tokens")
            lists.append(ex[k + 1:k + 1 + ex[k]])
            k += 1 + ex[k]
        if k != len(ex):
            raise BadInput(f"{where}: {2 * (len(ex) - k)} bytes left over after its last completion")
        examples.append((index, label, lists[0], lists[1:]))
    if at != len(s):
        raise BadInput(f"{path}: {2 * (len(s) - at)} bytes after the {n} examples the header says")
    return examples


def load_model(hf_dir):
    """(forward, config, weights, vocab size, longest row) of the model in hf_dir."""
    cfg = Config(os.path.join(hf_dir, "config.json"))
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise BadInput(f"{cfg.path}: architectures {cfg.get('architectures')} "
                       f"(expected one of {', '.join(ARCHITECTURES)})")
    source = os.path.join(hf_dir, "model.safetensors")  # named in complaints about the tensors
    source += ".index.json" if os.path.exists(source + ".index.json") else ""
    forward = ARCHITECTURES[arch][1]
    return forward, cfg, Weights(read_weights(hf_dir), source), cfg.need("vocab_size"), cfg.need(POSITIONS[arch])


def score(hf_dir, eval_path):
    """[(index, label, predicted, [mean loss of each completion])] of every example in the eval file."""
    forward, cfg, weights, vocab, positions = load_model(hf_dir)
    results = []
    for index, label, context, completions in read_eval(eval_path):
        losses = []
        for c, completion in enumerate(completions):
            row = context + completion
            if len(row) > positions:
                raise BadInput(f"{eval_path}: example {index} completion {c}: a row of {len(row)} tokens, more "
                               f"than the {positions} positions of {cfg.path}")
            if max(row) >= vocab:
                raise BadInput(f"{eval_path}: example {index} completion {c}: token {max(row)} outside the "
                               f"vocabulary of {vocab} ({cfg.path})")
            with torch.no_grad():
                logits = forward(cfg, weights, torch.tensor([row], dtype=torch.int64))[0]
            # position t predicts row[t + 1]: the completion's tokens from the last context position on
            first = len(context) - 1
            targets = torch.tensor(completion, dtype=torch.int64)
            losses.append(float(F.cross_entropy(logits[first:first + len(completion)], targets)))
        predicted = min(range(len(losses)), key=lambda c: (losses[c], c))  # a tie: the lowest index
        results.append((index, label, predicted, losses))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="a Hugging Face model directory (config.json, model.safetensors)")
    ap.add_argument("--eval", required=True, help="an eval file in llm.c's format (e.g. hellaswag_val.bin)")
    args = ap.parse_args()
    try:
        results = score(args.hf, args.eval)
    except BadInput as e:
        print(f"eval_reference: {e}", file=sys.stderr)
        return 2
    for index, label, predicted, losses in results:
        print(f"{index} {label} {predicted} " + " ".join("%.9g" % loss for loss in losses))
    print(f"accuracy {sum(r[1] == r[2] for r in results)}/{len(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
