#!/usr/bin/env python3
# Compares the per-step losses of metrics files (JSON lines, `spillway train --metrics`)
# with a reference run's, bit for bit (losses are written with 9 significant digits).
# usage: same_losses.py LABEL REFERENCE.jsonl OTHER.jsonl...   prints one line per OTHER;
# exits 1 when any differs or cannot be read.
import json
import sys


def losses(path):
    try:
        return [json.loads(line)["loss"] for line in open(path)]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable ({e})"


label, reference, others = sys.argv[1], sys.argv[2], sys.argv[3:]
ref = losses(reference)
differ = False
for path in others:
    got = losses(path)
    verdict = "IDENTICAL" if isinstance(ref, list) and got == ref else "DIFFERENT"
    differ = differ or verdict != "IDENTICAL"
    print(f"{label}: {path} vs {reference}: {verdict} ({len(ref) if isinstance(ref, list) else ref} steps) {got}")
sys.exit(1 if differ else 0)
