"""Reading the JSON file `train_gpt --profile FILE` writes, for the scripts that draw it (plot_memory.py,
plot_profile.py): a file that cannot be read, is not JSON, or lacks what the script reads is one line naming the
script and the file, and exit status 1, never a traceback."""
import json
import sys


def read_profile_file(script, path, extract):
    """extract(profile), the profile the parsed JSON object; a missing key or a value of the wrong type ends the
    script with one line."""
    try:
        with open(path) as f:
            profile = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"{script}: {path}: {e}")
    try:
        return extract(profile)
    except KeyError as e:
        sys.exit(f"{script}: {path}: no {json.dumps(e.args[0])} (is it a train_gpt --profile file?)")
    except (TypeError, ValueError, AttributeError) as e:
        sys.exit(f"{script}: {path}: not a train_gpt --profile file ({e})")
